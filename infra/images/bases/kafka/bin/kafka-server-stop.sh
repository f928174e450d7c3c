#!/bin/bash
# Stops the Kafka server(s) of this container with SIGTERM (controlled shutdown), as Apache Kafka's script.
pids="$(for p in /proc/[0-9]*; do tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q 'kafka\.Kafka ' && echo "${p#/proc/}"; done)"
if [[ -z "$pids" ]]; then
    echo "No kafka server to stop" >&2
    exit 1
fi
# shellcheck disable=SC2086
kill -s TERM $pids
