# syntax=docker/dockerfile:1.7
#
# Local equivalent of the official apache/kafka:KAFKA_IMAGE_TAG image the chart's KRaft StatefulSet runs, for
# machines without a container registry (infra/images/build.sh: localhost/kappa/kafka:KAFKA_IMAGE_TAG). Apache
# Kafka KAFKA_VERSION from Maven Central (kafka_SCALA_BINARY: infra/local/pom.xml's broker profile, the same jars
# `make setup` runs the local broker from, plus the kafka-tools jars) in /opt/kafka/libs, Java 17 from Debian.
# /opt/kafka/bin holds what the chart's start.sh calls - kafka-storage.sh, kafka-server-start.sh - and the usual
# tools (kafka-topics.sh, kafka-console-producer.sh, ...): small scripts over kafka-run-class.sh honouring
# KAFKA_HEAP_OPTS, KAFKA_OPTS, LOG_DIR (logs, GC log) as Apache's do (the distribution's scripts are not on Maven
# Central). The broker logs to stdout (config/log4j2.properties), the tools to stderr. Runs as uid 10001 (the
# chart's; the official image's user is 1000) with a read-only root filesystem: it writes only under LOG_DIR, its
# log.dirs and /tmp.
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py).

ARG DEBIAN_RELEASE=bookworm
ARG MAVEN_IMAGE_TAG=3.9.11-eclipse-temurin-17
ARG DEBIAN_IMAGE=debian:${DEBIAN_RELEASE}-slim
ARG MAVEN_IMAGE=maven:${MAVEN_IMAGE_TAG}

# --------------------------------------------------------------------------------------------- jars
FROM ${MAVEN_IMAGE} AS jars
ARG SCALA_BINARY=2.13
ARG KAFKA_VERSION=4.4.0
ARG LOG4J2_VERSION=2.24.3
ARG MAVEN_DEPENDENCY_PLUGIN_VERSION=3.8.1
COPY infra/local/pom.xml /build/pom.xml
COPY infra/local/maven-settings.xml /build/maven-settings.xml
COPY infra/images/bases/kafka-tools.pom.xml /build/kafka-tools.pom.xml
RUN --mount=type=cache,target=/root/.m2 set -eu; \
    mvn -B -q -s /build/maven-settings.xml -f /build/pom.xml -P broker \
        -Dscala.binary="${SCALA_BINARY}" -Dkafka.version="${KAFKA_VERSION}" -Dlog4j2.version="${LOG4J2_VERSION}" \
        -Dmaven.dependency.plugin.version="${MAVEN_DEPENDENCY_PLUGIN_VERSION}" \
        -DoutputDirectory=/jars dependency:copy-dependencies; \
    excludes="$(find /jars -maxdepth 1 -name '*.jar' -printf '%f\n' | sed 's/-[0-9][^-]*\(-[^-]*\)\{0,1\}\.jar$//' | sort -u | paste -sd, -)"; \
    mvn -B -q -s /build/maven-settings.xml -f /build/kafka-tools.pom.xml -Dkafka.version="${KAFKA_VERSION}" \
        -Dmaven.dependency.plugin.version="${MAVEN_DEPENDENCY_PLUGIN_VERSION}" \
        -DexcludeArtifactIds="$excludes" -DoutputDirectory=/jars dependency:copy-dependencies; \
    for jar in "kafka_${SCALA_BINARY}-${KAFKA_VERSION}.jar" "kafka-tools-${KAFKA_VERSION}.jar" \
               "kafka-clients-${KAFKA_VERSION}.jar" "log4j-core-${LOG4J2_VERSION}.jar"; do \
        test -f "/jars/$jar" || { echo "missing /jars/$jar" >&2; exit 1; }; \
    done; \
    dups="$(find /jars -maxdepth 1 -name '*.jar' -printf '%f\n' | sed 's/-[0-9][^-]*\(-[^-]*\)\{0,1\}\.jar$//' | sort | uniq -d)"; \
    test -z "$dups" || { echo "jars in two versions: $dups" >&2; exit 1; }

# --------------------------------------------------------------------------------------------- runtime
FROM ${DEBIAN_IMAGE}
ARG KAFKA_VERSION=4.4.0
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /opt/java; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java/openjdk; \
    groupadd --gid 10001 kafka; \
    useradd --uid 10001 --gid 10001 --home-dir /opt/kafka --no-create-home --shell /usr/sbin/nologin kafka; \
    install -d -o 10001 -g 10001 -m 0775 /var/lib/kafka /var/lib/kafka/data /opt/kafka /opt/kafka/logs
COPY --from=jars /jars/ /opt/kafka/libs/
COPY --chmod=0755 infra/images/bases/kafka/bin/ /opt/kafka/bin/
COPY infra/images/bases/kafka/config/ /opt/kafka/config/
# one thin script per tool class, as in Apache's bin/ (the image tests run each of them)
RUN set -eu; \
    for pair in \
        kafka-topics.sh=org.apache.kafka.tools.TopicCommand \
        kafka-console-producer.sh=org.apache.kafka.tools.ConsoleProducer \
        kafka-console-consumer.sh=org.apache.kafka.tools.consumer.ConsoleConsumer \
        kafka-consumer-groups.sh=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand \
        kafka-metadata-quorum.sh=org.apache.kafka.tools.MetadataQuorumCommand \
        kafka-broker-api-versions.sh=org.apache.kafka.tools.BrokerApiVersionsCommand \
        kafka-get-offsets.sh=org.apache.kafka.tools.GetOffsetShell \
        kafka-features.sh=org.apache.kafka.tools.FeatureCommand; do \
        printf '#!/bin/bash\nexec "$(dirname "$0")/kafka-run-class.sh" %s "$@"\n' "${pair#*=}" >"/opt/kafka/bin/${pair%%=*}"; \
        chmod 0755 "/opt/kafka/bin/${pair%%=*}"; \
    done
ENV JAVA_HOME=/opt/java/openjdk \
    PATH=/opt/kafka/bin:/opt/java/openjdk/bin:$PATH \
    KAFKA_VERSION=${KAFKA_VERSION}
WORKDIR /opt/kafka
USER 10001:10001
EXPOSE 9092 9093
CMD ["/opt/kafka/bin/kafka-server-start.sh", "--version"]
