#!/usr/bin/env bash
# Build (once) the pinned S3-API object store, SeaweedFS's `weed`, from the Go module proxy. Prints the bin folder.
#
# Usage: infra/objectstore/build.sh
#   `make objectstore-up` and the tests' object_store fixture (tests/conftest.py) call it; kappa.objectstore runs
#   the binary (`weed server` with its filer and S3 gateway, and `weed volume`; on loopback).
#
# Cache: ${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/objectstore/seaweedfs-<SEAWEEDFS_VERSION>/bin/weed, so another
# clone on the same machine finds it again. A cold build took 12 min 47 s wall on 2 cores busy with other work (load
# 5-11; module download included, the Go build cache shared with the other tools' builds; 2.2 GB peak resident for
# one compiler/linker process) for a 157 MiB binary (a by-hand build on an idle machine of this kind: 3 min 18 s).
# A warm one returns at once.
# KAPPA_OBJECTSTORE_NO_BUILD=1: only the folder, whatever it holds (never starts a build).
# KAPPA_BUILD_HEARTBEAT: seconds between two "still building" lines (30).
#
# `go install github.com/seaweedfs/seaweedfs/weed@<version>` is refused (the module's go.mod has a replace
# directive), so the module is downloaded from the proxy, copied to a throw-away folder and built there with its own
# go.mod and go.sum.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
set -a; . "$ROOT/infra/versions.env"; set +a
. "$ROOT/infra/lib/go-build.sh"
MODULE=github.com/seaweedfs/seaweedfs
TOOLS="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/objectstore"
BIN="$TOOLS/seaweedfs-${SEAWEEDFS_VERSION}/bin"
log() { echo "objectstore-build: $*" >&2; }
[[ $# -eq 0 ]] || { echo "objectstore-build: error: usage: infra/objectstore/build.sh" >&2; exit 1; }
if [[ -x "$BIN/weed" || "${KAPPA_OBJECTSTORE_NO_BUILD:-}" == 1 ]]; then echo "$BIN"; exit 0; fi
command -v go >/dev/null || { echo "objectstore-build: error: go not found on PATH" >&2; exit 1; }
mkdir -p "$BIN"
# one build at a time per cache (make and a test run may ask together); the second finds the binary built
exec 9>"$TOOLS/.build.lock"
flock 9
if [[ -x "$BIN/weed" ]]; then echo "$BIN"; exit 0; fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
export GOFLAGS="-mod=mod" CGO_ENABLED=0
started=$SECONDS
log "downloading $MODULE@${SEAWEEDFS_VERSION}"
src="$(go mod download -json "$MODULE@${SEAWEEDFS_VERSION}" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
cp -r "$src" "$work/seaweedfs"
chmod -R u+w "$work/seaweedfs"
commit="${SEAWEEDFS_VERSION##*-}"  # the pseudo-version's commit
log "building weed ${SEAWEEDFS_VERSION}: its Go modules are downloaded first, then compiled (about 3 min on an idle" \
    "2-core machine, 13 min with its cores busy; a line every 30 s)"
# go prints one "go: downloading" line per module (hundreds): counted into the progress lines instead
go_build_reporting objectstore-build weed "$work/seaweedfs" -p 2 -trimpath \
    -ldflags "-s -w -X $MODULE/weed/util/version.COMMIT=${commit:0:8}" -o "$BIN/weed.tmp" ./weed || exit 1
mv "$BIN/weed.tmp" "$BIN/weed"
log "built weed in $((SECONDS - started)) s into $BIN"
echo "$BIN"
