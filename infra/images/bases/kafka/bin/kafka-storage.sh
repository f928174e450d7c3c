#!/bin/bash
# KRaft storage tool (format, info, random-uuid, ...), as Apache Kafka's bin/kafka-storage.sh.
exec "$(dirname "$0")/kafka-run-class.sh" kafka.tools.StorageTool "$@"
