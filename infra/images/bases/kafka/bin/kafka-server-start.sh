#!/bin/bash
# Starts a Kafka server (broker and/or KRaft controller), as Apache Kafka's bin/kafka-server-start.sh:
#   kafka-server-start.sh [-daemon] server.properties [--override property=value]*
# KAFKA_HEAP_OPTS defaults to -Xmx1G -Xms1G, the log4j2 config to config/log4j2.properties (stdout); the GC log goes
# to $LOG_DIR/kafkaServer-gc.log (EXTRA_ARGS, default "-name kafkaServer -loggc").
if [[ $# -lt 1 ]]; then
    echo "USAGE: $0 [-daemon] server.properties [--override property=value]*" >&2
    exit 1
fi
base_dir="$(dirname "$0")"
export KAFKA_LOG4J_OPTS="${KAFKA_LOG4J_OPTS:--Dlog4j2.configurationFile=$base_dir/../config/log4j2.properties}"
export KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G}"
EXTRA_ARGS="${EXTRA_ARGS-"-name kafkaServer -loggc"}"
if [[ "$1" == "-daemon" ]]; then
    EXTRA_ARGS="-daemon $EXTRA_ARGS"
    shift
fi
# shellcheck disable=SC2086
exec "$base_dir/kafka-run-class.sh" $EXTRA_ARGS kafka.Kafka "$@"
