#!/usr/bin/env bash
# Build (once) Prometheus' tools from the Go module proxy. Prints the bin folder.
#
# Usage: infra/prometheus/build.sh [promtool|prometheus|operator]
#   promtool    (the default) PROMETHEUS_VERSION's promtool: `make test` (tests/deploy/test_alert_rules.py) runs
#               `promtool test rules` on the chart's PrometheusRule with the unit tests of tests/deploy/alerts/.
#   prometheus  PROMETHEUS_VERSION's server, with Kubernetes service discovery only (tags remove_all_sd,
#               enable_kubernetes_sd: the only discovery the operator generates) and without the web UI's assets
#               (its HTTP API, /-/ready and /-/reload serve; the UI pages answer 500).
#   operator    the Prometheus operator PROMETHEUS_OPERATOR_VERSION and its prometheus-config-reloader.
#   The last two are what infra/k8s/monitoring.sh runs on the real node (scratch images, no registry).
#
# Cache: ${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/prometheus/<PROMETHEUS_VERSION>/bin (promtool, prometheus) and
# .../prometheus/operator-<PROMETHEUS_OPERATOR_VERSION>/bin (operator, prometheus-config-reloader), so another clone
# on the same machine finds them again. A warm call returns at once.
# KAPPA_PROMETHEUS_NO_BUILD=1: only the folder, whatever it holds (never starts a build).
#
# `go install <module>/cmd/...@<version>` is refused for both (their go.mod files have replace directives):
# infra/prometheus/go.mod and infra/prometheus/operator/go.mod require the modules and name the commands as tools
# (`go get -tool`), and their go.sum files pin every module a build reads. Two modules, not one: the operator is
# built against its own client-go (v0.33), which Prometheus' graph would raise. The Go module proxy serves
# Prometheus 3.x as v0.3xx.y (v0.315.0 is 3.15.0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
. "$ROOT/infra/lib/go-build.sh"
TOOLS="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/prometheus"
log() { echo "prometheus-build: $*" >&2; }
die() { echo "prometheus-build: error: $*" >&2; exit 1; }
what="${1:-promtool}"
[[ $# -le 1 ]] || die "usage: infra/prometheus/build.sh [promtool|prometheus|operator]"
minor="${PROMETHEUS_VERSION#v0.}"; minor="${minor%%.*}"
release="${minor:0:1}.${minor:1}.${PROMETHEUS_VERSION##*.}"   # v0.315.0 -> 3.15.0
case "$what" in
    promtool|prometheus)
        BIN="$TOOLS/${PROMETHEUS_VERSION}/bin"; module="$ROOT/infra/prometheus"
        requires="github.com/prometheus/prometheus ${PROMETHEUS_VERSION}"
        pkgs=("github.com/prometheus/prometheus/cmd/$what"); version="$release"
        tags=(); [[ "$what" == prometheus ]] && tags=(-tags netgo,remove_all_sd,enable_kubernetes_sd) ;;
    operator)
        BIN="$TOOLS/operator-${PROMETHEUS_OPERATOR_VERSION}/bin"; module="$ROOT/infra/prometheus/operator"
        requires="github.com/prometheus-operator/prometheus-operator ${PROMETHEUS_OPERATOR_VERSION}"
        pkgs=(github.com/prometheus-operator/prometheus-operator/cmd/operator
              github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader)
        version="${PROMETHEUS_OPERATOR_VERSION#v}"; tags=() ;;
    *) die "unknown tool '$what' (promtool, prometheus or operator)" ;;
esac
built() { local p; for p in "${pkgs[@]}"; do [[ -x "$BIN/${p##*/}" ]] || return 1; done; }
if built || [[ "${KAPPA_PROMETHEUS_NO_BUILD:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || die "go not found on PATH"
grep -Eq "${requires}( // indirect)?$" "$module/go.mod" \
    || die "${module#"$ROOT"/}/go.mod does not require ${requires}"
mkdir -p "$BIN"
# one build at a time per cache (make and a test run may ask together); the second finds the binaries built
exec 9>"$TOOLS/.build.lock"
flock 9
if built; then echo "$BIN"; exit 0; fi
for pkg in "${pkgs[@]}"; do
    name="${pkg##*/}"; started=$SECONDS
    [[ -x "$BIN/$name" ]] && continue
    log "building $name $version: its Go modules are downloaded first, then compiled (minutes on an idle 2-core" \
        "machine; a line every ${KAPPA_BUILD_HEARTBEAT:-30} s)"
    CGO_ENABLED=0 GOFLAGS=-mod=readonly go_build_reporting prometheus-build "$name" "$module" -p 2 -trimpath \
        "${tags[@]}" -ldflags "-s -w -X github.com/prometheus/common/version.Version=$version" \
        -o "$BIN/$name.tmp" "$pkg" || exit 1
    mv "$BIN/$name.tmp" "$BIN/$name"
    log "built $name in $((SECONDS - started)) s into $BIN"
done
echo "$BIN"
