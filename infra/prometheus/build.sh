#!/usr/bin/env bash
# Build (once) Prometheus' promtool at PROMETHEUS_VERSION from the Go module proxy. Prints the bin folder.
#
# Usage: infra/prometheus/build.sh
#   `make test` (tests/deploy/test_alert_rules.py) runs `promtool test rules` on the chart's PrometheusRule with the
#   unit tests of tests/deploy/alerts/.
#
# Cache: ${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/prometheus/<PROMETHEUS_VERSION>/bin/promtool, so another clone on
# the same machine finds it again. A warm call returns at once.
# KAPPA_PROMETHEUS_NO_BUILD=1: only the folder, whatever it holds (never starts a build).
#
# `go install github.com/prometheus/prometheus/cmd/promtool@<version>` is refused (the module's go.mod has a replace
# directive): infra/prometheus/go.mod requires the module and names promtool as a tool (`go get -tool`), and its
# go.sum pins every module the build reads; the Go module proxy serves Prometheus 3.x as v0.3xx.y.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
. "$ROOT/infra/lib/go-build.sh"
TOOLS="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/prometheus"
BIN="$TOOLS/${PROMETHEUS_VERSION}/bin"
log() { echo "prometheus-build: $*" >&2; }
[[ $# -eq 0 ]] || { echo "prometheus-build: error: usage: infra/prometheus/build.sh" >&2; exit 1; }
if [[ -x "$BIN/promtool" || "${KAPPA_PROMETHEUS_NO_BUILD:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "prometheus-build: error: go not found on PATH" >&2; exit 1; }
grep -Eq "github.com/prometheus/prometheus ${PROMETHEUS_VERSION}( // indirect)?$" "$ROOT/infra/prometheus/go.mod" \
    || { echo "prometheus-build: error: infra/prometheus/go.mod does not require PROMETHEUS_VERSION ${PROMETHEUS_VERSION}" >&2; exit 1; }
mkdir -p "$BIN"
# one build at a time per cache (make and a test run may ask together); the second finds the binary built
exec 9>"$TOOLS/.build.lock"
flock 9
if [[ -x "$BIN/promtool" ]]; then echo "$BIN"; exit 0; fi
started=$SECONDS
log "building promtool ${PROMETHEUS_VERSION}: its Go modules are downloaded first, then compiled (a few minutes on" \
    "an idle 2-core machine; a line every ${KAPPA_BUILD_HEARTBEAT:-30} s)"
CGO_ENABLED=0 GOFLAGS=-mod=readonly go_build_reporting prometheus-build promtool "$ROOT/infra/prometheus" -p 2 -trimpath \
    -ldflags "-s -w" -o "$BIN/promtool.tmp" github.com/prometheus/prometheus/cmd/promtool || exit 1
mv "$BIN/promtool.tmp" "$BIN/promtool"
log "built promtool in $((SECONDS - started)) s into $BIN"
echo "$BIN"
