#!/usr/bin/env bash
# Build (once) the pinned Kubernetes control plane the chart's tests run against: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl and KWOK (+ its stage files), all from the Go module proxy.
# Prints the bin folder.
#
# Cache: ${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/k8s/<K8S_VERSION>-etcd<ETCD_VERSION>-kwok<KWOK_VERSION>/bin, so
# another clone on the same machine finds it again. A cold build takes ~10-20 minutes on 2 cores (kube-apiserver
# alone ~9); a warm one returns at once.
#
# kube-apiserver & co cannot be `go install`ed (k8s.io/kubernetes has replace directives to its staging folder):
# they build in a throw-away module that requires k8s.io/kubernetes and replaces every staging module by its
# published v0.<minor>.<patch> twin; the version is stamped with -ldflags (else the server says v0.0.0 and the
# chart's kubeVersion check fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
CACHE="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/k8s/${K8S_VERSION}-etcd${ETCD_VERSION}-kwok${KWOK_VERSION}"
BIN="$CACHE/bin"
log() { echo "k8s-build: $*" >&2; }
need=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kwok-stages.yaml)
missing=()
for b in "${need[@]}"; do [[ -e "$BIN/$b" ]] || missing+=("$b"); done
if [[ ${#missing[@]} -eq 0 ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "k8s-build: error: go not found on PATH" >&2; exit 1; }
mkdir -p "$BIN"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
export GOFLAGS="-mod=mod" CGO_ENABLED=0
started=$SECONDS

# --- Kubernetes control plane -------------------------------------------------------------------------
if [[ " ${missing[*]} " =~ " kube" ]]; then
    minor="${K8S_VERSION#v1.}"  # 37.2
    mod="$work/k8s"; mkdir -p "$mod"
    gomod="$(go mod download -json "k8s.io/kubernetes@${K8S_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    {
        echo "module kappa.local/k8s"
        echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
        echo "require k8s.io/kubernetes ${K8S_VERSION}"
        awk '/=> \.\/staging\/src\//{print $1}' "$gomod" | while read -r m; do echo "replace $m => $m v0.${minor}"; done
    } > "$mod/go.mod"
    for c in kube-apiserver:NewAPIServerCommand kube-controller-manager:NewControllerManagerCommand \
             kube-scheduler:NewSchedulerCommand; do
        name="${c%%:*}"; ctor="${c##*:}"; mkdir -p "$mod/$name"
        cat > "$mod/$name/main.go" <<GO
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/$name/app"
)

func main() { os.Exit(cli.Run(app.$ctor())) }
GO
    done
    mkdir -p "$mod/kubectl"
    cat > "$mod/kubectl/main.go" <<'GO'
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
    ( cd "$mod" && log "resolving k8s.io/kubernetes ${K8S_VERSION} (staging modules v0.${minor})" && go mod tidy >&2 )
    ldflags="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*} -X k8s.io/component-base/version.gitTreeState=clean"
    for name in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
        [[ -x "$BIN/$name" ]] && continue
        log "building $name ${K8S_VERSION} (minutes)"
        ( cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$BIN/$name.tmp" "./$name" && mv "$BIN/$name.tmp" "$BIN/$name" )
    done
fi

# --- etcd -----------------------------------------------------------------------------------------------
if [[ ! -x "$BIN/etcd" ]]; then
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
if [[ ! -x "$BIN/kwok" ]]; then
    log "building kwok ${KWOK_VERSION}"
    GOBIN="$work/gobin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
    mv "$work/gobin/kwok" "$BIN/kwok"
fi
if [[ ! -f "$BIN/kwok-stages.yaml" ]]; then
    src="$(GOFLAGS= go mod download -json "sigs.k8s.io/kwok@${KWOK_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
    for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml pod/fast/pod-ready.yaml \
             pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
        echo "---"; cat "$src/kustomize/stage/$f"
    done > "$BIN/kwok-stages.yaml.tmp"
    mv "$BIN/kwok-stages.yaml.tmp" "$BIN/kwok-stages.yaml"
fi
log "built ${missing[*]} in $((SECONDS - started)) s into $BIN"
echo "$BIN"
