# syntax=docker/dockerfile:1.7
#
# Local stand-in for the official maven:MAVEN_IMAGE_TAG image (Maven + a JDK 17), for machines without a container
# registry: view-job.Dockerfile's and kafka.Dockerfile's jar-fetching stages run `mvn` in it (MAVEN_IMAGE).
# Debian's packages: maven (Debian 12: 3.8.7, not the official image's 3.9.x) and openjdk-17-jdk-headless (not
# Eclipse Temurin); infra/images/build.sh tags it with the versions it really has
# (localhost/kappa-base/maven:<maven>-openjdk-<java>-<release>). Same paths as the official image where it matters:
# mvn on PATH, JAVA_HOME=/opt/java/openjdk, the local repository in /root/.m2, running as root.
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py).

ARG DEBIAN_RELEASE=bookworm
ARG DEBIAN_IMAGE=debian:${DEBIAN_RELEASE}-slim

FROM ${DEBIAN_IMAGE}
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates openjdk-17-jdk-headless maven; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /opt/java; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v javac)")")")" /opt/java/openjdk; \
    mvn -v
# (no MAVEN_CONFIG: Maven's own mvn script passes its value as command-line arguments)
ENV JAVA_HOME=/opt/java/openjdk \
    MAVEN_HOME=/usr/share/maven
CMD ["mvn"]
