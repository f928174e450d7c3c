#!/usr/bin/env bash
# Bootstrap the local kappa toolchain: Python venv + JVM jars, everything under <repo>/.cache/.
#
# Usage: infra/local/bootstrap.sh [all|python|jars|lock|check]
#   all     (default) preflight, Python venv, broker + Spark connector jars, the project's Java jars (the forkless
#           local file system, the SQL guards), the driver class-data archive; one summary line.
#   python  preflight + .cache/venv only.
#   jars    preflight + .cache/jars/{broker,spark,s3a,hadoop,cds,sql} (needs the venv: Spark jars are diffed against pyspark/jars).
#   lock    regenerate requirements.lock from a clean throw-away venv (pins from infra/versions.env).
#   check   preflight only.
#
# Idempotent and fast on re-run: each step writes a stamp file .cache/stamps/<step> holding a sha256 of
# its inputs (versions.env, pom.xml, requirements.lock, pyproject.toml, this script, ...); a step whose
# stamp matches and whose outputs exist is skipped without touching the network.
#
# Network: only PyPI (pip) and Maven Central (mvn; infra/local/maven-settings.xml mirrors every repository
# a POM may declare to Central). The local Maven repository is .cache/m2 (override with
# KAPPA_M2_REPO=~/.m2/repository to share a user cache).
#
# Outputs:
#   .cache/venv/                python3.11 venv: requirements.lock + `pip install -e . --no-deps`
#   .cache/jars/broker/*.jar    Kafka broker (kafka.Kafka) + storage tool (kafka.tools.StorageTool) + log4j2
#   .cache/jars/spark/*.jar     jars missing from pyspark/jars: spark-sql-kafka-0-10, Kafka clients, Delta
#   .cache/jars/s3a/*.jar       hadoop-aws + AWS SDK v2 modules: Spark's s3a:// filesystem (a lake on an object store)
#   .cache/jars/cds/spark-driver.jsa  class-data sharing archive every Spark driver JVM maps (kappa/runtime/cds.py)
#   .cache/jars/hadoop/kappa-hadoop.jar  Hadoop's local file system without a process per file, the plan-metrics
#                                        helper (kappa/runtime/java)
#   .cache/jars/sql/kappa-sql.jar     the SQL service's guards (kappa/front/sql/java), compiled against pyspark/jars
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="$ROOT/.cache"
STAMPS="$CACHE/stamps"
VENV="$CACHE/venv"
JARS="$CACHE/jars"
POM="$ROOT/infra/local/pom.xml"
MVN_SETTINGS="$ROOT/infra/local/maven-settings.xml"
SELF="$ROOT/infra/local/bootstrap.sh"
LOCK="$ROOT/requirements.lock"
M2_REPO="${KAPPA_M2_REPO:-$CACHE/m2}"
PIP_FLAGS=(--disable-pip-version-check --no-input --progress-bar off)

die() { echo "bootstrap: error: $*" >&2; exit 1; }
log() { echo "bootstrap: $*" >&2; }

# ---------------------------------------------------------------------------------------------- pins
load_versions() {
    local f="$ROOT/infra/versions.env"
    [[ -f "$f" ]] || die "missing $f"
    set -a
    # shellcheck disable=SC1090
    . "$f"
    set +a
    local k
    for k in PYTHON_VERSION SCALA_BINARY SPARK_VERSION DELTA_VERSION DELTA_SPARK_ARTIFACT KAFKA_VERSION \
             CONFLUENT_KAFKA_VERSION AIRFLOW_VERSION AIRFLOW_CLIENT_VERSION PROMETHEUS_CLIENT_VERSION LOG4J2_VERSION \
             MAVEN_DEPENDENCY_PLUGIN_VERSION SPARK_KAFKA_TOKEN_PROVIDER_VERSION UV_VERSION; do
        [[ -n "${!k:-}" ]] || die "infra/versions.env does not define $k"
    done
    PYTHON="python${PYTHON_VERSION}"
}

# ----------------------------------------------------------------------------------------- preflight
preflight() {
    command -v java >/dev/null 2>&1 || die "java not found on PATH (need a JDK >= 17, e.g. apt-get install openjdk-17-jdk-headless)"
    local jv major
    jv="$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')"
    major="${jv%%.*}"
    [[ "$major" == "1" ]] && major="$(echo "$jv" | cut -d. -f2)"
    [[ "$major" =~ ^[0-9]+$ && "$major" -ge 17 ]] || die "java >= 17 required, found '${jv:-unknown}' ($(command -v java))"
    command -v mvn >/dev/null 2>&1 || die "mvn (Apache Maven) not found on PATH (e.g. apt-get install maven)"
    # pyenv installs shims for versions that may not be installed: run it, don't just look it up.
    "$PYTHON" -c 'import sys, venv' >/dev/null 2>&1 || die "$PYTHON not found or not working (install Python $PYTHON_VERSION with venv support)"
}

# ------------------------------------------------------------------------------------------- stamps
hash_of() {  # hash_of <label> [files...] -- sha256 over a label (string inputs) and file contents
    local label="$1"; shift
    { printf '%s\n' "$label"; cat "$@"; } | sha256sum | cut -c1-16
}
stamp_ok() { [[ -f "$STAMPS/$1" && "$(cat "$STAMPS/$1")" == "$2" ]]; }
stamp_set() { mkdir -p "$STAMPS"; printf '%s\n' "$2" >"$STAMPS/$1"; }

# ------------------------------------------------------------------------------------------- python
python_step() {
    [[ -f "$LOCK" ]] || die "missing requirements.lock (run: infra/local/bootstrap.sh lock)"
    [[ -f "$ROOT/pyproject.toml" ]] || die "missing pyproject.toml"
    local h
    # pyproject.toml without its [tool.pytest...] section: editing test settings needs no reinstall
    h="$(hash_of "py=$PYTHON $($PYTHON -c 'import sys; print(sys.version)')
$(awk '/^\[/ { skip = ($0 ~ /^\[tool\.pytest/) } !skip' "$ROOT/pyproject.toml")" "$LOCK")"
    if stamp_ok python "$h" && [[ -x "$VENV/bin/python" ]]; then
        PY_STATUS="cached"; return 0
    fi
    log "python: installing requirements.lock into .cache/venv (a fresh venv downloads ~0.5 GB from PyPI, once)"
    if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c '' 2>/dev/null; then
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    # uv (from PyPI, pinned) installs the lock: a fresh venv in 45 s where pip took ~160 s on 2 cores (parallel
    # downloads and unpacking, its own wheel cache in ~/.cache/uv); the venv stays a plain venv with pip in it
    "$VENV/bin/pip" install "${PIP_FLAGS[@]}" -q "uv==$UV_VERSION"
    local uv=("$VENV/bin/uv" pip --quiet)
    "${uv[@]}" install --python "$VENV/bin/python" -r "$LOCK"
    # editable install of the project itself (built with setuptools in an isolated build env)
    "${uv[@]}" install --python "$VENV/bin/python" --no-deps -e "$ROOT"
    # each fresh venv builds pyspark's sdist into a new revision of uv's cache (1.4 GB each: 26 GB after a few
    # days of fresh checkouts on one machine, until the disk was full); keep only what the cache still reaches
    "$VENV/bin/uv" cache prune --quiet || log "python: uv cache prune failed (the venv is fine; ~/.cache/uv keeps growing)"
    "$VENV/bin/pip" check >/dev/null || die "pip check failed in .cache/venv: $("$VENV/bin/pip" check 2>&1 | head -3)"
    stamp_set python "$h"
    PY_STATUS="installed"
}

# --------------------------------------------------------------------------------------------- jars
mvn_copy() {  # mvn_copy <profile> <outdir> [extra -D args...]
    local profile="$1" out="$2"; shift 2
    local tmp="$out.tmp"
    rm -rf "$tmp"
    mkdir -p "$tmp" "$M2_REPO"
    mvn -q -B -f "$POM" -s "$MVN_SETTINGS" -P "$profile" \
        -Dmaven.repo.local="$M2_REPO" \
        -Dscala.binary="$SCALA_BINARY" \
        -Dkafka.version="$KAFKA_VERSION" \
        -Dspark.version="$SPARK_VERSION" \
        -Ddelta.version="$DELTA_VERSION" \
        -Ddelta.artifact="$DELTA_SPARK_ARTIFACT" \
        -Dlog4j2.version="$LOG4J2_VERSION" \
        -Dmaven.dependency.plugin.version="$MAVEN_DEPENDENCY_PLUGIN_VERSION" \
        -Dspark.token.provider.version="$SPARK_KAFKA_TOKEN_PROVIDER_VERSION" \
        -DoutputDirectory="$tmp" \
        "$@" dependency:copy-dependencies >"$CACHE/mvn-$profile.log" 2>&1 \
        || die "maven ($profile) failed; see .cache/mvn-$profile.log: $(grep -m1 ERROR "$CACHE/mvn-$profile.log" || tail -1 "$CACHE/mvn-$profile.log")"
    rm -rf "$out"
    mv "$tmp" "$out"
}

pyspark_jars_dir() {
    "$VENV/bin/python" - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("pyspark")
print(pathlib.Path(spec.origin).parent / "jars")
EOF
}

# Every artifactId candidate of the jars pyspark ships: for "zstd-jni-1.5.7-6.jar" -> zstd-jni and
# zstd-jni-1.5.7 (each prefix ending before a "-<digit>"). Passed to Maven as excludeArtifactIds, so a
# dependency already on pyspark's classpath is never copied twice (in whatever version).
pyspark_artifact_ids() {
    local dir="$1"
    find "$dir" -maxdepth 1 -name '*.jar' -printf '%f\n' | sed 's/\.jar$//' | awk '{
        s = $0; pre = ""
        while ((i = match(s, /-[0-9]/)) > 0) {   # every prefix that ends right before a "-<digit>"
            pre = pre substr(s, 1, i - 1); print pre
            pre = pre substr(s, i, 2); s = substr(s, i + 2)
        }
    }' | sort -u | paste -sd, -
}

jars_step() {
    [[ -x "$VENV/bin/python" ]] || die "no .cache/venv yet (run: infra/local/bootstrap.sh python)"
    local h pyspark_dir
    # broker
    h="$(hash_of "kafka=$KAFKA_VERSION scala=$SCALA_BINARY log4j2=$LOG4J2_VERSION mdp=$MAVEN_DEPENDENCY_PLUGIN_VERSION" "$POM" "$MVN_SETTINGS")"
    if stamp_ok jars-broker "$h" && [[ -d "$JARS/broker" ]]; then
        BROKER_STATUS="cached"
    else
        log "jars: resolving Kafka $KAFKA_VERSION broker from Maven Central"
        mvn_copy broker "$JARS/broker"
        compgen -G "$JARS/broker/kafka_${SCALA_BINARY}-${KAFKA_VERSION}.jar" >/dev/null \
            || die "kafka_${SCALA_BINARY}-${KAFKA_VERSION}.jar missing from .cache/jars/broker"
        stamp_set jars-broker "$h"
        BROKER_STATUS="installed"
    fi
    # spark connectors (depends on what pyspark ships)
    pyspark_dir="$(pyspark_jars_dir)"
    [[ -d "$pyspark_dir" ]] || die "pyspark jars directory not found ($pyspark_dir)"
    h="$(hash_of "spark=$SPARK_VERSION token=$SPARK_KAFKA_TOKEN_PROVIDER_VERSION delta=$DELTA_SPARK_ARTIFACT:$DELTA_VERSION scala=$SCALA_BINARY mdp=$MAVEN_DEPENDENCY_PLUGIN_VERSION
$(ls "$pyspark_dir")" "$POM" "$MVN_SETTINGS")"
    if stamp_ok jars-spark "$h" && [[ -d "$JARS/spark" ]]; then
        SPARK_STATUS="cached"
    else
        log "jars: resolving spark-sql-kafka $SPARK_VERSION + $DELTA_SPARK_ARTIFACT $DELTA_VERSION (minus pyspark/jars)"
        local jackson
        jackson="$(find "$pyspark_dir" -maxdepth 1 -name 'jackson-databind-*.jar' -printf '%f\n' | sed 's/^jackson-databind-//; s/\.jar$//' | head -1)"
        [[ -n "$jackson" ]] || die "no jackson-databind in $pyspark_dir"
        mvn_copy spark "$JARS/spark" -Djackson.version="$jackson" \
            -DexcludeArtifactIds="$(pyspark_artifact_ids "$pyspark_dir")"
        local want
        for want in "spark-sql-kafka-0-10_${SCALA_BINARY}-${SPARK_VERSION}.jar" \
                    "${DELTA_SPARK_ARTIFACT}-${DELTA_VERSION}.jar" "delta-storage-${DELTA_VERSION}.jar"; do
            [[ -f "$JARS/spark/$want" ]] || die "$want missing from .cache/jars/spark"
        done
        stamp_set jars-spark "$h"
        SPARK_STATUS="installed"
    fi
    # s3a: hadoop-aws in pyspark's Hadoop version + the AWS SDK modules it uses (a lake on an object store)
    local hadoop
    hadoop="$(find "$pyspark_dir" -maxdepth 1 -name 'hadoop-client-api-*.jar' -printf '%f\n' | sed 's/^hadoop-client-api-//; s/\.jar$//' | head -1)"
    [[ -n "$hadoop" ]] || die "no hadoop-client-api in $pyspark_dir"
    h="$(hash_of "hadoop=$hadoop awssdk=$AWS_SDK_V2_VERSION mdp=$MAVEN_DEPENDENCY_PLUGIN_VERSION
$(ls "$pyspark_dir")" "$POM" "$MVN_SETTINGS")"
    if stamp_ok jars-s3a "$h" && [[ -d "$JARS/s3a" ]]; then
        S3A_STATUS="cached"
    else
        log "jars: resolving hadoop-aws $hadoop + AWS SDK $AWS_SDK_V2_VERSION modules (minus pyspark/jars)"
        mvn_copy s3a "$JARS/s3a" -Dhadoop.version="$hadoop" -Dawssdk.version="$AWS_SDK_V2_VERSION" \
            -DexcludeArtifactIds="$(pyspark_artifact_ids "$pyspark_dir")"
        [[ -f "$JARS/s3a/hadoop-aws-$hadoop.jar" ]] || die "hadoop-aws-$hadoop.jar missing from .cache/jars/s3a"
        stamp_set jars-s3a "$h"
        S3A_STATUS="installed"
    fi
}

# ---------------------------------------------------------------------------------------------- cds
# A class-data sharing archive of what a Spark driver loads (kappa/runtime/cds.py): every driver JVM maps it
# and starts seconds faster. Rebuilt when the JDK, the jars or the workload change.
cds_step() {
    local h
    h="$(hash_of "$(java -version 2>&1) $(ls "$(pyspark_jars_dir)" "$JARS/spark")" "$ROOT/kappa/runtime/cds.py" \
        "$JARS/hadoop/kappa-hadoop.jar")"
    if stamp_ok cds "$h" && [[ -f "$JARS/cds/spark-driver.jsa" ]]; then
        CDS_STATUS="cached"
    else
        log "cds: building the Spark driver class-data archive (~1 min, once)"
        "$VENV/bin/python" -m kappa.runtime.cds "$JARS/cds/spark-driver.jsa" >"$CACHE/cds.log" 2>&1 \
            || die "building the class-data archive failed; see .cache/cds.log: $(tail -1 "$CACHE/cds.log")"
        stamp_set cds "$h"
        CDS_STATUS="built"
    fi
}

# ---------------------------------------------------------------------------------------------- java
# java_jar <step> <source folder> <jar>: the project's Java sources under <source folder>, compiled with the JDK
# against the jars pyspark ships (seconds; no download) into <jar>; skipped while the stamp of <step> matches.
# Sets JAVA_STATUS to cached or built.
java_jar() {
    local step="$1" src="$ROOT/$2" jar="$3" h pyspark_dir
    pyspark_dir="$(pyspark_jars_dir)"
    h="$(hash_of "$(java -version 2>&1) $(ls "$pyspark_dir")" $(find "$src" -name '*.java' | sort))"
    if stamp_ok "$step" "$h" && [[ -f "$jar" ]]; then
        JAVA_STATUS="cached"; return 0
    fi
    local out="$CACHE/$step-classes"
    rm -rf "$out" && mkdir -p "$out" "$(dirname "$jar")"
    javac -nowarn --release 17 -d "$out" -cp "$pyspark_dir/*" $(find "$src" -name '*.java' | sort) \
        || die "compiling $2 failed (above)"
    jar cf "$jar.tmp" -C "$out" kappa && mv "$jar.tmp" "$jar"
    rm -rf "$out"
    stamp_set "$step" "$h"
    JAVA_STATUS="built"
}

# Hadoop's local file system without a process per file operation (kappa/runtime/java: chmod and readlink through
# java.nio) and the helper that sums a running query's plan metrics in one call (kappa.runtime.late), on every local
# driver's class path (kappa.runtime.spark.forkless_fs). Before the class-data archive: the archive is dumped with
# the class path the drivers run with.
hadoop_step() {
    java_jar hadoop kappa/runtime/java "$JARS/hadoop/kappa-hadoop.jar"
    HADOOP_STATUS="$JAVA_STATUS"
}

# The analysts' SQL service's guards (kappa/front/sql/java: the read-only check rule, the JDBC token check, the Spark
# Connect command filter).
sql_step() {
    java_jar sql kappa/front/sql/java "$JARS/sql/kappa-sql.jar"
    SQL_STATUS="$JAVA_STATUS"
}

# --------------------------------------------------------------------------------------------- lock
lock_step() {
    local lv="$CACHE/lock-venv"
    log "lock: clean install into $lv (pins: pyspark==$SPARK_VERSION delta-spark==$DELTA_VERSION apache-airflow==$AIRFLOW_VERSION apache-airflow-client==$AIRFLOW_CLIENT_VERSION confluent-kafka==$CONFLUENT_KAFKA_VERSION prometheus-client==$PROMETHEUS_CLIENT_VERSION)"
    rm -rf "$lv"
    "$PYTHON" -m venv "$lv"
    # the project itself (+ [test] extra) brings the loose dependency list of pyproject.toml;
    # the exact pins of versions.env are added on the same command line so pip resolves them together.
    "$lv/bin/pip" install "${PIP_FLAGS[@]}" -q -e "$ROOT[test]" \
        "pyspark==$SPARK_VERSION" "delta-spark==$DELTA_VERSION" "apache-airflow==$AIRFLOW_VERSION" \
        "apache-airflow-client==$AIRFLOW_CLIENT_VERSION" "confluent-kafka==$CONFLUENT_KAFKA_VERSION" "prometheus-client==$PROMETHEUS_CLIENT_VERSION"
    "$lv/bin/pip" check || die "lock: dependency conflicts (see above)"
    {
        echo "# Generated by infra/local/bootstrap.sh lock -- do not edit by hand."
        echo "# pip freeze of a clean $PYTHON venv: pyproject.toml dependencies + [test], with the pins of"
        echo "# infra/versions.env (SPARK_VERSION=$SPARK_VERSION DELTA_VERSION=$DELTA_VERSION AIRFLOW_VERSION=$AIRFLOW_VERSION"
        echo "# AIRFLOW_CLIENT_VERSION=$AIRFLOW_CLIENT_VERSION CONFLUENT_KAFKA_VERSION=$CONFLUENT_KAFKA_VERSION PROMETHEUS_CLIENT_VERSION=$PROMETHEUS_CLIENT_VERSION). The kappa package itself is excluded."
        "$lv/bin/pip" freeze --exclude-editable | grep -viE '^kappa( |=|@)'
    } >"$LOCK.tmp"
    mv "$LOCK.tmp" "$LOCK"
    rm -rf "$lv"
    log "lock: wrote requirements.lock ($(grep -cv '^#' "$LOCK") packages)"
}

# --------------------------------------------------------------------------------------------- main
summary() {
    local nb ns sb ss
    nb="$(find "$JARS/broker" -name '*.jar' | wc -l)"; sb="$(du -sh "$JARS/broker" | cut -f1)"
    ns="$(find "$JARS/spark" -name '*.jar' | wc -l)"; ss="$(du -sh "$JARS/spark" | cut -f1)"
    local n3 s3
    n3="$(find "$JARS/s3a" -name '*.jar' | wc -l)"; s3="$(du -sh "$JARS/s3a" | cut -f1)"
    echo "bootstrap: ok in ${SECONDS}s -- venv $("$VENV/bin/python" -c 'import platform; print(platform.python_version())') ($PY_STATUS, $(grep -cv '^#' "$LOCK") pkgs)" \
         "| broker jars: $nb, $sb ($BROKER_STATUS, kafka $KAFKA_VERSION)" \
         "| spark jars: $ns, $ss ($SPARK_STATUS, spark $SPARK_VERSION, delta $DELTA_VERSION)" \
         "| s3a jars: $n3, $s3 ($S3A_STATUS, AWS SDK $AWS_SDK_V2_VERSION)" \
         "| driver class-data archive: $(du -sh "$JARS/cds/spark-driver.jsa" | cut -f1) ($CDS_STATUS)" \
         "| forkless local fs: $HADOOP_STATUS | sql guards: $SQL_STATUS"
}

main() {
    local cmd="${1:-all}"
    load_versions
    mkdir -p "$CACHE"
    case "$cmd" in
        all)    preflight; python_step; jars_step; hadoop_step; cds_step; sql_step; summary ;;
        python) preflight; python_step; echo "bootstrap: python ok ($PY_STATUS) in ${SECONDS}s" ;;
        jars)   preflight; PY_STATUS="n/a"; jars_step; hadoop_step; cds_step; sql_step; summary ;;
        lock)   preflight; lock_step ;;
        check)  preflight; echo "bootstrap: preflight ok (java, mvn, $PYTHON)" ;;
        -h|--help|help) sed -n '2,20p' "$SELF" | sed 's/^# \{0,1\}//' ;;
        *) die "unknown command '$cmd' (all|python|jars|lock|check)" ;;
    esac
}

main "$@"
