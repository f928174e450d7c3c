#!/usr/bin/env bash
# Builds the platform's container images on this machine with podman (buildah inside): no container registry and
# no Docker engine needed, only Debian's packages, PyPI and Maven Central. `make images` runs it.
#
# Usage: infra/images/build.sh [build|list|clean [--all]]
#   build   (default) build what is missing or stale, print a summary, write reports/images.json
#   list    the images the chart runs, one per line (what a node loads: podman save --format docker-archive ...)
#   clean   remove every image below; --all also the cached rootfs tarballs and podman's build cache mounts
#
# Images, in build order (one at a time: the machine has 2 shared cores), every tag from infra/versions.env:
#   localhost/kappa-base/debian:<DEBIAN_RELEASE>            debootstrap --variant=minbase, imported; also
#   localhost/kappa-base/debian:<POSTGRES_DEBIAN_RELEASE>   (the rootfs tarballs are cached in
#                                                           ${KAPPA_TOOLS_CACHE:-~/.cache/kappa}/images/, so every
#                                                           clone on the machine reuses them)
#   localhost/kappa-base/python:<PYTHON_VERSION>-slim-<DEBIAN_RELEASE>    bases/python.Dockerfile
#   localhost/kappa-base/maven:<maven>-openjdk-<java>-<DEBIAN_RELEASE>    bases/maven.Dockerfile (the versions
#                                                                         Debian really ships)
#   localhost/kappa/view-job:<KAPPA_VERSION>                 view-job.Dockerfile  PYTHON_IMAGE, MAVEN_IMAGE = the above
#   localhost/kappa-base/airflow:<AIRFLOW_VERSION>-python<PYTHON_VERSION>  bases/airflow.Dockerfile
#   localhost/kappa/airflow:<KAPPA_VERSION>                  airflow.Dockerfile   AIRFLOW_IMAGE, VIEW_JOB_IMAGE
#   localhost/kappa/kafka:<KAFKA_IMAGE_TAG>                  bases/kafka.Dockerfile (apache/kafka's stand-in)
#   localhost/kappa/postgres:<major.minor>, :<POSTGRES_MAJOR>  bases/postgres.Dockerfile (postgres' stand-in)
#   localhost/kappa/analyst:<KAPPA_VERSION>                  analyst.Dockerfile   PYTHON_IMAGE (an analyst's client:
#                                                           no pod of the chart runs it; the cluster tests do)
# The project's Dockerfiles are the ones a registry-connected `docker build` uses: only their base-image build args
# differ. podman's layer cache makes a re-run take seconds; a changed source rebuilds from the first layer it
# touches.
#
# podman runs with Debian's runc (crun refuses this kind of host's hybrid cgroups v1) and ulimits at or under the
# machine's hard limits, through a containers.conf of its own (.cache/images/containers.conf, CONTAINERS_CONF);
# nothing under /etc is changed. podman, buildah, runc and debootstrap are installed from Debian when missing (root).
# Build steps use the host network. Logs: .cache/images/<image>.log.
set -Eeuo pipefail
trap 'echo "images: error: line $LINENO: \"$BASH_COMMAND\" failed" >&2' ERR

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SELF="$ROOT/infra/images/build.sh"
STATE="$ROOT/.cache/images"
CACHE="${KAPPA_TOOLS_CACHE:-$HOME/.cache/kappa}/images"
REPORT="$ROOT/reports/images.json"
MIRROR="${KAPPA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SECURITY_MIRROR="${KAPPA_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
# CA certificates this host trusts beyond Debian's (a TLS-intercepting proxy's): the local base images trust them
# too, or pip and Maven could not reach PyPI / Maven Central from inside a build; empty: none
EXTRA_CA_DIR="${KAPPA_IMAGES_EXTRA_CA_DIR-/usr/local/share/ca-certificates}"

die() { echo "images: error: $*" >&2; exit 1; }
log() { echo "images: $*" >&2; }

load_versions() {
    set -a
    # shellcheck disable=SC1091
    . "$ROOT/infra/versions.env"
    set +a
    local k
    for k in KAPPA_VERSION PYTHON_VERSION DEBIAN_RELEASE AIRFLOW_VERSION KAFKA_IMAGE_TAG KAFKA_VERSION \
             POSTGRES_DEBIAN_RELEASE POSTGRES_MAJOR POSTGRES_IMAGE_TAG; do
        [[ -n "${!k:-}" ]] || die "infra/versions.env does not define $k"
    done
    [[ "$POSTGRES_IMAGE_TAG" == "$POSTGRES_MAJOR".* ]] \
        || die "POSTGRES_MAJOR=$POSTGRES_MAJOR is not the major of POSTGRES_IMAGE_TAG=$POSTGRES_IMAGE_TAG"
    DEBIAN_IMAGE="localhost/kappa-base/debian:$DEBIAN_RELEASE"
    PG_DEBIAN_IMAGE="localhost/kappa-base/debian:$POSTGRES_DEBIAN_RELEASE"
    PYTHON_IMAGE="localhost/kappa-base/python:$PYTHON_VERSION-slim-$DEBIAN_RELEASE"
    MAVEN_REPO="localhost/kappa-base/maven"
    AIRFLOW_BASE_IMAGE="localhost/kappa-base/airflow:$AIRFLOW_VERSION-python$PYTHON_VERSION"
    VIEW_JOB_IMAGE="localhost/kappa/view-job:$KAPPA_VERSION"
    ANALYST_IMAGE="localhost/kappa/analyst:$KAPPA_VERSION"
    AIRFLOW_IMAGE="localhost/kappa/airflow:$KAPPA_VERSION"
    KAFKA_IMAGE="localhost/kappa/kafka:$KAFKA_IMAGE_TAG"
    POSTGRES_REPO="localhost/kappa/postgres"
}

# ------------------------------------------------------------------------------------------ tools
ensure_tools() {
    local missing=() t
    for t in podman buildah debootstrap; do
        command -v "$t" >/dev/null 2>&1 || missing+=("$t")
    done
    [[ -x /usr/sbin/runc ]] || missing+=(runc)
    if ((${#missing[@]})); then
        [[ "$(id -u)" == 0 ]] || die "missing ${missing[*]}: install them (apt-get install podman buildah debootstrap runc) or run as root"
        log "installing ${missing[*]} from Debian"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            podman buildah debootstrap runc containernetworking-plugins netavark aardvark-dns uidmap \
            >"$STATE/apt.log" 2>&1 || {
            apt-get update >>"$STATE/apt.log" 2>&1
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
                podman buildah debootstrap runc containernetworking-plugins netavark aardvark-dns uidmap \
                >>"$STATE/apt.log" 2>&1 || die "apt-get install failed; see $STATE/apt.log"
        }
    fi
    [[ "$(id -u)" == 0 ]] || die "debootstrap and rootful podman need root (this machine's builds run as root)"
}

# podman/buildah settings of this script only: Debian's runc, ulimits the kernel lets a container have
podman_conf() {
    local nofile nproc pid_max
    nofile="$(ulimit -Hn)"; [[ "$nofile" == unlimited ]] && nofile=1048576
    nproc="$(ulimit -Hu)"; [[ "$nproc" == unlimited ]] && nproc=1048576
    pid_max="$(cat /proc/sys/kernel/pid_max)"
    ((nproc > pid_max)) && nproc="$pid_max"   # runc's setrlimit fails above it on this kind of VM
    ULIMITS=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")
    RUNC=/usr/sbin/runc
    cat >"$STATE/containers.conf.tmp" <<EOF
# generated by infra/images/build.sh: podman/buildah as this script runs them (CONTAINERS_CONF)
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"

[engine.runtimes]
runc = ["$RUNC"]
EOF
    mv "$STATE/containers.conf.tmp" "$STATE/containers.conf"
    export CONTAINERS_CONF="$STATE/containers.conf"
}

# ------------------------------------------------------------------------------------------ rootfs
extra_cas() { [[ -n "$EXTRA_CA_DIR" && -d "$EXTRA_CA_DIR" ]] && find "$EXTRA_CA_DIR" -name '*.crt' -type f | sort; }
extra_ca_fingerprint() {
    local files
    files="$(extra_cas || true)"
    if [[ -z "$files" ]]; then echo none; return; fi
    # shellcheck disable=SC2086
    cat $files | sha256sum | cut -c1-16
}

# A Debian minbase rootfs configured like the official debian:<release>-slim images: apt sources incl. updates and
# security, no recommends, caches cleaned after every install, no docs/man pages/locales, services never started.
configure_rootfs() {
    local root="$1" release="$2"
    rm -f "$root/etc/apt/sources.list"
    cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $release $release-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY_MIRROR
Suites: $release-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    cat >"$root/etc/apt/apt.conf.d/docker-no-recommends" <<'EOF'
APT::Install-Recommends "false";
APT::AutoRemove::SuggestsImportant "false";
Acquire::Languages "none";
Acquire::GzipIndexes "true";
Acquire::CompressionTypes::Order:: "gz";
EOF
    cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
    local ca n=0
    while IFS= read -r ca; do
        [[ -n "$ca" ]] || continue
        mkdir -p "$root/usr/local/share/ca-certificates/host"
        cp "$ca" "$root/usr/local/share/ca-certificates/host/$(basename "$ca")"
        n=$((n + 1))
    done < <(extra_cas || true)
    if ((n)); then
        log "rootfs $release: trusting $n extra CA certificate(s) of this host ($EXTRA_CA_DIR)"
        TMPDIR=/tmp chroot "$root" update-ca-certificates >"$STATE/update-ca-certificates-$release.log" 2>&1 \
            || die "update-ca-certificates in the $release rootfs failed; see $STATE/update-ca-certificates-$release.log"
    fi
    find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
    rm -rf "$root/usr/share/man/"* "$root/usr/share/info/"* "$root/usr/share/locale/"*
    # some postinst scripts (openjdk's update-alternatives) expect this directory
    mkdir -p "$root/usr/share/man/man1"
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod 0755 "$root/usr/sbin/policy-rc.d"
    rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"* "$root/var/log/"*.log \
        "$root/var/cache/debconf/"*-old "$root/etc/machine-id"
    : >"$root/etc/hostname"
    : >"$root/etc/resolv.conf"
}

rootfs_image() {  # rootfs_image <release> <image>: the tarball (cached, built with debootstrap once), imported
    local release="$1" image="$2"
    local tarball="$CACHE/debian-$release-minbase.tar.gz" ca
    ca="$(extra_ca_fingerprint)"
    if [[ -s "$tarball" && "$(cat "$tarball.ca" 2>/dev/null)" != "$ca" ]]; then
        log "rootfs $release: this host's extra CA certificates changed: rebuilding it"
        rm -f "$tarball"
    fi
    if [[ ! -s "$tarball" ]]; then
        log "rootfs $release: debootstrap --variant=minbase from $MIRROR (~30-60 s, cached in $CACHE)"
        mkdir -p "$CACHE"
        local tmp
        tmp="$(mktemp -d "$CACHE/.rootfs-$release.XXXXXX")"
        debootstrap --variant=minbase --include=ca-certificates "$release" "$tmp/root" "$MIRROR" \
            >"$STATE/debootstrap-$release.log" 2>&1 \
            || { rm -rf "$tmp"; die "debootstrap $release failed; see $STATE/debootstrap-$release.log: $(tail -1 "$STATE/debootstrap-$release.log")"; }
        configure_rootfs "$tmp/root" "$release"
        tar --numeric-owner --xattrs -C "$tmp/root" -czf "$tmp/rootfs.tar.gz" .
        echo "$ca" >"$tarball.ca"
        mv "$tmp/rootfs.tar.gz" "$tarball"
        rm -rf "$tmp"
    fi
    local sha have
    sha="$(sha256sum "$tarball" | cut -c1-64)"
    have="$(podman image inspect --format '{{index .Labels "dev.kappa.rootfs-sha256"}}' "$image" 2>/dev/null || true)"
    if [[ "$have" != "$sha" ]]; then
        log "rootfs $release: importing $(du -h "$tarball" | cut -f1) as $image"
        podman import \
            --change "LABEL dev.kappa.rootfs-sha256=$sha" \
            --change "LABEL org.opencontainers.image.description=Debian $release minbase (debootstrap $MIRROR)" \
            --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            --change 'CMD ["bash"]' \
            "$tarball" "$image" >"$STATE/import-$release.log" 2>&1 \
            || die "podman import failed; see $STATE/import-$release.log"
    fi
}

# ------------------------------------------------------------------------------------------ builds
image_id() { podman image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

declare -a SUMMARY=()
record() {  # record <name> <image> <seconds> <before-id>
    local name="$1" image="$2" secs="$3" before="$4" id size rebuilt=true
    id="$(image_id "$image")"
    [[ -n "$id" ]] || die "$image missing after its build"
    [[ "$id" == "$before" ]] && rebuilt=false
    size="$(podman image inspect --format '{{.Size}}' "$image")"
    SUMMARY+=("$name|$image|$size|$secs|$rebuilt|${id:0:12}")
    $rebuilt || UNCHANGED=$((UNCHANGED + 1))
}

build() {  # build <name> <dockerfile (repo-relative)> <iidfile> [podman build args...]
    local name="$1" file="$2" iid="$3"; shift 3
    log "$name: podman build -f $file ($STATE/$name.log)"
    rm -f "$iid"
    podman build --runtime "$RUNC" "${ULIMITS[@]}" --network host --layers \
        -f "$ROOT/$file" --ignorefile "$ROOT/$file.dockerignore" --iidfile "$iid" \
        "$@" "$ROOT" >"$STATE/$name.log" 2>&1 \
        || die "$name: build failed; see $STATE/$name.log:
$(grep -E 'error|Error|ERROR' "$STATE/$name.log" | tail -5)
$(tail -5 "$STATE/$name.log")"
}

deb_version() {  # deb_version <image> <package>: the Debian package's upstream version in the image
    local v
    v="$(podman run --rm --runtime "$RUNC" "${ULIMITS[@]}" --network none "$1" \
         dpkg-query -W -f '${Version}' "$2")"
    v="${v#*:}"
    echo "${v%%[-+~]*}"
}

build_all() {
    local t0 before start=$SECONDS
    UNCHANGED=0
    local fresh=true img
    for img in "$DEBIAN_IMAGE" "$PG_DEBIAN_IMAGE" "$VIEW_JOB_IMAGE" "$AIRFLOW_IMAGE" "$KAFKA_IMAGE"; do
        [[ -z "$(image_id "$img")" ]] || fresh=false
    done
    compgen -G "$CACHE/debian-*-minbase.tar.gz" >/dev/null && fresh=false

    t0=$SECONDS; before="$(image_id "$DEBIAN_IMAGE")"
    rootfs_image "$DEBIAN_RELEASE" "$DEBIAN_IMAGE"
    record rootfs-"$DEBIAN_RELEASE" "$DEBIAN_IMAGE" $((SECONDS - t0)) "$before"
    t0=$SECONDS; before="$(image_id "$PG_DEBIAN_IMAGE")"
    rootfs_image "$POSTGRES_DEBIAN_RELEASE" "$PG_DEBIAN_IMAGE"
    record rootfs-"$POSTGRES_DEBIAN_RELEASE" "$PG_DEBIAN_IMAGE" $((SECONDS - t0)) "$before"

    # python base
    t0=$SECONDS; before="$(image_id "$PYTHON_IMAGE")"
    build python-base infra/images/bases/python.Dockerfile "$STATE/python-base.iid" \
        --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$PYTHON_IMAGE"
    record python-base "$PYTHON_IMAGE" $((SECONDS - t0)) "$before"

    # maven base, tagged with the versions it really has
    local iid maven_version java_version maven_image
    t0=$SECONDS
    build maven-base infra/images/bases/maven.Dockerfile "$STATE/maven-base.iid" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE"
    iid="$(cat "$STATE/maven-base.iid")"
    if [[ -s "$STATE/maven-base.tag" && "$(head -1 "$STATE/maven-base.tag")" == "$iid" ]]; then
        maven_image="$(sed -n 2p "$STATE/maven-base.tag")"
    else
        maven_version="$(deb_version "$iid" maven)"
        java_version="$(deb_version "$iid" openjdk-17-jdk-headless)"
        maven_image="$MAVEN_REPO:$maven_version-openjdk-${java_version%%.*}-$DEBIAN_RELEASE"
        printf '%s\n%s\n' "$iid" "$maven_image" >"$STATE/maven-base.tag"
    fi
    before="$(image_id "$maven_image")"
    podman tag "$iid" "$maven_image"
    record maven-base "$maven_image" $((SECONDS - t0)) "$before"

    t0=$SECONDS; before="$(image_id "$VIEW_JOB_IMAGE")"
    build view-job infra/images/view-job.Dockerfile "$STATE/view-job.iid" \
        --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" --build-arg MAVEN_IMAGE="$maven_image" -t "$VIEW_JOB_IMAGE"
    record view-job "$VIEW_JOB_IMAGE" $((SECONDS - t0)) "$before"

    t0=$SECONDS; before="$(image_id "$AIRFLOW_BASE_IMAGE")"
    build airflow-base infra/images/bases/airflow.Dockerfile "$STATE/airflow-base.iid" \
        --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" -t "$AIRFLOW_BASE_IMAGE"
    record airflow-base "$AIRFLOW_BASE_IMAGE" $((SECONDS - t0)) "$before"

    t0=$SECONDS; before="$(image_id "$AIRFLOW_IMAGE")"
    build airflow infra/images/airflow.Dockerfile "$STATE/airflow.iid" \
        --build-arg AIRFLOW_IMAGE="$AIRFLOW_BASE_IMAGE" --build-arg VIEW_JOB_IMAGE="$VIEW_JOB_IMAGE" -t "$AIRFLOW_IMAGE"
    record airflow "$AIRFLOW_IMAGE" $((SECONDS - t0)) "$before"

    t0=$SECONDS; before="$(image_id "$KAFKA_IMAGE")"
    build kafka infra/images/bases/kafka.Dockerfile "$STATE/kafka.iid" \
        --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" --build-arg MAVEN_IMAGE="$maven_image" -t "$KAFKA_IMAGE"
    record kafka "$KAFKA_IMAGE" $((SECONDS - t0)) "$before"

    # PostgreSQL, tagged <major.minor> (the version Debian ships) and <major>
    local pg_version pg_image
    t0=$SECONDS
    build postgres infra/images/bases/postgres.Dockerfile "$STATE/postgres.iid" \
        --build-arg DEBIAN_IMAGE="$PG_DEBIAN_IMAGE"
    iid="$(cat "$STATE/postgres.iid")"
    if [[ -s "$STATE/postgres.tag" && "$(head -1 "$STATE/postgres.tag")" == "$iid" ]]; then
        pg_version="$(sed -n 2p "$STATE/postgres.tag")"
    else
        pg_version="$(deb_version "$iid" "postgresql-$POSTGRES_MAJOR")"
        printf '%s\n%s\n' "$iid" "$pg_version" >"$STATE/postgres.tag"
    fi
    [[ "$pg_version" == "$POSTGRES_MAJOR".* ]] || die "postgres image has PostgreSQL $pg_version, not $POSTGRES_MAJOR.x"
    pg_image="$POSTGRES_REPO:$pg_version"
    before="$(image_id "$pg_image")"
    podman tag "$iid" "$pg_image" "$POSTGRES_REPO:$POSTGRES_MAJOR"
    record postgres "$pg_image" $((SECONDS - t0)) "$before"

    # an analyst's client (the laptop's lock in a container): what the cluster tests query the SQL service from
    t0=$SECONDS; before="$(image_id "$ANALYST_IMAGE")"
    build analyst infra/images/analyst.Dockerfile "$STATE/analyst.iid" \
        --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" -t "$ANALYST_IMAGE"
    record analyst "$ANALYST_IMAGE" $((SECONDS - t0)) "$before"

    local total=$((SECONDS - start)) kind=partial
    $fresh && kind=cold
    ((UNCHANGED == ${#SUMMARY[@]})) && kind=warm
    summary "$total" "$kind"
    write_report "$total" "$kind"
}

human() { numfmt --to=si --round=nearest --suffix=B --format='%.1f' "$1"; }

summary() {
    local total="$1" kind="$2" row name image size secs rebuilt id
    log "built in ${total}s ($kind run)"
    printf 'images:   %-54s %9s %7s  %s\n' IMAGE SIZE TIME STATUS >&2
    for row in "${SUMMARY[@]}"; do
        IFS='|' read -r name image size secs rebuilt id <<<"$row"
        printf 'images:   %-54s %9s %6ss  %s\n' "$image" "$(human "$size")" "$secs" \
            "$([[ $rebuilt == true ]] && echo "built $id" || echo "cached $id")" >&2
    done
}

write_report() {
    local total="$1" kind="$2" row
    mkdir -p "$(dirname "$REPORT")"
    printf '%s\n' "${SUMMARY[@]}" >"$STATE/summary.txt"
    python3 - "$STATE/summary.txt" "$REPORT" "$total" "$kind" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        "$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)" "$(nproc)" <<'EOF'
import json, sys, pathlib
rows, report, total, kind, when, commit, cores = sys.argv[1:]
images = []
for line in pathlib.Path(rows).read_text().splitlines():
    name, image, size, secs, rebuilt, image_id = line.split("|")
    images.append({"name": name, "image": image, "size_bytes": int(size), "size_mb": round(int(size) / 1e6, 1),
                   "seconds": int(secs), "rebuilt": rebuilt == "true", "id": image_id})
run = {"kind": kind, "when": when, "commit": commit, "cores": int(cores), "seconds": int(total), "images": images}
path = pathlib.Path(report)
try:
    old = json.loads(path.read_text())
except (OSError, ValueError):
    old = {}
out = {"latest": run, "cold": old.get("cold"), "warm": old.get("warm")}
if kind in ("cold", "warm"):
    out[kind] = run
out["note"] = ("cold: nothing cached (no rootfs tarball, no images); warm: nothing rebuilt; "
               "sizes are podman's uncompressed image sizes")
path.write_text(json.dumps(out, indent=2) + "\n")
EOF
    log "report: ${REPORT#"$ROOT"/}"
}

# ------------------------------------------------------------------------------------------ list / clean
list_images() {
    local pg
    pg="$(sed -n 2p "$STATE/postgres.tag" 2>/dev/null || true)"
    printf '%s\n' "$VIEW_JOB_IMAGE" "$AIRFLOW_IMAGE" "$KAFKA_IMAGE" "$POSTGRES_REPO:${pg:-$POSTGRES_MAJOR}"
}

clean() {
    local all="${1:-}" ids
    ids="$(podman images --format '{{.Repository}}:{{.Tag}}' | grep -E '^localhost/kappa(-base)?/' || true)"
    if [[ -n "$ids" ]]; then
        log "removing $(echo "$ids" | wc -l) images"
        # shellcheck disable=SC2086
        podman rmi -f $ids >/dev/null
    fi
    podman image prune -f >/dev/null
    rm -f "$STATE"/*.iid "$STATE"/*.tag
    if [[ "$all" == "--all" ]]; then
        log "removing the cached rootfs tarballs ($CACHE) and podman's build cache mounts"
        rm -f "$CACHE"/debian-*-minbase.tar.gz "$CACHE"/debian-*-minbase.tar.gz.ca
        rm -rf /var/tmp/buildah-cache "/var/tmp/buildah-cache-$(id -u)"
    fi
}

main() {
    local cmd="${1:-build}"
    load_versions
    mkdir -p "$STATE"
    case "$cmd" in
        build) ensure_tools; podman_conf; build_all ;;
        list) list_images ;;
        clean) ensure_tools; podman_conf; clean "${2:-}" ;;
        -h|--help|help) sed -n '2,33p' "$SELF" | sed 's/^# \{0,1\}//' ;;
        *) die "unknown command '$cmd' (build|list|clean [--all])" ;;
    esac
}

main "$@"
