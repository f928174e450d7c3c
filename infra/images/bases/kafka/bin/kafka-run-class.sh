#!/bin/bash
# Runs a Kafka class with /opt/kafka/libs on the classpath: what Apache Kafka's bin/kafka-run-class.sh does for
# the scripts of this image (infra/images/bases/kafka.Dockerfile; the distribution's scripts are not on Maven
# Central, its jars are).
#   kafka-run-class.sh [-daemon] [-name servicename] [-loggc] classname [opts]
# Environment, as upstream: JAVA_HOME, KAFKA_HEAP_OPTS (default -Xmx256M), KAFKA_JVM_PERFORMANCE_OPTS,
# KAFKA_GC_LOG_OPTS, KAFKA_LOG4J_OPTS (default: config/tools-log4j2.properties, to stderr), KAFKA_OPTS,
# KAFKA_JMX_OPTS + JMX_PORT, LOG_DIR (default /opt/kafka/logs; console output of -daemon and the GC log of -loggc
# go there, and log4j sees it as kafka.logs.dir), CLASSPATH (prepended).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "USAGE: $0 [-daemon] [-name servicename] [-loggc] classname [opts]" >&2
    exit 1
fi

base_dir="$(cd "$(dirname "$0")/.." && pwd)"
CLASSPATH="${CLASSPATH:+$CLASSPATH:}$base_dir/libs/*"
LOG_DIR="${LOG_DIR:-$base_dir/logs}"

daemon_mode=false
daemon_name=""
gc_log=false
while [[ $# -gt 0 ]]; do
    case "$1" in
        -name) daemon_name="$2"; shift 2 ;;
        -loggc) gc_log=true; shift ;;
        -daemon) daemon_mode=true; shift ;;
        *) break ;;
    esac
done

mkdir -p "$LOG_DIR"
KAFKA_LOG4J_OPTS="-Dkafka.logs.dir=$LOG_DIR ${KAFKA_LOG4J_OPTS:--Dlog4j2.configurationFile=$base_dir/config/tools-log4j2.properties}"
KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xmx256M}"
KAFKA_JVM_PERFORMANCE_OPTS="${KAFKA_JVM_PERFORMANCE_OPTS:--server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent -XX:MaxInlineLevel=15 -Djava.awt.headless=true}"
if [[ "$gc_log" == true && -z "${KAFKA_GC_LOG_OPTS:-}" ]]; then
    KAFKA_GC_LOG_OPTS="-Xlog:gc*:file=$LOG_DIR/${daemon_name:-kafka}-gc.log:time,tags:filecount=10,filesize=100M"
fi
if [[ -n "${JMX_PORT:-}" ]]; then
    KAFKA_JMX_OPTS="${KAFKA_JMX_OPTS:--Dcom.sun.management.jmxremote -Dcom.sun.management.jmxremote.authenticate=false -Dcom.sun.management.jmxremote.ssl=false} -Dcom.sun.management.jmxremote.port=$JMX_PORT"
fi
java="${JAVA_HOME:+$JAVA_HOME/bin/}java"

# the *_OPTS are lists of options: split on blanks, as upstream
# shellcheck disable=SC2086
set -- "$java" $KAFKA_HEAP_OPTS $KAFKA_JVM_PERFORMANCE_OPTS ${KAFKA_GC_LOG_OPTS:-} ${KAFKA_JMX_OPTS:-} \
    $KAFKA_LOG4J_OPTS -cp "$CLASSPATH" ${KAFKA_OPTS:-} "$@"
if [[ "$daemon_mode" == true ]]; then
    nohup "$@" >"$LOG_DIR/${daemon_name:-kafka}.out" 2>&1 </dev/null &
else
    exec "$@"
fi
