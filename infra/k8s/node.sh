#!/usr/bin/env bash
# A real Kubernetes node on this machine: the control plane of infra/k8s/cluster.sh plus a kubelet running real
# containers (containerd + runc), pod networking (CNI bridge + host-local + portmap), Service routing (kube-proxy,
# iptables mode), NetworkPolicy enforcement (kube-router's firewall controller: iptables + ipset) and cluster DNS
# (CoreDNS), all pinned in infra/versions.env and built once (infra/k8s/build.sh node).
# No registry is needed: the sandbox and CoreDNS images are built here (buildah, from scratch) and the project's
# images (make images) are loaded into the node's runtime from podman's storage.
#
# Usage: infra/k8s/node.sh up|down|status|load|monitoring|provisioner|recycle|check|reset|leftovers|lose N|nodes
#   up      build what is missing, install Debian's runc / CNI plugins / iptables / ipset / buildah when absent,
#           start etcd + API server + controller manager + scheduler, containerd, the kubelet, kube-proxy,
#           kube-router (NetworkPolicies; KAPPA_CLUSTER_NETPOL=none leaves them unenforced) and CoreDNS,
#           create local PersistentVolumes, load the project's images when built; wait until the node is Ready
#           and DNS answers; prints `export KUBECONFIG=...`. Idempotent.
#   down    stop every pod's containers, the node and the control plane, then undo what they set up on the
#           machine: the mounts, the pods' network namespaces (and their veths), the kappa0 bridge, every iptables /
#           ip6tables chain of the kubelet, kube-proxy, kube-router and the CNI plugins (and the rules jumping to
#           them), kube-router's ipsets, the CNI plugin's address reservations, the pods' cgroups.
#           State (etcd, volumes, containerd's images) stays in the state folder; `up` starts from it again.
#   leftovers  what of a node is still on the machine (processes, bridge, network namespaces, mounts, chains,
#           ipsets), one line each; exits 1 when anything is (after `down`: nothing).
#   check   whether this machine can run a node (root, cgroups): one line saying why not, exit 1.
#   reset   down, then forget the cluster (etcd, volumes, the kubelet's pods); keeps the binaries, certificates
#           and containerd's images: the next `up` is a fresh cluster with the images loaded.
#   status  what runs.
#   recycle empty the local PersistentVolumes whose claims were deleted (their data is gone) so new claims bind.
#   monitoring  the Prometheus operator and a Prometheus in namespace monitoring (built once from the Go module
#           proxy: infra/prometheus/build.sh prometheus|operator; scratch images), scraping what the PodMonitors of
#           every namespace select and evaluating every PrometheusRule - kube-prometheus-stack's part the chart
#           uses, without a registry. Needs a running node.
#   provisioner  dynamic volumes: Rancher's local-path-provisioner (built once from the Go module proxy, scratch
#           image) and its StorageClass local-path (not the cluster's default): a claim gets a folder of the node its
#           pod runs on, made by a helper pod, removed with the claim. Needs a running node and make images' bases.
#   load    import the project's images (localhost/kappa/*, built by make images) into each node's runtime when
#           the runtime lacks them or holds an older build; the older builds' records go (their disk is freed).
#   lose N  node N (1..) lost as a machine is: its network unplugged, then its kubelet, containerd, kube-proxy,
#           kube-router and every container on it killed. The node goes NotReady; `up` brings it back.
#   nodes   the nodes this state folder has, a line each: name, address, pod network, running or not.
#
# More than one node (KAPPA_CLUSTER_NODES=N, make cluster-up NODES=N): node 0 (kappa-node) is the host's own network,
# as with one node; nodes 1..N-1 (kappa-node-1, ...) each live in a network namespace of their own (kappa-node-<i>,
# address 10.250.0.<10+i> on the host's bridge kappa-nodes, 10.250.0.1), with their own containerd (root, state and
# socket), kubelet (cgroupRoot /kappa-node-<i>, its own root folder, pod logs, certificate system:node:kappa-node-<i>),
# kube-proxy and kube-router (their iptables and ipsets are the namespace's), pod network 10.244.<i>.0/24 on a bridge
# kappa0 of their own and local PersistentVolumes; the host routes each pod network to its node. Pods keep their
# addresses from node to node (NetworkPolicies match them); leaving the pods' network they are masqueraded once, on
# the host. All nodes share the machine's cores and memory: each reports the whole machine as its capacity.
#
# Needs root (a kubelet manages cgroups, mounts and iptables). Environment: KAPPA_CLUSTER_HOME (state folder,
# default <repo>/.kappa/cluster), KAPPA_CLUSTER_PORT (API server, default 26443), KAPPA_CLUSTER_ETCD_PORT (default
# 33790; peer = +1), KAPPA_CLUSTER_PVS (local PersistentVolumes, default 12), KAPPA_NODE_IP (default: the address of
# the default route), KAPPA_CLUSTER_NODES (default 1). Ports on the host: 10250 (kubelet), 10248 / 10249 / 10256
# on loopback (health, metrics); the other nodes' are in their namespaces. One cluster per machine.
#
# What this machine needs, found the hard way (details in docs/deploy.md, "Run it on one machine"): containerd's
# restrict_oom_score_adj (the VM lacks CAP_SYS_RESOURCE, so runc cannot lower a sandbox's oom_score_adj), kubelet's
# failCgroupV1: false + cgroupfs (cgroups v1 here), a CNI conf dir of our own (Debian's podman puts a bridge conflist
# in /etc/cni/net.d), the API server advertising the node's address (pods reach the API through the `kubernetes`
# Service).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
HOME_DIR="${KAPPA_CLUSTER_HOME:-$ROOT/.kappa/cluster}"
PORT="${KAPPA_CLUSTER_PORT:-26443}"
ETCD_PORT="${KAPPA_CLUSTER_ETCD_PORT:-33790}"
PVS="${KAPPA_CLUSTER_PVS:-12}"
NETPOL="${KAPPA_CLUSTER_NETPOL:-kube-router}"
NODES="${KAPPA_CLUSTER_NODES:-1}"
[[ "$NODES" =~ ^[1-9]$ ]] || { echo "cluster: error: KAPPA_CLUSTER_NODES=$NODES: give 1 to 9 nodes" >&2; exit 2; }
CLUSTER_DNS=10.96.0.10
PKI="$HOME_DIR/pki"
KUBECONFIG_FILE="$HOME_DIR/admin.kubeconfig"
# nodes 1..: a network namespace each, on the host's bridge; every node's pod network is inside CLUSTER_CIDR
NODES_BRIDGE=kappa-nodes; NODES_NET=10.250.0; CLUSTER_CIDR=10.244.0.0/16
# what leaves the pods' network, masqueraded once on the host (between nodes pods keep their addresses)
EGRESS_RULE=(POSTROUTING -s "$CLUSTER_CIDR" ! -d "$CLUSTER_CIDR" -m comment --comment kappa-pods-egress -j MASQUERADE)

use_node() {  # use_node <i>: the globals naming node i - 0 the host's own network, 1.. a network namespace each
    local i="$1"
    if (( i == 0 )); then
        NODE_NAME=kappa-node; NODE_DIR="$HOME_DIR"; NETNS=""; CGROUP_ROOT=""; NS=()
        # containerd's state (shim sockets) must stay short and on tmpfs
        CTR_STATE=/run/kappa-containerd
    else
        NODE_NAME="kappa-node-$i"; NODE_DIR="$HOME_DIR/nodes/$NODE_NAME"; NETNS="$NODE_NAME"
        CGROUP_ROOT="/$NODE_NAME"; NS=(nsenter "--net=/run/netns/$NETNS" --)
        CTR_STATE="/run/kappa-containerd-$i"
    fi
    NODE_INDEX="$i"; POD_CIDR="10.244.$i.0/24"
    RUN="$NODE_DIR/run"; LOGS="$NODE_DIR/logs"; CONF="$NODE_DIR/node"
    CTR_SOCK="$CTR_STATE/containerd.sock"
}
use_node 0
log() { echo "cluster: $*" >&2; }
die() { echo "cluster: error: $*" >&2; exit 1; }
# shellcheck source=infra/k8s/lib.sh
. "$ROOT/infra/k8s/lib.sh"

node_ip() {  # the current node's address: node 0 the host's (the default route's), node i 10.250.0.<10+i>
    (( NODE_INDEX == 0 )) || { echo "$NODES_NET.$((10 + NODE_INDEX))"; return; }
    [[ -n "${KAPPA_NODE_IP:-}" ]] && { echo "$KAPPA_NODE_IP"; return; }
    ip -4 route get 192.0.2.123 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") {print $(i + 1); exit}}'
}

check() {  # can this machine run a node? One line on stderr saying why not
    [[ "$(id -u)" == 0 ]] || die "cannot run a node here: not root (a kubelet needs root for cgroups, mounts and iptables)"
    grep -qE '^[^ ]+ /sys/fs/cgroup(/[^ ]*)? (cgroup|cgroup2|tmpfs) ' /proc/mounts \
        || die "cannot run a node here: no cgroup filesystem at /sys/fs/cgroup"
    local c
    for c in cpu memory pids; do
        [[ -d "/sys/fs/cgroup/$c" ]] || grep -qw "$c" /sys/fs/cgroup/cgroup.controllers 2>/dev/null \
            || die "cannot run a node here: no $c cgroup controller (a kubelet limits pods with it)"
    done
    # the imported images (~6 GB a node) and the pods' volumes live under the checkout; under 2 GiB free the kubelet
    # taints the node (disk-pressure) and schedules nothing: a helm install --wait then waits for its whole timeout.
    # A node whose runtime already holds the images (one started before) needs room for its volumes only.
    local free_gb need=3 new=0 i
    mkdir -p "$HOME_DIR"
    for ((i = 0; i < NODES; i++)); do
        (use_node "$i"; [[ -d "$NODE_DIR/containerd" ]]) || new=$((new + 1))
    done
    (( new == 0 )) || need=$(( 4 + 6 * new ))
    free_gb=$(( $(df -Pk "$HOME_DIR" | awk 'NR==2 {print $4}') / 1048576 ))
    (( free_gb >= need )) || die "cannot run a node here: ${free_gb} GiB free on the disk of $HOME_DIR (${need} GiB needed: $([[ $new -gt 0 ]] && echo "the images for $new new node(s), ~6 GiB each, and volumes" || echo "room for the pods' volumes above the kubelet's 2 GiB eviction threshold"))"
    # one node per machine: containerd's state folder and the kubelet's port are fixed
    if [[ -S "$CTR_SOCK" ]] && ! alive containerd && pgrep -f "containerd --config .*node/containerd.toml" >/dev/null; then
        die "cannot run a node here: another checkout's node runs on this machine ($CTR_SOCK); stop it with its make cluster-down"
    fi
    return 0
}

prerequisites() {
    check
    local pkgs=() p
    for p in runc:/usr/sbin/runc containernetworking-plugins:/usr/lib/cni/bridge iptables:/usr/sbin/iptables \
             conntrack:/usr/sbin/conntrack ipset:/usr/sbin/ipset buildah:/usr/bin/buildah podman:/usr/bin/podman; do
        [[ -x "${p#*:}" ]] || pkgs+=("${p%%:*}")
    done
    if [[ ${#pkgs[@]} -gt 0 ]]; then
        log "installing ${pkgs[*]} (Debian)"
        apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >&2
    fi
    # pods route through the host; bridged traffic must pass iptables for Service (kube-proxy) rules
    modprobe br_netfilter 2>/dev/null || true
    sysctl -qw net.ipv4.ip_forward=1
    [[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]] && sysctl -qw net.bridge.bridge-nf-call-iptables=1
    return 0
}

node_certs() {  # each kubelet's, kube-proxy's and kube-router's client certificates, signed by the cluster CA
    printf 'extendedKeyUsage=clientAuth\n' > "$PKI/client.ext"
    [[ -f "$PKI/$(kubelet_cert).crt" ]] || sign "$(kubelet_cert)" "/O=system:nodes/CN=system:node:$NODE_NAME" client.ext
    [[ -f "$PKI/kube-proxy.crt" ]] || sign kube-proxy "/CN=system:kube-proxy" client.ext
    [[ -f "$PKI/kube-router.crt" ]] || sign kube-router "/CN=kappa:kube-router" client.ext
}

put() {  # put <file>: stdin into the file, only when it differs (kube-proxy exits when its config file changes)
    local tmp="$1.tmp.$$"
    cat > "$tmp"
    if cmp -s "$tmp" "$1"; then rm -f "$tmp"; else mv "$tmp" "$1"; fi
}

kubelet_cert() {  # the current node's kubelet certificate's name in $PKI
    if (( NODE_INDEX == 0 )); then echo kubelet; else echo "kubelet-$NODE_NAME"; fi
}

kubeconfig_for() {  # kubeconfig_for <name> [certificate]: a kubeconfig with <name>'s (or that) client certificate;
    # node 0 reaches the API server on loopback, the others at the host's address (in the server's certificate)
    local api=127.0.0.1 cert="${2:-$1}"
    (( NODE_INDEX == 0 )) || api="$HOST_IP"
    put "$CONF/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kappa
  cluster: {server: "https://$api:$PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$PKI/$cert.crt", client-key: "$PKI/$cert.key"}
contexts:
- name: kappa
  context: {cluster: kappa, user: $1}
current-context: kappa
EOF
}

configs() {
    mkdir -p "$CONF/cni" "$NODE_DIR/kubelet" "$NODE_DIR/pod-logs" "$NODE_DIR/containerd" "$CTR_STATE"
    # one node's pods keep their address on the way to another's (NetworkPolicies match it): with more than one
    # node the bridge plugin masquerades nothing and the host masquerades what leaves the pods' network
    local masq=true cluster_cidr="$POD_CIDR"
    (( NODES == 1 )) || { masq=false; cluster_cidr="$CLUSTER_CIDR"; }
    # containerd v2 as the kubelet's CRI runtime: Debian's runc through the v2 shim, cgroupfs, our sandbox image
    put "$CONF/containerd.toml" <<EOF
version = 3
root = "$NODE_DIR/containerd"
state = "$CTR_STATE"
[grpc]
  address = "$CTR_SOCK"
[plugins.'io.containerd.nri.v1.nri']
  # its socket (/var/run/nri/nri.sock) is one per machine; no NRI plugin is used
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '$PAUSE_IMAGE'
[plugins.'io.containerd.cri.v1.runtime']
  # no CAP_SYS_RESOURCE in this VM: runc cannot set the sandbox's oom_score_adj -998; clamp to containerd's own
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '/usr/sbin/runc'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '$CONF/cni'
EOF
    put "$CONF/cni/10-kappa.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "kappa-pods",
  "plugins": [
    {
      "type": "bridge", "bridge": "kappa0", "isGateway": true, "ipMasq": $masq, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
               "dataDir": "$NODE_DIR/cni-ipam"}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
    kubeconfig_for kubelet "$(kubelet_cert)"
    kubeconfig_for kube-proxy
    kubeconfig_for kube-router
    local cgroup_root_line=""  # the machine's other nodes have cgroup roots of their own
    [ -z "$CGROUP_ROOT" ] || cgroup_root_line="cgroupRoot: $CGROUP_ROOT"$'\n'
    put "$CONF/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroups v1 (hybrid) here: 1.37's default failCgroupV1=true would refuse to start
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$CTR_SOCK
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
podLogsDir: "$NODE_DIR/pod-logs"
${cgroup_root_line}resolvConf: /etc/resolv.conf
clusterDomain: cluster.local
clusterDNS: [$CLUSTER_DNS]
failSwapOn: false
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
# the images are imported, not pulled: image GC must never delete them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# the disk is shared with the host's own work (builds, podman's storage): the default percentages (imagefs under
# 15 % free) made the kubelet evict every pod and delete the imported images while ~40 GB were still free
evictionHard:
  memory.available: 256Mi
  nodefs.available: 2Gi
  imagefs.available: 2Gi
  nodefs.inodesFree: 5%
maxPods: 110
EOF
    put "$CONF/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$CONF/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: $cluster_cidr
hostnameOverride: $NODE_NAME
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# leave the host's conntrack table size alone
conntrack: {maxPerCore: 0}
EOF
}

ctr_() {  # ctr against the node's containerd (without its per-call cgroup v1 deprecation notice)
    "$NODE_BIN/ctr" --address "$CTR_SOCK" -n k8s.io "$@" 2> >(grep -v 'DEPRECATION: The support for cgroup v1' >&2)
}

podman_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null; }

import_image() {  # import_image <podman image>: into containerd's k8s.io namespace unless it holds that build
    local ref="$1" id have
    id="$(podman_id "$ref")" || die "image $ref is not in podman's storage"
    have="$(ctr_ images ls "name==$ref" 2>/dev/null | awk -v r="$ref" '$1 == r' | grep -o 'kappa.podman-id=[^,[:space:]]*' || true)"
    [[ "$have" == "kappa.podman-id=$id" ]] && return 0
    local t=$SECONDS
    podman save --format docker-archive "$ref" | ctr_ images import - >/dev/null \
        || die "importing $ref into $NODE_NAME's runtime failed"
    ctr_ images label "$ref" "kappa.podman-id=$id" >/dev/null
    log "loaded $ref into $NODE_NAME ($((SECONDS - t)) s)"
}

scratch_image() {  # scratch_image <ref> <binary> <uid> [entrypoint args...]: a one-binary image, built once
    binary_image "$1" "$2" "/$(basename "$1" | cut -d: -f1)" "${@:3}"
}

binary_image() {  # binary_image <ref> <binary> <path in the image> <uid> [entrypoint args...]: from scratch, once
    local ref="$1" bin="$2" path="$3" uid="$4" c args; shift 4
    podman_id "$ref" >/dev/null && return 0
    c="$(buildah from scratch)"
    buildah copy --chmod 0755 "$c" "$bin" "$path" >/dev/null
    args="$(printf '"%s",' "$path" "$@")"
    buildah config --entrypoint "[${args%,}]" --user "$uid:$uid" "$c" >/dev/null
    buildah commit --quiet "$c" "$ref" >/dev/null
    buildah rm "$c" >/dev/null
    log "built image $ref"
}

prune_replaced() {  # the kubelet's sha256:<id> records of builds a newer import replaced, whose content they kept
    # (gigabytes a rebuild in every node): removed, so containerd frees what no container still uses
    local live name digest
    live="$(ctr_ images ls 2>/dev/null | awk 'NR > 1 && $1 !~ /^sha256:/ {print $3}' | sort -u)"
    ctr_ images ls 2>/dev/null | awk 'NR > 1 && $1 ~ /^sha256:/ {print $1, $3}' | while read -r name digest; do
        grep -qxF "$digest" <<<"$live" && continue
        ctr_ images rm "$name" >/dev/null && log "removed ${name:0:19} from $NODE_NAME: a build replaced since"
    done
}

load() {  # the project's images (make images): every localhost/kappa/* image except the node's own, into each node
    local ref n=0 refs i
    refs="$(podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/kappa/' | sort -u)"
    for i in $(node_indexes); do
        use_node "$i"
        alive containerd || continue
        while read -r ref; do
            case "$ref" in localhost/kappa/pause:*|localhost/kappa/coredns:*|localhost/kappa/prometheus*|*"<none>"*|"") continue ;; esac
            import_image "$ref"; n=$((n + 1))
        done <<<"$refs"
        prune_replaced
    done
    use_node 0
    (( n > 0 )) || log "no project images in podman's storage yet (make images builds them)"
}

node_indexes() {  # the nodes of this state folder: 0 and each kappa-node-<i> folder (up made them), in order
    local d
    echo 0
    for d in "$HOME_DIR"/nodes/kappa-node-*; do [[ -d "$d" ]] && echo "${d##*-}"; done | sort -n
    return 0
}

monitoring() {  # the part of kube-prometheus-stack the chart needs, built here: the operator and a Prometheus
    # (namespace monitoring) that scrapes what every PodMonitor selects and evaluates every PrometheusRule, in all
    # namespaces (infra/cluster/prometheus-stack-values.yaml's selectors). No Alertmanager: alerts are read from
    # Prometheus' API. Idempotent; `helm upgrade` a release installed before it to get its PodMonitor and rules.
    local pbin obin crds minor release t0=$SECONDS
    pbin="$(bash "$ROOT/infra/prometheus/build.sh" prometheus)" || die "building Prometheus failed (above)"
    obin="$(bash "$ROOT/infra/prometheus/build.sh" operator)" || die "building the Prometheus operator failed (above)"
    minor="${PROMETHEUS_VERSION#v0.}"; minor="${minor%%.*}"
    release="v${minor:0:1}.${minor:1}.${PROMETHEUS_VERSION##*.}"   # the module's v0.315.0 is Prometheus v3.15.0
    local prom="localhost/kappa/prometheus:$release"
    local operator="localhost/kappa/prometheus-operator:$PROMETHEUS_OPERATOR_VERSION"
    local reloader="localhost/kappa/prometheus-config-reloader:$PROMETHEUS_OPERATOR_VERSION"
    # the operator runs its reloader as /bin/prometheus-config-reloader and gives Prometheus arguments only
    binary_image "$prom" "$pbin/prometheus" /bin/prometheus 65534
    binary_image "$operator" "$obin/operator" /bin/operator 65534
    binary_image "$reloader" "$obin/prometheus-config-reloader" /bin/prometheus-config-reloader 65534
    local i
    for i in $(node_indexes); do
        use_node "$i"
        alive containerd || continue
        import_image "$prom"; import_image "$operator"; import_image "$reloader"
    done
    use_node 0
    # the operator starts the controllers whose CRDs it finds when it starts: the five Prometheus' needs first
    crds="$(GOFLAGS=-mod=mod go mod download -json \
        "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')/example/prometheus-operator-crd"
    local kind files=()
    for kind in prometheuses podmonitors servicemonitors probes prometheusrules; do
        files+=(-f "$crds/monitoring.coreos.com_$kind.yaml")
    done
    # server-side: the prometheuses CRD is larger than client-side apply's annotation
    $KUBECTL apply --server-side --force-conflicts "${files[@]}" >/dev/null || die "applying the operator's CRDs failed"
    $KUBECTL wait --for condition=established --timeout=60s "${files[@]}" >/dev/null
    $KUBECTL apply -f "$ROOT/infra/cluster/monitoring-namespace.yaml" >/dev/null
    $KUBECTL apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus-operator, namespace: monitoring}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kappa:prometheus-operator"}
rules:  # example/rbac/prometheus-operator of the operator's module, for the Prometheus controller alone
  - apiGroups: [monitoring.coreos.com]
    resources: [prometheuses, prometheuses/finalizers, prometheuses/status, servicemonitors, servicemonitors/status,
                podmonitors, probes, prometheusrules, scrapeconfigs]
    verbs: ["*"]
  - apiGroups: [apps]
    resources: [statefulsets]
    verbs: ["*"]
  - apiGroups: [""]
    resources: [configmaps, secrets]
    verbs: ["*"]
  - apiGroups: [""]
    resources: [pods]
    verbs: [list, delete]
  - apiGroups: [""]
    resources: [services, services/finalizers]
    verbs: [get, create, update, delete]
  - apiGroups: [""]
    resources: [namespaces]
    verbs: [get, list, watch]
  - apiGroups: ["", events.k8s.io]
    resources: [events]
    verbs: [patch, create]
  - apiGroups: [storage.k8s.io]
    resources: [storageclasses]
    verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kappa:prometheus-operator"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kappa:prometheus-operator"}
subjects: [{kind: ServiceAccount, name: prometheus-operator, namespace: monitoring}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: prometheus-operator, namespace: monitoring, labels: {app.kubernetes.io/name: prometheus-operator}}
spec:
  replicas: 1
  selector: {matchLabels: {app.kubernetes.io/name: prometheus-operator}}
  template:
    metadata: {labels: {app.kubernetes.io/name: prometheus-operator}}
    spec:
      serviceAccountName: prometheus-operator
      securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: operator
          image: $operator
          imagePullPolicy: Never
          args: ["--prometheus-config-reloader=$reloader", "--log-level=info"]
          env: [{name: GOGC, value: "30"}]
          ports: [{name: http, containerPort: 8080}]
          readinessProbe: {httpGet: {path: /healthz, port: http}, periodSeconds: 5}
          resources:
            requests: {cpu: 20m, memory: 64Mi}
            limits: {memory: 200Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus, namespace: monitoring}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kappa:prometheus"}
rules:  # example/rbac/prometheus: what Kubernetes service discovery reads
  - apiGroups: [""]
    resources: [nodes, nodes/metrics, services, endpoints, pods]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
  - apiGroups: [""]
    resources: [configmaps]
    verbs: [get]
  - nonResourceURLs: [/metrics]
    verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kappa:prometheus"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kappa:prometheus"}
subjects: [{kind: ServiceAccount, name: prometheus, namespace: monitoring}]
---
apiVersion: monitoring.coreos.com/v1
kind: Prometheus
metadata: {name: prometheus, namespace: monitoring}
spec:
  image: $prom
  version: $release
  imagePullPolicy: Never
  replicas: 1
  serviceAccountName: prometheus
  # every namespace's PodMonitors and PrometheusRules, as infra/cluster/prometheus-stack-values.yaml asks of
  # kube-prometheus-stack; its default intervals
  podMonitorSelector: {}
  podMonitorNamespaceSelector: {}
  serviceMonitorSelector: {}
  serviceMonitorNamespaceSelector: {}
  ruleSelector: {}
  ruleNamespaceSelector: {}
  scrapeInterval: 30s
  evaluationInterval: 30s
  retention: 1d
  securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, fsGroup: 65534,
                    seccompProfile: {type: RuntimeDefault}}
  resources:
    requests: {cpu: 50m, memory: 200Mi}
    limits: {memory: 600Mi}
EOF
    $KUBECTL -n monitoring rollout status deploy/prometheus-operator --timeout=180s >/dev/null \
        || die "the Prometheus operator is not ready ($KUBECTL -n monitoring logs deploy/prometheus-operator)"
    wait_for "the operator's StatefulSet prometheus-prometheus" 120 \
        $KUBECTL -n monitoring get statefulset prometheus-prometheus -o name
    $KUBECTL -n monitoring rollout status statefulset/prometheus-prometheus --timeout=300s >/dev/null \
        || die "Prometheus is not ready ($KUBECTL -n monitoring describe pod prometheus-prometheus-0)"
    log "monitoring: the Prometheus operator $PROMETHEUS_OPERATOR_VERSION and Prometheus $release ready in" \
        "namespace monitoring ($((SECONDS - t0)) s): http://$($KUBECTL -n monitoring get pod prometheus-prometheus-0 \
        -o jsonpath='{.status.podIP}'):9090"
}

provisioner() {  # dynamic volumes: Rancher's local-path-provisioner and its StorageClass local-path (not the default)
    # A claim of class local-path gets a folder of the node its first pod is scheduled on (WaitForFirstConsumer):
    # <node's folder>/dynamic-volumes/<pv>_<namespace>_<claim>, made by a helper pod (the Debian base image of `make
    # images`) and removed with the claim (reclaimPolicy Delete). Its volumes are hostPath ones: a pod whose volume is
    # on a lost node cannot start elsewhere, as with the local PVs. Idempotent.
    local t0=$SECONDS bin ref helper i paths="" sep=""
    bin="$NODE_BIN/local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION"
    [[ -x "$bin" ]] || die "no $bin (infra/k8s/build.sh node builds it)"
    ref="localhost/kappa/local-path-provisioner:$LOCAL_PATH_PROVISIONER_VERSION"
    helper="localhost/kappa-base/debian:$DEBIAN_RELEASE"
    podman_id "$helper" >/dev/null || die "no image $helper in podman's storage (make images builds it)"
    binary_image "$ref" "$bin" /bin/local-path-provisioner 65534
    for i in $(node_indexes); do
        use_node "$i"
        alive containerd || continue
        import_image "$ref"; import_image "$helper"
        mkdir -p "$NODE_DIR/dynamic-volumes"
        paths+="$sep{\"node\": \"$NODE_NAME\", \"paths\": [\"$NODE_DIR/dynamic-volumes\"]}"; sep=", "
    done
    use_node 0
    $KUBECTL apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: local-path-storage}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: local-path-provisioner, namespace: local-path-storage}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: local-path-provisioner, namespace: local-path-storage}
rules:  # deploy/local-path-storage.yaml of the provisioner's module: its helper pods
  - apiGroups: [""]
    resources: [pods]
    verbs: [get, list, watch, create, patch, update, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: local-path-provisioner, namespace: local-path-storage}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: local-path-provisioner}
subjects: [{kind: ServiceAccount, name: local-path-provisioner, namespace: local-path-storage}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kappa:local-path-provisioner"}
rules:
  - apiGroups: [""]
    resources: [nodes, persistentvolumeclaims, configmaps, pods, pods/log]
    verbs: [get, list, watch]
  - apiGroups: [""]
    resources: [persistentvolumes]
    verbs: [get, list, watch, create, patch, update, delete]
  - apiGroups: [""]
    resources: [events]
    verbs: [create, patch]
  - apiGroups: [storage.k8s.io]
    resources: [storageclasses]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kappa:local-path-provisioner"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kappa:local-path-provisioner"}
subjects: [{kind: ServiceAccount, name: local-path-provisioner, namespace: local-path-storage}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: local-path-config, namespace: local-path-storage}
data:
  config.json: '{"nodePathMap": [$paths]}'
  setup: |-
    #!/bin/sh
    set -eu
    mkdir -m 0777 -p "\$VOL_DIR"
  teardown: |-
    #!/bin/sh
    set -eu
    rm -rf "\$VOL_DIR"
  helperPod.yaml: |-
    apiVersion: v1
    kind: Pod
    metadata: {name: helper-pod}
    spec:
      priorityClassName: system-node-critical
      tolerations: [{key: node.kubernetes.io/disk-pressure, operator: Exists, effect: NoSchedule}]
      containers:
        - name: helper-pod
          image: $helper
          imagePullPolicy: Never
          resources: {requests: {cpu: 10m, memory: 16Mi}, limits: {memory: 64Mi}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: local-path-provisioner, namespace: local-path-storage, labels: {app: local-path-provisioner}}
spec:
  replicas: 1
  selector: {matchLabels: {app: local-path-provisioner}}
  template:
    metadata: {labels: {app: local-path-provisioner}}
    spec:
      serviceAccountName: local-path-provisioner
      securityContext: {runAsNonRoot: true, runAsUser: 65534, runAsGroup: 65534, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: provisioner
          image: $ref
          imagePullPolicy: Never
          args: [start, --config, /etc/config/config.json, --service-account-name, local-path-provisioner,
                 --helper-image, $helper]
          env:
            - {name: POD_NAMESPACE, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
            - {name: CONFIG_MOUNT_PATH, value: /etc/config/}
          volumeMounts: [{name: config, mountPath: /etc/config/}]
          resources:
            requests: {cpu: 10m, memory: 32Mi}
            limits: {memory: 128Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
      volumes: [{name: config, configMap: {name: local-path-config}}]
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local-path}
provisioner: rancher.io/local-path
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
EOF
    $KUBECTL -n local-path-storage rollout status deploy/local-path-provisioner --timeout=180s >/dev/null \
        || die "the provisioner is not ready ($KUBECTL -n local-path-storage logs deploy/local-path-provisioner)"
    log "provisioner: local-path-provisioner $LOCAL_PATH_PROVISIONER_VERSION ready ($((SECONDS - t0)) s):" \
        "StorageClass local-path, a folder of dynamic-volumes/ on the claim's node"
}

ready_since() {  # ready_since <RFC 3339 time>: the node's Ready condition is True and was reported after it
    $KUBECTL get node "$NODE_NAME" -o jsonpath='{range .status.conditions[?(@.type=="Ready")]}{.status} {.lastHeartbeatTime}{end}' \
        | { read -r status beat; [[ "$status" == True && ! "$beat" < "$1" ]]; }
}

persistent_volumes() {  # local PVs on the current node (there is no provisioner); fsGroup applies to local volumes
    local i name
    for ((i = 0; i < PVS; i++)); do
        mkdir -p "$NODE_DIR/volumes/pv-$i"
        name="kappa-local-pv-$i"; (( NODE_INDEX == 0 )) || name="kappa-local-pv-$NODE_INDEX-$i"
        cat <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: $name, labels: {kappa.io/node-volume: "true"}}
spec:
  capacity: {storage: 100Gi}
  accessModes: [ReadWriteOnce, ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  volumeMode: Filesystem
  local: {path: "$NODE_DIR/volumes/pv-$i"}
  nodeAffinity:
    required:
      nodeSelectorTerms:
        - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [$NODE_NAME]}]
---
EOF
    done | $KUBECTL apply -f - >/dev/null
}

recycle() {  # empty the local PVs a deleted claim left Released (Retain, no provisioner) and offer them again
    local pv path n=0 i
    # a claim deleted a moment ago: its volume turns Released once the PV controller has seen it (a second or two)
    for ((i = 0; i < 60; i++)); do
        bound_to_gone || break
        sleep 1
    done
    for pv in $($KUBECTL get pv -l kappa.io/node-volume=true -o jsonpath='{range .items[?(@.status.phase=="Released")]}{.metadata.name}{"\n"}{end}'); do
        path="$($KUBECTL get pv "$pv" -o jsonpath='{.spec.local.path}')"
        [[ "$path" =~ ^$HOME_DIR/(nodes/kappa-node-[0-9]/)?volumes/pv-[0-9]+$ ]] \
            || die "PV $pv is not one of this cluster's node volumes ($path)"
        rm -rf "$path" && mkdir -p "$path"
        $KUBECTL patch pv "$pv" --type json -p '[{"op": "remove", "path": "/spec/claimRef"}]' >/dev/null
        n=$((n + 1))
    done
    log "recycled $n released volume(s)"
}

bound_to_gone() {  # a local PV still Bound to a claim that no longer exists
    local claims ref
    claims="$($KUBECTL get pvc -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{"\n"}{end}')"
    for ref in $($KUBECTL get pv -l kappa.io/node-volume=true -o jsonpath='{range .items[?(@.status.phase=="Bound")]}{.spec.claimRef.namespace}/{.spec.claimRef.name}{"\n"}{end}'); do
        grep -qxF "$ref" <<<"$claims" || return 0
    done
    return 1
}

netpol() {  # NetworkPolicy enforcement: kube-router's firewall controller alone, reading the API with its own identity
    [[ "$NETPOL" == none ]] && { netpol_cleanup; return 0; }
    [[ "$NETPOL" == kube-router ]] || die "KAPPA_CLUSTER_NETPOL=$NETPOL: use kube-router or none"
    $KUBECTL apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kappa:kube-router"}
rules:
  - apiGroups: [""]
    resources: [pods, namespaces, nodes, services, endpoints]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kappa:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kappa:kube-router"}
subjects: [{kind: User, name: "kappa:kube-router", apiGroup: rbac.authorization.k8s.io}]
EOF
    # the pod's node is found by name (NODE_NAME, else the host name): give it the node's
    NODE_NAME="$NODE_NAME" start kube-router "${NS[@]}" "$NODE_BIN/kube-router-$KUBE_ROUTER_VERSION" \
        --kubeconfig="$CONF/kube-router.kubeconfig" --hostname-override="$NODE_NAME" \
        --run-firewall=true --run-router=false --run-service-proxy=false --run-loadbalancer=false \
        --service-cluster-ip-range=10.96.0.0/16 --service-node-port-range=30000-32767 \
        --health-port=20244 --metrics-port=0 --v=1
    wait_for "kube-router (log: $LOGS/kube-router.log)" 120 "${NS[@]}" curl -fsS http://127.0.0.1:20244/healthz
}

netpol_cleanup() {  # what kube-router put in the filter table and ipset (a stopped kube-router leaves it enforcing)
    local c rule ch chains s
    for c in INPUT FORWARD OUTPUT; do
        iptables -w 5 -t filter -S "$c" | { grep -E -- "-j KUBE-ROUTER-(INPUT|FORWARD|OUTPUT)( |\$)" || true; } | while read -r rule; do
            eval "iptables -w 5 -t filter -D ${rule#-A }"
        done
    done
    chains=$(iptables -w 5 -t filter -S | awk '$1=="-N" && $2 ~ /^(KUBE-ROUTER-(INPUT|FORWARD|OUTPUT)|KUBE-POD-FW-|KUBE-NWPLCY-)/ {print $2}')
    for ch in $chains; do iptables -w 5 -t filter -F "$ch"; done
    for ch in $chains; do iptables -w 5 -t filter -X "$ch"; done
    if command -v ipset >/dev/null; then
        for s in $(ipset list -n | grep -E '^(KUBE-SRC-|KUBE-DST-|TMP-|inet6:KUBE-SRC-|inet6:KUBE-DST-|kube-router-)' || true); do ipset destroy "$s" 2>/dev/null || true; done
    fi
    return 0
}

coredns() {
    $KUBECTL apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kappa:coredns"}
rules:
  - apiGroups: [""]
    resources: [endpoints, services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kappa:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kappa:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:1053 {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        forward . /etc/resolv.conf
        cache 30
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      securityContext: {runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: coredns
          image: $COREDNS_IMAGE
          imagePullPolicy: Never
          args: ["-conf", "/etc/coredns/Corefile"]
          ports:
            - {name: dns, containerPort: 1053, protocol: UDP}
            - {name: dns-tcp, containerPort: 1053, protocol: TCP}
          readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2}
          livenessProbe: {httpGet: {path: /health, port: 8080}, periodSeconds: 10}
          resources:
            requests: {cpu: 50m, memory: 64Mi}
            limits: {memory: 128Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {drop: [ALL]}
          volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes: [{name: config, configMap: {name: coredns}}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $CLUSTER_DNS
  selector: {k8s-app: kube-dns}
  ports:
    - {name: dns, port: 53, targetPort: 1053, protocol: UDP}
    - {name: dns-tcp, port: 53, targetPort: 1053, protocol: TCP}
EOF
}

up() {
    local t0=$SECONDS cp_bin i
    prerequisites
    # one node masquerades its pods itself, several leave their addresses alone: no switching under running pods
    if alive kubelet && [[ -f "$CONF/cni/10-kappa.conflist" ]]; then
        local running=one; grep -q '"ipMasq": false' "$CONF/cni/10-kappa.conflist" && running=several
        [[ "$running" == "$( (( NODES == 1 )) && echo one || echo several)" ]] \
            || die "the cluster runs with $running node(s), not $NODES: make cluster-down first (its state is kept)"
    fi
    HOST_IP="$(node_ip)"; [[ -n "$HOST_IP" ]] || die "no IPv4 address on the default route; set KAPPA_NODE_IP"
    cp_bin="$(bash "$ROOT/infra/k8s/build.sh")"
    NODE_BIN="$(bash "$ROOT/infra/k8s/build.sh" node)"
    KUBECTL="$cp_bin/kubectl --kubeconfig $KUBECONFIG_FILE"
    local pause; pause="$(cd "$NODE_BIN" && ls pause-* | head -1)"
    PAUSE_IMAGE="localhost/kappa/pause:${pause#pause-}"
    COREDNS_IMAGE="localhost/kappa/coredns:${COREDNS_VERSION}"
    mkdir -p "$RUN" "$LOGS"
    # 1. the control plane, advertising the host's address (no fake nodes, local PVs instead of hostPath ones)
    KAPPA_K8S_HOME="$HOME_DIR" KAPPA_K8S_PORT="$PORT" KAPPA_K8S_ETCD_PORT="$ETCD_PORT" KAPPA_K8S_NODES=0 \
        KAPPA_K8S_PVS=0 KAPPA_K8S_NODE_IP="$HOST_IP" bash "$ROOT/infra/k8s/cluster.sh" up >/dev/null
    local t_cp=$SECONDS
    scratch_image "$PAUSE_IMAGE" "$NODE_BIN/$pause" 65535
    scratch_image "$COREDNS_IMAGE" "$NODE_BIN/coredns" 10001
    (( NODES == 1 )) || nodes_network
    # 2. each node: its runtime, kubelet, kube-proxy, NetworkPolicies and volumes
    local ready=()
    for ((i = 0; i < NODES; i++)); do
        use_node "$i"
        node_up
        ready+=("$NODE_NAME $((SECONDS - t0)) s")
    done
    use_node 0
    # the nodes of an earlier cluster with more nodes than this one are not part of it: gone, their pods go elsewhere
    local extra
    extra="$($KUBECTL get nodes -o name | awk -F/ -v n="$NODES" '$2 ~ /^kappa-node-[0-9]$/ && substr($2, 12) + 0 >= n {print $2}')"
    if [[ -n "$extra" ]]; then
        # shellcheck disable=SC2086
        $KUBECTL delete node $extra >/dev/null && log "removed the node(s) of a larger cluster: $(echo $extra)"
    fi
    coredns
    load
    $KUBECTL -n kube-system rollout status deploy/coredns --timeout=180s >/dev/null \
        || die "CoreDNS is not ready ($KUBECTL -n kube-system describe pod -l k8s-app=kube-dns)"
    local nodes="node kappa-node Ready at $HOST_IP"
    (( NODES == 1 )) || nodes="$NODES nodes Ready at $HOST_IP and $NODES_NET.11-$((10 + NODES - 1))"
    log "$nodes: control plane $((t_cp - t0)) s, $(IFS=,; echo "${ready[*]}" | sed 's/,/, /g') Ready, DNS $((SECONDS - t0)) s;" \
        "API https://$HOST_IP:$PORT, $PVS local PVs a node, NetworkPolicies: $NETPOL"
    echo "export KUBECONFIG=$KUBECONFIG_FILE"
}

node_up() {  # the current node (use_node): network namespace, containerd, kubelet, kube-proxy, kube-router, PVs
    local ip; ip="$(node_ip)"
    mkdir -p "$RUN" "$LOGS" "$CONF"
    (( NODE_INDEX == 0 )) || node_namespace "$ip"
    node_certs
    configs
    # containerd finds its shim (containerd-shim-runc-v2) on PATH
    PATH="$NODE_BIN:$PATH" start containerd "${NS[@]}" "$NODE_BIN/containerd" --config "$CONF/containerd.toml"
    wait_for "$NODE_NAME's containerd" 60 ctr_ version
    import_image "$PAUSE_IMAGE"
    import_image "$COREDNS_IMAGE"
    # Ready as reported by THIS kubelet when it starts now (a Node object kept from the last run still says Ready for
    # ~40 s); a kubelet already running only re-reports every few minutes
    local since="" ; alive kubelet || since="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    start kubelet "${NS[@]}" "$NODE_BIN/kubelet" --config "$CONF/kubelet.yaml" \
        --kubeconfig "$CONF/kubelet.kubeconfig" --root-dir "$NODE_DIR/kubelet" \
        --hostname-override "$NODE_NAME" --node-ip "$ip" --v 1
    start kube-proxy "${NS[@]}" "$NODE_BIN/kube-proxy" --config "$CONF/kube-proxy.yaml"
    wait_for "node $NODE_NAME (kubelet log: $LOGS/kubelet.log)" 120 ready_since "$since"
    netpol
    persistent_volumes
}

nodes_network() {  # the host's side of the nodes' network: the bridge, one masquerade for what leaves the pods' network
    # ip netns add binds /run/netns onto itself the first time: done now, before node 0's pods put their namespaces
    # there (a bind made after them would hide them, and nothing could enter or remove them)
    if ! mountpoint -q /run/netns; then
        mkdir -p /run/netns && mount --bind /run/netns /run/netns
    fi
    mount --make-shared /run/netns
    if ! ip link show "$NODES_BRIDGE" >/dev/null 2>&1; then
        ip link add "$NODES_BRIDGE" type bridge
        ip addr add "$NODES_NET.1/24" dev "$NODES_BRIDGE"
    fi
    ip link set "$NODES_BRIDGE" up
    iptables -w 5 -t nat -C "${EGRESS_RULE[@]}" 2>/dev/null || iptables -w 5 -t nat -A "${EGRESS_RULE[@]}"
}

node_namespace() {  # node_namespace <address>: the current node's network namespace on the host's bridge, its pod
    # network routed to it, and its cgroup root
    local ip="$1" veth="kn$NODE_INDEX" d
    [[ -e "/run/netns/$NETNS" ]] || ip netns add "$NETNS"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip -n "$NETNS" link delete eth0 2>/dev/null || true
        ip link add "$veth" type veth peer name eth0 netns "$NETNS"
        ip -n "$NETNS" addr add "$ip/24" dev eth0
    fi
    ip link set "$veth" master "$NODES_BRIDGE" up
    ip -n "$NETNS" link set lo up
    ip -n "$NETNS" link set eth0 up
    ip -n "$NETNS" route replace default via "$NODES_NET.1"
    ip route replace "$POD_CIDR" via "$ip" dev "$NODES_BRIDGE"
    # a new namespace forwards nothing and its bridges skip iptables (kube-proxy's Service rules)
    "${NS[@]}" sysctl -qw net.ipv4.ip_forward=1
    [[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ]] && "${NS[@]}" sysctl -qw net.bridge.bridge-nf-call-iptables=1
    # the kubelet wants its cgroupRoot in every hierarchy; cgroups v1's cpuset starts empty: the parent's
    for d in /sys/fs/cgroup/*/; do
        [[ -f "$d/cgroup.procs" ]] || continue
        mkdir -p "$d${CGROUP_ROOT#/}"
        if [[ -f "$d/cpuset.cpus" && ! -s "$d${CGROUP_ROOT#/}/cpuset.cpus" ]]; then
            cat "$d/cpuset.cpus" > "$d${CGROUP_ROOT#/}/cpuset.cpus"
            cat "$d/cpuset.mems" > "$d${CGROUP_ROOT#/}/cpuset.mems"
        fi
    done
    return 0
}

down() {
    local bin i; bin="$(KAPPA_K8S_NO_BUILD=1 bash "$ROOT/infra/k8s/build.sh" node 2>/dev/null)" || bin=""
    for i in $(node_indexes | sort -rn); do
        use_node "$i"
        node_down "$bin"
    done
    use_node 0
    # pods' namespaces hidden under a bind of /run/netns made after them (nothing can enter or remove them): seen
    # again once that bind is gone - umount refuses while any namespace is mounted through it
    if [[ -n "$(stale_netns)" ]] && mountpoint -q /run/netns && umount /run/netns 2>/dev/null; then
        network_cleanup
    fi
    nodes_network_cleanup
    KAPPA_K8S_HOME="$HOME_DIR" bash "$ROOT/infra/k8s/cluster.sh" down
}

node_down() {  # node_down <node binaries or "">: the current node stopped and what it set up on the machine undone
    local bin="$1"
    stop kube-router
    (( NODE_INDEX > 0 )) || netpol_cleanup
    stop kube-proxy
    stop kubelet
    if [[ -n "$bin" ]] && alive containerd; then
        NODE_BIN="$bin"
        # pods' containers outlive containerd (their shims): stop them while it still knows them
        local task
        for task in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$task" >/dev/null 2>&1 || true; done
        sleep 1
    fi
    stop containerd
    node_remains
    if (( NODE_INDEX == 0 )); then
        network_cleanup
        if [[ -n "$bin" && -x "$bin/kube-proxy" ]]; then "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true; fi
        chains_cleanup
        netpol_cleanup
    else
        # the node's iptables, ipsets, bridge and veths are its namespace's: they go with it
        network_cleanup
        ip netns delete "$NETNS" 2>/dev/null || true
        ip route delete "$POD_CIDR" 2>/dev/null || true
        cgroup_root_cleanup
    fi
}

node_remains() {  # what outlives the current node's processes: shims, processes in its pods' cgroups, its mounts
    # the shims of containerd 2.x take -id before -address: a shim whose task outlived the kill goes too
    pkill -KILL -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $CTR_SOCK( |\$)" 2>/dev/null || true
    pod_processes_cleanup
    # volumes and sandboxes the kubelet / containerd mounted (tokens, overlays, netns), innermost first; node 0's
    # folder holds the others': theirs are gone by then
    local m
    for m in $(awk -v h="$NODE_DIR/" -v s="$CTR_STATE/" 'index($2, h) == 1 || index($2, s) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
}

lose() {  # lose <i>: node i lost as a machine is - unplugged, then everything on it killed at once (no graceful stop)
    local i="$1"
    [[ "$i" =~ ^[1-9]$ && -d "$HOME_DIR/nodes/kappa-node-$i" ]] \
        || die "lose $i: give a node of this cluster other than 0 ($(node_indexes | awk '$1 > 0' | tr '\n' ' ')| node 0 is the host's own)"
    use_node "$i"
    ip link set "kn$i" down 2>/dev/null || true
    local name pids=()
    for name in kube-router kube-proxy kubelet containerd; do
        alive "$name" && pids+=("$(cat "$RUN/$name.pid")")
    done
    (( ${#pids[@]} == 0 )) || kill -KILL "${pids[@]}" 2>/dev/null || true
    pkill -KILL -f "containerd-shim-runc-v2 -namespace k8s.io .*-address $CTR_SOCK( |\$)" 2>/dev/null || true
    pod_processes_cleanup
    rm -f "$RUN"/*.pid
    log "lost $NODE_NAME at $(date -u +%H:%M:%S) (unplugged; its kubelet, containerd, kube-proxy, kube-router and containers killed); make cluster-up NODES=$(node_indexes | wc -l) brings it back"
}

nodes_network_cleanup() {  # the host's side of the nodes' network
    while iptables -w 5 -t nat -D "${EGRESS_RULE[@]}" 2>/dev/null; do :; done
    local l
    for l in $(ip -o link show type veth 2>/dev/null | awk -F': ' '$2 ~ /^kn[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do
        ip link delete "$l" 2>/dev/null || true
    done
    if ip link show "$NODES_BRIDGE" >/dev/null 2>&1; then ip link delete "$NODES_BRIDGE" && log "removed the bridge $NODES_BRIDGE"; fi
    return 0
}

cgroup_root_cleanup() {  # the current node's cgroup root (/kappa-node-<i>) in every hierarchy, emptied by then
    local d
    for d in /sys/fs/cgroup/*/"${CGROUP_ROOT#/}"; do
        [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    return 0
}

kubepods_cgroups() {  # the pods' cgroup folders (cgroupfs: <controller>[<cgroupRoot>]/kubepods/...), deepest first:
    # the current node's, or with "all" every node's
    local d
    if [[ "${1:-}" == all ]]; then
        find /sys/fs/cgroup -maxdepth 3 -type d -name kubepods 2>/dev/null
    elif [[ -z "$CGROUP_ROOT" ]]; then
        find /sys/fs/cgroup -maxdepth 2 -type d -name kubepods 2>/dev/null
    else
        find /sys/fs/cgroup -mindepth 3 -maxdepth 3 -type d -path "*$CGROUP_ROOT/kubepods" 2>/dev/null
    fi | while read -r d; do
        find "$d" -depth -type d
    done
}

pod_processes_cleanup() {  # anything still in a pod's cgroup (containerd and its shims are gone): killed; the cgroups removed
    local d pid n=0
    # a process is in one cgroup of each v1 hierarchy: each pid once
    for pid in $(for d in $(kubepods_cgroups); do [[ -f "$d/cgroup.procs" ]] && cat "$d/cgroup.procs"; done | sort -u); do
        kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
    done
    (( n == 0 )) || { log "killed $n process(es) left in the pods' cgroups"; sleep 1; }
    for d in $(kubepods_cgroups); do rmdir "$d" 2>/dev/null || true; done
}

pod_netns() {  # the pods' network namespaces (containerd's cni-*) holding an address of the pods' network
    local ns prefix="${POD_CIDR%.*}."
    for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^cni-/ {print $1}'); do
        if ip netns exec "$ns" ip -4 -o addr show 2>/dev/null | grep -qF " inet $prefix"; then echo "$ns"; fi
    done
}

stale_netns() {  # cni-* names of /run/netns that cannot be entered: left by a containerd killed between unmounting
    # a pod's namespace and removing its file (the node's fault tests kill it), or hidden under a later bind mount of
    # /run/netns - nobody can use them
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^cni-/ {print $1}'); do
        ip netns exec "$ns" true >/dev/null 2>&1 || echo "$ns"
    done
}

network_cleanup() {  # the pods' network namespaces (their veths go with them), the bridge, the CNI address reservations
    local ns n=0
    for ns in $(pod_netns); do ip netns delete "$ns" 2>/dev/null && n=$((n + 1)); done
    (( n == 0 )) || log "removed $n pod network namespace(s)"
    n=0
    for ns in $(stale_netns); do
        { ip netns delete "$ns" 2>/dev/null || rm -f "/run/netns/$ns" 2>/dev/null; } && n=$((n + 1))
    done
    (( n == 0 )) || log "removed $n stale network namespace name(s) (nothing can enter them)"
    # node 0's bridge is the host's; another node's is in its namespace and goes with it
    if (( NODE_INDEX == 0 )) && ip link show kappa0 >/dev/null 2>&1; then ip link delete kappa0 && log "removed the bridge kappa0"; fi
    # every pod is gone: none of the plugin's reservations stands
    rm -rf "$NODE_DIR/cni-ipam"
}

node_chains() {  # node_chains <iptables|ip6tables> <table>: the chains of the node (KUBE-*, and the CNI plugins' chains for the pods' network)
    local rules
    rules="$("$1" -w 5 -t "$2" -S 2>/dev/null)" || return 0
    awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}' <<<"$rules"
    # the bridge plugin's masquerade chain per pod and the portmap plugin's per pod: their rules name the network
    awk '$1 == "-A" && $2 ~ /^CNI-/ && $2 !~ /^CNI-HOSTPORT-/ && /kappa-pods/ {print $2}' <<<"$rules" | sort -u
    return 0
}

chains_cleanup() {  # every chain of the node in every table (iptables and ip6tables) and the rules jumping to it
    local ipt table chains rule ch
    for ipt in iptables ip6tables; do
        command -v "$ipt" >/dev/null || continue
        for table in filter nat mangle raw; do
            chains="$(node_chains "$ipt" "$table" | sort -u)"
            [[ -n "$chains" ]] || continue
            # rules outside those chains that jump to one of them or name the pods' network
            "$ipt" -w 5 -t "$table" -S | awk '$1 == "-A"' | while read -r rule; do
                read -r _ ch _ <<<"$rule"
                grep -qxF "$ch" <<<"$chains" && continue
                if [[ "$rule" == *kappa-pods* ]] || grep -qxF "$(sed -n 's/.* -j \([^ ]*\).*/\1/p' <<<"$rule")" <<<"$chains"; then
                    eval "$ipt -w 5 -t $table -D ${rule#-A }" 2>/dev/null || true
                fi
            done
            for ch in $chains; do "$ipt" -w 5 -t "$table" -F "$ch" 2>/dev/null || true; done
            for ch in $chains; do "$ipt" -w 5 -t "$table" -X "$ch" 2>/dev/null || true; done
        done
    done
    return 0
}

leftovers() {  # what of a node is left on the machine, one line each; 1 when anything is
    local out=() line bin cp_bin ipt table ch pid exe
    bin="$(KAPPA_K8S_NO_BUILD=1 bash "$ROOT/infra/k8s/build.sh" node 2>/dev/null)" || bin=""
    cp_bin="$(KAPPA_K8S_NO_BUILD=1 bash "$ROOT/infra/k8s/build.sh" 2>/dev/null)" || cp_bin=""
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || continue
        if [[ ( -n "$bin" && "$exe" == "$bin/"* ) || ( -n "$cp_bin" && "$exe" == "$cp_bin/"* && "$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" == *"$HOME_DIR"* ) ]]; then
            out+=("process $pid: $exe")
        fi
    done
    local d
    for d in $(kubepods_cgroups all); do
        [[ -s "$d/cgroup.procs" ]] && out+=("processes in the pods' cgroup $d: $(tr '\n' ' ' < "$d/cgroup.procs")")
    done
    for d in /sys/fs/cgroup/*/kappa-node-[0-9]; do [[ -d "$d" ]] && out+=("cgroup $d"); done
    ip link show kappa0 >/dev/null 2>&1 && out+=("bridge kappa0")
    ip link show "$NODES_BRIDGE" >/dev/null 2>&1 && out+=("bridge $NODES_BRIDGE")
    for line in $(ip netns list 2>/dev/null | awk '$1 ~ /^kappa-node-[0-9]$/ {print $1}'); do out+=("network namespace $line (a node's)"); done
    for line in $(ip -o link show type veth 2>/dev/null | awk -F': ' '$2 ~ /^kn[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do out+=("veth $line (a node's)"); done
    while read -r line; do [[ -n "$line" ]] && out+=("route $line"); done < <(ip -4 route show 2>/dev/null | grep -E "^10\.244\.[0-9]+\.0/24 via $NODES_NET\." || true)
    iptables -w 5 -t nat -S POSTROUTING 2>/dev/null | grep -q kappa-pods-egress && out+=("iptables -t nat POSTROUTING rule kappa-pods-egress")
    # containerd names a pod's network namespace cni-<id> (podman's are netns-<id>); its veth lives as long as it does
    for line in $(ip netns list 2>/dev/null | awk '$1 ~ /^cni-/ {print $1}'); do out+=("network namespace $line"); done
    for line in $(ip -o link show type veth 2>/dev/null | grep -F " master kappa0 " | awk -F': ' '{print $2}' || true); do out+=("veth $line"); done
    while read -r line; do [[ -n "$line" ]] && out+=("mount $line"); done < <(awk -v h="$HOME_DIR/" -v s="$CTR_STATE" 'index($2, h) == 1 || index($2, s) == 1 {print $2}' /proc/mounts)
    for ipt in iptables ip6tables; do
        command -v "$ipt" >/dev/null || continue
        for table in filter nat mangle raw; do
            for ch in $(node_chains "$ipt" "$table"); do out+=("$ipt -t $table chain $ch"); done
        done
    done
    if command -v ipset >/dev/null; then
        for line in $(ipset list -n 2>/dev/null | grep -E '^(KUBE-|kube-router|inet6:KUBE-|TMP-)' || true); do out+=("ipset $line"); done
    fi
    (( ${#out[@]} == 0 )) && return 0
    printf '%s\n' "${out[@]}"
    return 1
}

reset() {  # down, then a fresh cluster next time: etcd, the volumes and the kubelet's pods go; binaries, PKI, images stay
    down
    local m
    for m in $(awk -v h="$HOME_DIR/" 'index($2, h) == 1 {print $2}' /proc/mounts | sort -r); do umount -l "$m" 2>/dev/null || true; done
    rm -rf "$HOME_DIR/etcd" "$HOME_DIR/volumes" "$HOME_DIR/kubelet" "$HOME_DIR/pod-logs" "$HOME_DIR/cni-ipam" \
        "$HOME_DIR/nodes"
    log "reset: the next up starts a fresh cluster (images kept)"
}

status() {
    KAPPA_K8S_HOME="$HOME_DIR" bash "$ROOT/infra/k8s/cluster.sh" status | grep -v kwok || true
    local name i
    for i in $(node_indexes); do
        use_node "$i"
        for name in containerd kubelet kube-proxy kube-router; do
            if alive "$name"; then echo "$NODE_NAME: $name running (pid $(cat "$RUN/$name.pid"))"; else echo "$NODE_NAME: $name stopped"; fi
        done
    done
}

nodes() {  # a line per node of this state folder: name, address, pod network, whether its kubelet runs
    local i state
    for i in $(node_indexes); do
        use_node "$i"
        state=stopped; alive kubelet && state=running
        printf '%s %s %s %s\n' "$NODE_NAME" "$( (( i == 0 )) && node_ip || echo "$NODES_NET.$((10 + i))")" "$POD_CIDR" "$state"
    done
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    check) check ;;
    reset) reset ;;
    leftovers) leftovers ;;
    nodes) nodes ;;
    lose) lose "${2:-}" ;;
    recycle)
        KUBECTL="$(bash "$ROOT/infra/k8s/build.sh")/kubectl --kubeconfig $KUBECONFIG_FILE"
        recycle ;;
    monitoring)
        alive kubelet || die "the node is not running (make cluster-up)"
        NODE_BIN="$(KAPPA_K8S_NO_BUILD=1 bash "$ROOT/infra/k8s/build.sh" node)"
        KUBECTL="$(bash "$ROOT/infra/k8s/build.sh")/kubectl --kubeconfig $KUBECONFIG_FILE"
        monitoring ;;
    provisioner)
        alive kubelet || die "the node is not running (make cluster-up)"
        NODE_BIN="$(bash "$ROOT/infra/k8s/build.sh" node)"
        KUBECTL="$(bash "$ROOT/infra/k8s/build.sh")/kubectl --kubeconfig $KUBECONFIG_FILE"
        provisioner ;;
    load)
        NODE_BIN="$(KAPPA_K8S_NO_BUILD=1 bash "$ROOT/infra/k8s/build.sh" node)"
        alive containerd || die "the node is not running (make cluster-up)"
        load ;;
    *) die "usage: infra/k8s/node.sh up|down|status|load|monitoring|provisioner|recycle|check|reset|leftovers|lose N|nodes" ;;
esac
