#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, for the chart's tests and for poking at: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and KWOK (fake nodes; pods are marked Running, no container runs).
# infra/k8s/node.sh starts the same control plane for a real node (KAPPA_K8S_NODE_IP set, no fake nodes).
#
# Usage: infra/k8s/cluster.sh up|down|status
#   up      build the binaries once (infra/k8s/build.sh, cached per version), create certificates, start the
#           five processes, create the fake nodes and PersistentVolumes, wait until the API is ready;
#           prints `export KUBECONFIG=...`. Idempotent.
#   down    stop the processes (the state folder stays; `up` starts from it again).
#   status  what runs.
#
# Environment: KAPPA_K8S_HOME (state folder, default <repo>/.kappa/k8s), KAPPA_K8S_PORT (API server port,
# default 16443), KAPPA_K8S_ETCD_PORT (default 23790; peer = +1), KAPPA_K8S_NODES (fake nodes, default 2),
# KAPPA_K8S_PVS (pre-created 10Gi PersistentVolumes, default 12: there is no provisioner), KAPPA_K8S_NODE_IP (set by
# infra/k8s/node.sh for a real node: the API server listens on every address and advertises this one, so pods reach
# it through the `kubernetes` Service, and reaches the kubelet for logs/exec with a client certificate; with
# KAPPA_K8S_NODES=0 no KWOK runs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
HOME_DIR="${KAPPA_K8S_HOME:-$ROOT/.kappa/k8s}"
PORT="${KAPPA_K8S_PORT:-16443}"
ETCD_PORT="${KAPPA_K8S_ETCD_PORT:-23790}"
NODES="${KAPPA_K8S_NODES:-2}"
PVS="${KAPPA_K8S_PVS:-12}"
NODE_IP="${KAPPA_K8S_NODE_IP:-}"
PKI="$HOME_DIR/pki"; RUN="$HOME_DIR/run"; LOGS="$HOME_DIR/logs"
KUBECONFIG_FILE="$HOME_DIR/admin.kubeconfig"
log() { echo "k8s: $*" >&2; }
die() { echo "k8s: error: $*" >&2; exit 1; }
# shellcheck source=infra/k8s/lib.sh
. "$ROOT/infra/k8s/lib.sh"

certs() {
    local san="IP:127.0.0.1,IP:10.96.0.1${NODE_IP:+,IP:$NODE_IP},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    if [[ -f "$PKI/admin.crt" ]]; then
        [[ "$(cat "$PKI/apiserver.san" 2>/dev/null)" == "$san" ]] && return 0
        # another node address (the same state folder on another VM): only the API server's certificate names it
        log "API server certificate for $san"
    else
        mkdir -p "$PKI"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 3650 \
            -subj "/CN=kappa-test-ca" 2>/dev/null
        printf 'extendedKeyUsage=clientAuth\n' > "$PKI/client.ext"
        sign admin "/O=system:masters/CN=kappa-admin" client.ext
        openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
        openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    fi
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san" > "$PKI/apiserver.ext"
    sign apiserver "/CN=kube-apiserver" apiserver.ext
    echo "$san" > "$PKI/apiserver.san"
}

kubeconfig() {
    cat > "$KUBECONFIG_FILE" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kappa-test
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$PKI/admin.crt", client-key: "$PKI/admin.key"}
contexts:
- name: kappa-test
  context: {cluster: kappa-test, user: admin}
current-context: kappa-test
EOF
}

api() {  # api <method> <path> [json body]: the API as the admin, via curl
    curl -sS --fail-with-body --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
        -X "$1" -H "Content-Type: application/json" ${3:+--data "$3"} "https://127.0.0.1:$PORT$2"
}

up() {
    local bin
    bin="$("$ROOT/infra/k8s/build.sh")"
    mkdir -p "$RUN" "$LOGS" "$HOME_DIR/etcd"
    certs; kubeconfig
    start etcd "$bin/etcd" --name kappa --data-dir "$HOME_DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" \
        --initial-cluster "kappa=http://127.0.0.1:$((ETCD_PORT + 1))" --listen-metrics-urls "" \
        --quota-backend-bytes 1073741824
    wait_for etcd 60 curl -sf "http://127.0.0.1:$ETCD_PORT/health"
    local network=(--bind-address 127.0.0.1 --advertise-address 127.0.0.1 --endpoint-reconciler-type none)
    if [[ -n "$NODE_IP" ]]; then
        # pods reach the API at the `kubernetes` Service (its endpoint: this address); the API server reaches the
        # kubelet (logs, exec, port-forward) as a system:masters client, at the node's InternalIP
        network=(--bind-address 0.0.0.0 --advertise-address "$NODE_IP"
                 --kubelet-client-certificate "$PKI/admin.crt" --kubelet-client-key "$PKI/admin.key"
                 --kubelet-preferred-address-types InternalIP)
    fi
    start kube-apiserver "$bin/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
        "${network[@]}" --secure-port "$PORT" --service-cluster-ip-range 10.96.0.0/16 \
        --client-ca-file "$PKI/ca.crt" --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --authorization-mode Node,RBAC --allow-privileged=false --profiling=false \
        --enable-admission-plugins NodeRestriction
    wait_for kube-apiserver 120 api GET /readyz
    start kube-controller-manager "$bin/kube-controller-manager" --kubeconfig "$KUBECONFIG_FILE" \
        --authentication-kubeconfig "$KUBECONFIG_FILE" --authorization-kubeconfig "$KUBECONFIG_FILE" \
        --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false --use-service-account-credentials \
        --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
        --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
        --controllers '*,-node-ipam-controller'
    start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$KUBECONFIG_FILE" \
        --authentication-kubeconfig "$KUBECONFIG_FILE" --authorization-kubeconfig "$KUBECONFIG_FILE" \
        --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false
    local started=(kube-controller-manager kube-scheduler)
    if (( NODES > 0 )); then
        start kwok "$bin/kwok" --kubeconfig "$KUBECONFIG_FILE" --config "$bin/kwok-stages.yaml" \
            --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
            --node-ip 127.0.0.1 --server-address "127.0.0.1:0"
        started+=(kwok)
    fi
    sleep 2
    local name
    for name in "${started[@]}"; do
        alive "$name" || die "$name exited at start: $(tail -3 "$LOGS/$name.log")"
    done
    local i kubectl="$bin/kubectl --kubeconfig $KUBECONFIG_FILE"
    for ((i = 0; i < NODES; i++)); do
        cat <<EOF
apiVersion: v1
kind: Node
metadata:
  name: kwok-node-$i
  annotations: {kwok.x-k8s.io/node: fake, node.alpha.kubernetes.io/ttl: "0"}
  labels: {kubernetes.io/hostname: kwok-node-$i, kubernetes.io/os: linux, kubernetes.io/arch: amd64, type: kwok}
status:
  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
---
EOF
    done | if (( NODES > 0 )); then $kubectl apply -f - >/dev/null; else cat >/dev/null; fi
    for ((i = 0; i < PVS; i++)); do
        cat <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: kwok-pv-$i}
spec:
  capacity: {storage: 100Gi}
  accessModes: [ReadWriteOnce, ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {path: /tmp/kwok-pv-$i}
---
EOF
    done | if (( PVS > 0 )); then $kubectl apply -f - >/dev/null; else cat >/dev/null; fi
    if (( NODES > 0 )); then
        $kubectl wait --for=condition=Ready node --all --timeout=60s >/dev/null \
            || die "the fake nodes did not become Ready (KWOK log: $LOGS/kwok.log)"
    fi
    log "API server https://${NODE_IP:-127.0.0.1}:$PORT ready ($(api GET /version | python3 -c 'import json,sys; print(json.load(sys.stdin)["gitVersion"])')), $NODES fake nodes, $PVS PVs"
    echo "export KUBECONFIG=$KUBECONFIG_FILE"
}

down() {
    local name
    for name in kwok kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$name"; done
}

status() {
    local name
    for name in etcd kube-apiserver kube-controller-manager kube-scheduler kwok; do
        if alive "$name"; then echo "$name running (pid $(cat "$RUN/$name.pid"))"; else echo "$name stopped"; fi
    done
    echo "export KUBECONFIG=$KUBECONFIG_FILE"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) die "usage: infra/k8s/cluster.sh up|down|status" ;;
esac
