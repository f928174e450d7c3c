#!/bin/bash
# Entrypoint of the view-job image.
#   executor   start a Spark executor: the container Spark-on-Kubernetes creates for a view driver in client
#              mode (Spark passes SPARK_DRIVER_URL, SPARK_EXECUTOR_* and SPARK_JAVA_OPT_<n> in the environment)
#   *          run the given command (kappa view run ..., kappa topics ensure, ...)
set -euo pipefail
# files on a shared lake volume stay writable for the lake group (fsGroup 10001: drivers, executors, Airflow)
umask 0002

if [[ "${1:-}" != "executor" ]]; then
    exec "$@"
fi
shift

# the executor fetches the driver's added jars and files into its working directory: the root filesystem is
# read-only, /tmp is the pod's emptyDir
mkdir -p /tmp/spark-work
cd /tmp/spark-work

# SPARK_JAVA_OPT_0, SPARK_JAVA_OPT_1, ... in numeric order
java_opts=()
while IFS= read -r name; do
    java_opts+=("${!name}")
done < <(compgen -e | grep '^SPARK_JAVA_OPT_' | sort -t_ -k4 -n)

classpath="${SPARK_CONF_DIR:+$SPARK_CONF_DIR:}${SPARK_HOME}/jars/*${SPARK_CLASSPATH:+:$SPARK_CLASSPATH}${SPARK_EXTRA_CLASSPATH:+:$SPARK_EXTRA_CLASSPATH}"

exec "${JAVA_HOME}/bin/java" "${java_opts[@]}" \
    -Xms"${SPARK_EXECUTOR_MEMORY}" -Xmx"${SPARK_EXECUTOR_MEMORY}" \
    -cp "$classpath" \
    org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
    --driver-url "${SPARK_DRIVER_URL}" \
    --executor-id "${SPARK_EXECUTOR_ID}" \
    --cores "${SPARK_EXECUTOR_CORES}" \
    --app-id "${SPARK_APPLICATION_ID}" \
    --hostname "${SPARK_EXECUTOR_POD_IP}" \
    --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID}" \
    --podName "${SPARK_EXECUTOR_POD_NAME}"
