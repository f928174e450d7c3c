#!/usr/bin/env bash
# Build (once) the pinned Kubernetes binaries, all from the Go module proxy. Prints the bin folder.
#
# Usage: infra/k8s/build.sh [control-plane|node]
#   control-plane (default)  etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and KWOK (+ its
#                            stage files): what the chart's tests run against (make test, make k8s-up).
#   node                     a real node for make cluster-up (infra/k8s/node.sh): kubelet and kube-proxy at
#                            K8S_VERSION, containerd CONTAINERD_VERSION (+ ctr, containerd-shim-runc-v2), CoreDNS
#                            COREDNS_VERSION, kube-router KUBE_ROUTER_VERSION (NetworkPolicy enforcement) and the
#                            pods' sandbox program (infra/k8s/pause), Rancher's local-path-provisioner
#                            LOCAL_PATH_PROVISIONER_VERSION (dynamic volumes: infra/k8s/node.sh provisioner). runc,
#                            ipset and the CNI plugins come from Debian (infra/k8s/node.sh installs them).
#
# Cache: ${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/k8s/<versions>/bin, so another clone on the same machine finds it
# again. A cold control-plane build takes ~10-20 minutes on 2 cores (kube-apiserver alone ~9); the node's binaries
# a few more minutes after it (the Go build cache is shared; CoreDNS ~6 min cold); a warm one returns at once.
#
# kube-apiserver & co cannot be `go install`ed (k8s.io/kubernetes has replace directives to its staging folder):
# they build in a throw-away module that requires k8s.io/kubernetes and replaces every staging module by its
# published v0.<minor>.<patch> twin; the version is stamped with -ldflags (else the server says v0.0.0 and the
# chart's kubeVersion check fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
TARGET="${1:-control-plane}"
TOOLS="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/k8s"
log() { echo "k8s-build: $*" >&2; }
case "$TARGET" in
    control-plane)
        BIN="$TOOLS/${K8S_VERSION}-etcd${ETCD_VERSION}-kwok${KWOK_VERSION}/bin"
        need=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwok-stages.yaml) ;;
    node)
        BIN="$TOOLS/node-${K8S_VERSION}-containerd${CONTAINERD_VERSION}-coredns${COREDNS_VERSION}/bin"
        PAUSE="pause-$(cat "$ROOT/infra/k8s/pause/go.mod" "$ROOT/infra/k8s/pause/main.go" | sha256sum | cut -c1-12)"
        need=(kubelet kube-proxy containerd containerd-shim-runc-v2 ctr coredns "kube-router-${KUBE_ROUTER_VERSION}" "$PAUSE"
              "local-path-provisioner-${LOCAL_PATH_PROVISIONER_VERSION}") ;;
    *) echo "k8s-build: error: usage: infra/k8s/build.sh [control-plane|node]" >&2; exit 1 ;;
esac
find_missing() { missing=(); for b in "${need[@]}"; do [[ -e "$BIN/$b" ]] || missing+=("$b"); done; }
find_missing
# KAPPA_K8S_NO_BUILD=1: only the folder, whatever it holds (stopping a node must never start a build)
if [[ ${#missing[@]} -eq 0 || "${KAPPA_K8S_NO_BUILD:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "k8s-build: error: go not found on PATH" >&2; exit 1; }
mkdir -p "$BIN"
# one build per folder at a time: every clone on the machine shares it (make test beside make test-smoke, two
# checkouts), and two builds would write the same files; the one that waited builds only what is still missing
exec 9>"$BIN/.build.lock"
if ! flock -n 9; then log "another build into $BIN is running: waiting for it"; flock 9; fi
find_missing
if [[ ${#missing[@]} -eq 0 ]]; then echo "$BIN"; exit 0; fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
export GOFLAGS="-mod=mod" CGO_ENABLED=0
started=$SECONDS
wanted() { [[ " ${missing[*]} " == *" $1 "* ]]; }

# --- Kubernetes components, in one throw-away module ---------------------------------------------------
k8s_main() {  # k8s_main <name>: the main package of one component (upstream's cmd/<name> main, one line each)
    local name="$1"; mkdir -p "$mod/$name"
    case "$name" in
        kube-apiserver|kube-controller-manager|kube-scheduler)
            local ctor=NewAPIServerCommand
            [[ "$name" == kube-controller-manager ]] && ctor=NewControllerManagerCommand
            [[ "$name" == kube-scheduler ]] && ctor=NewSchedulerCommand
            cat > "$mod/$name/main.go" <<GO
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/$name/app"
)

func main() { os.Exit(cli.Run(app.$ctor())) }
GO
            ;;
        kubelet)
            cat > "$mod/$name/main.go" <<'GO'
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() { os.Exit(cli.Run(app.NewKubeletCommand(context.Background()))) }
GO
            ;;
        kube-proxy)
            cat > "$mod/$name/main.go" <<'GO'
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() { os.Exit(cli.Run(app.NewProxyCommand())) }
GO
            ;;
        kubectl)
            cat > "$mod/$name/main.go" <<'GO'
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
GO
            ;;
    esac
}
k8s_names=()
for name in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
    wanted "$name" && k8s_names+=("$name")
done
if [[ ${#k8s_names[@]} -gt 0 ]]; then
    minor="${K8S_VERSION#v1.}"  # 37.2
    mod="$work/k8s"; mkdir -p "$mod"
    gomod="$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    {
        echo "module kappa.local/k8s"
        echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
        echo "require k8s.io/kubernetes ${K8S_VERSION}"
        awk '/=> \.\/staging\/src\//{print $1}' "$gomod" | while read -r m; do echo "replace $m => $m v0.${minor}"; done
    } > "$mod/go.mod"
    for name in "${k8s_names[@]}"; do k8s_main "$name"; done
    ( cd "$mod" && log "resolving k8s.io/kubernetes ${K8S_VERSION} (staging modules v0.${minor})" && go mod tidy >&2 )
    ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*} -X k8s.io/component-base/version.gitTreeState=clean"
    for name in "${k8s_names[@]}"; do
        log "building $name ${K8S_VERSION} (minutes)"
        ( cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$BIN/$name.tmp" "./$name" && mv "$BIN/$name.tmp" "$BIN/$name" )
    done
fi

# --- etcd -----------------------------------------------------------------------------------------------
if wanted etcd; then
    mod="$work/etcd"; mkdir -p "$mod"
    printf 'module kappa.local/etcd\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > "$mod/go.mod"
    cat > "$mod/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    log "building etcd ${ETCD_VERSION}"
    ( cd "$mod" && go mod tidy >&2 && go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" . && mv "$BIN/etcd.tmp" "$BIN/etcd" )
fi

# --- KWOK and its stages (node: initialize + heartbeat; pod: ready, complete, delete) --------------------
if wanted kwok; then
    log "building kwok ${KWOK_VERSION}"
    GOBIN="$work/gobin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
    mv "$work/gobin/kwok" "$BIN/kwok"
fi
if wanted kwok-stages.yaml; then
    src="$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
    for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml pod/fast/pod-ready.yaml \
             pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
        echo "---"; cat "$src/kustomize/stage/$f"
    done > "$BIN/kwok-stages.yaml.tmp"
    mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
fi

# --- the node's runtime: containerd (+ ctr, the runc v2 shim), CoreDNS, the sandbox program ---------------
if wanted containerd || wanted ctr || wanted containerd-shim-runc-v2; then
    log "building containerd ${CONTAINERD_VERSION}"
    pkg=github.com/containerd/containerd/v2
    GOBIN="$work/gobin" go install -trimpath -tags "no_btrfs no_devmapper no_zfs" \
        -ldflags "-s -w -X $pkg/version.Version=${CONTAINERD_VERSION}" \
        "$pkg/cmd/containerd@${CONTAINERD_VERSION}" "$pkg/cmd/ctr@${CONTAINERD_VERSION}" \
        "$pkg/cmd/containerd-shim-runc-v2@${CONTAINERD_VERSION}"
    mv "$work/gobin/containerd" "$work/gobin/ctr" "$work/gobin/containerd-shim-runc-v2" "$BIN/"
fi
if wanted coredns; then
    log "building coredns ${COREDNS_VERSION} (minutes)"
    GOBIN="$work/gobin" go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@${COREDNS_VERSION}"
    mv "$work/gobin/coredns" "$BIN/coredns"
fi
if [[ -n "${KUBE_ROUTER_VERSION:-}" ]] && wanted "kube-router-${KUBE_ROUTER_VERSION}"; then
    # a throw-away module (kube-router's own go.mod would pin the older dependencies KUBE_ROUTER_* raise)
    log "building kube-router ${KUBE_ROUTER_VERSION} (minutes)"
    mod="$work/kube-router"; mkdir -p "$mod"
    pkg=github.com/cloudnativelabs/kube-router/v2
    ( cd "$mod" && go mod init kappa.local/kube-router >&2 && go get "$pkg@${KUBE_ROUTER_VERSION}" >&2 \
        && go get "golang.org/x/net@${KUBE_ROUTER_X_NET}" "golang.org/x/crypto@${KUBE_ROUTER_X_CRYPTO}" \
            "google.golang.org/protobuf@${KUBE_ROUTER_PROTOBUF}" "github.com/docker/docker@${KUBE_ROUTER_DOCKER}" \
            "k8s.io/client-go@${KUBE_ROUTER_CLIENT_GO}" "k8s.io/api@${KUBE_ROUTER_CLIENT_GO}" \
            "k8s.io/apimachinery@${KUBE_ROUTER_CLIENT_GO}" >&2 \
        && go build -trimpath -ldflags "-s -w -X $pkg/pkg/version.Version=${KUBE_ROUTER_VERSION}" \
            -o "$BIN/kube-router-${KUBE_ROUTER_VERSION}.tmp" "$pkg/cmd/kube-router" \
        && mv "$BIN/kube-router-${KUBE_ROUTER_VERSION}.tmp" "$BIN/kube-router-${KUBE_ROUTER_VERSION}" )
fi
if [[ -n "${LOCAL_PATH_PROVISIONER_VERSION:-}" ]] && wanted "local-path-provisioner-${LOCAL_PATH_PROVISIONER_VERSION}"; then
    log "building local-path-provisioner ${LOCAL_PATH_PROVISIONER_VERSION}"
    GOBIN="$work/gobin" go install -trimpath -ldflags "-s -w -X main.VERSION=${LOCAL_PATH_PROVISIONER_VERSION}" \
        "github.com/rancher/local-path-provisioner@${LOCAL_PATH_PROVISIONER_VERSION}"
    mv "$work/gobin/local-path-provisioner" "$BIN/local-path-provisioner-${LOCAL_PATH_PROVISIONER_VERSION}"
fi
if [[ -n "${PAUSE:-}" ]] && wanted "$PAUSE"; then
    ( cd "$ROOT/infra/k8s/pause" && go build -trimpath -ldflags "-s -w" -o "$BIN/$PAUSE.tmp" . && mv "$BIN/$PAUSE.tmp" "$BIN/$PAUSE" )
fi
log "built ${missing[*]} in $((SECONDS - started)) s into $BIN"
echo "$BIN"
