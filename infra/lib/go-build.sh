# shellcheck shell=bash
# Sourced by the scripts that build a pinned tool from the Go module proxy (infra/objectstore/build.sh,
# infra/prometheus/build.sh): a cold build says where it is instead of printing hundreds of `go: downloading` lines
# and then nothing for minutes.

# go_build_reporting <prefix> <name> <dir> <go build args...>: `go build <args>` in <dir>, its output kept aside;
# a line "<prefix>: still building <name>: ..." every KAPPA_BUILD_HEARTBEAT seconds (30) with the Go modules
# downloaded so far. A failed build shows go's output (its download lines aside), one error line, and returns 1.
go_build_reporting() {
    local prefix="$1" name="$2" dir="$3" started=$SECONDS out builder modules
    shift 3
    out="$(mktemp)"
    ( cd "$dir" && exec go build "$@" ) >"$out" 2>&1 &
    builder=$!
    while kill -0 "$builder" 2>/dev/null; do
        for _ in $(seq "${KAPPA_BUILD_HEARTBEAT:-30}"); do kill -0 "$builder" 2>/dev/null || break; sleep 1; done
        kill -0 "$builder" 2>/dev/null || break
        modules=$(grep -c '^go: downloading ' "$out" || true)
        echo "$prefix: still building $name: $((SECONDS - started)) s, ${modules} Go modules downloaded, compiling" >&2
    done
    if ! wait "$builder"; then
        grep -v '^go: downloading ' "$out" >&2 || true
        rm -f "$out"
        echo "$prefix: error: go build of $name failed (above)" >&2
        return 1
    fi
    rm -f "$out"
}
