# syntax=docker/dockerfile:1.7
#
# View-job image: PySpark from pip (SPARK_VERSION) + the Kafka connector and Delta Lake jars fetched by Maven at
# pinned versions (no spark.jars.packages at run time) + hadoop-aws for s3a + the kappa package, running as the
# non-root user 10001. Used by the view drivers, the Spark executors (entrypoint `executor`) and the topics Job.
#
#   docker build -f infra/images/view-job.Dockerfile -t kappa/view-job:0.1.0 .      (from the repository root)
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py); the base images are build args too
# (PYTHON_IMAGE, MAVEN_IMAGE), defaulting to the official images: without a registry, infra/images/build.sh
# (`make images`) builds local equivalents from infra/images/bases/ and passes them. Layout: the repository at
# /opt/kappa (KAPPA_REPO_ROOT), the package installed editable from there (so kappa/platform.yaml is
# /opt/kappa/kappa/platform.yaml, where the chart's topics Job mounts its ConfigMap), jars in
# /opt/kappa/.cache/jars/spark (what kappa.runtime.spark.spark_jars() reads), the drivers' class-data sharing
# archive (kappa/runtime/cds.py: every driver JVM starts seconds faster) in /opt/kappa/.cache/jars/cds.

ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG MAVEN_IMAGE_TAG=3.9.11-eclipse-temurin-17
ARG PYTHON_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}
ARG MAVEN_IMAGE=maven:${MAVEN_IMAGE_TAG}

# --------------------------------------------------------------------------------------------- python
FROM ${PYTHON_IMAGE} AS python
ARG SPARK_VERSION=4.2.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements.lock /tmp/requirements.lock
# the exact, tested dependency set of the project (pyspark, delta-spark, confluent-kafka, ...)
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/requirements.lock \
 && /opt/venv/bin/python -c "import pyspark, sys; sys.exit(0 if pyspark.__version__ == '${SPARK_VERSION}' else 'pyspark ' + pyspark.__version__ + ' != SPARK_VERSION ${SPARK_VERSION}')"

# --------------------------------------------------------------------------------------------- jars
FROM ${MAVEN_IMAGE} AS jars
ARG PYTHON_VERSION=3.11
ARG SCALA_BINARY=2.13
ARG SPARK_VERSION=4.2.0
ARG DELTA_VERSION=4.4.0
ARG DELTA_SPARK_ARTIFACT=delta-spark_4.2_2.13
ARG KAFKA_VERSION=4.4.0
ARG LOG4J2_VERSION=2.24.3
ARG MAVEN_DEPENDENCY_PLUGIN_VERSION=3.8.1
ARG SPARK_KAFKA_TOKEN_PROVIDER_VERSION=4.2.0
ARG AWS_SDK_V2_VERSION=2.35.4
COPY infra/local/pom.xml /build/pom.xml
COPY infra/local/maven-settings.xml /build/maven-settings.xml
COPY --from=python /opt/venv/lib/python${PYTHON_VERSION}/site-packages/pyspark/jars /pyspark-jars
# Only what pyspark does not ship: every artifactId prefix of pyspark/jars is excluded (same rule as
# infra/local/bootstrap.sh), so no library lands on the classpath twice in two versions. Hadoop and Jackson
# versions are the ones pyspark ships (also as in bootstrap.sh). infra/local/maven-settings.xml mirrors every
# repository a POM declares to Maven Central (Spark's parent POM lists a GCS mirror first, unreachable from many
# networks). The local repository is a build cache mount: a rebuild downloads nothing it fetched before.
# kafka-clients comes in the version spark-sql-kafka declares (what `make setup` resolves), not the broker's.
RUN --mount=type=cache,target=/root/.m2 set -eu; \
    excludes="$(find /pyspark-jars -maxdepth 1 -name '*.jar' -printf '%f\n' | sed 's/\.jar$//' | awk '{ \
        s = $0; pre = ""; \
        while ((i = match(s, /-[0-9]/)) > 0) { pre = pre substr(s, 1, i - 1); print pre; \
                                               pre = pre substr(s, i, 2); s = substr(s, i + 2) } }' \
        | sort -u | paste -sd, -)"; \
    hadoop="$(find /pyspark-jars -maxdepth 1 -name 'hadoop-client-api-*.jar' -printf '%f\n' | sed 's/^hadoop-client-api-\(.*\)\.jar$/\1/')"; \
    jackson="$(find /pyspark-jars -maxdepth 1 -name 'jackson-databind-*.jar' -printf '%f\n' | sed 's/^jackson-databind-\(.*\)\.jar$/\1/')"; \
    test -n "$hadoop" && test -n "$jackson"; \
    mvn -B -q -s /build/maven-settings.xml -f /build/pom.xml -P spark \
        -Dscala.binary="${SCALA_BINARY}" -Dspark.version="${SPARK_VERSION}" -Dkafka.version="${KAFKA_VERSION}" \
        -Ddelta.version="${DELTA_VERSION}" -Ddelta.artifact="${DELTA_SPARK_ARTIFACT}" \
        -Dlog4j2.version="${LOG4J2_VERSION}" -Dspark.token.provider.version="${SPARK_KAFKA_TOKEN_PROVIDER_VERSION}" \
        -Djackson.version="$jackson" \
        -Dmaven.dependency.plugin.version="${MAVEN_DEPENDENCY_PLUGIN_VERSION}" \
        -DexcludeArtifactIds="$excludes" -DoutputDirectory=/jars dependency:copy-dependencies; \
    mvn -B -q -s /build/maven-settings.xml -f /build/pom.xml -P s3a -Dhadoop.version="$hadoop" \
        -Dawssdk.version="${AWS_SDK_V2_VERSION}" -Dmaven.dependency.plugin.version="${MAVEN_DEPENDENCY_PLUGIN_VERSION}" \
        -DexcludeArtifactIds="$excludes" -DoutputDirectory=/jars dependency:copy-dependencies; \
    for jar in "spark-sql-kafka-0-10_${SCALA_BINARY}-${SPARK_VERSION}.jar" "${DELTA_SPARK_ARTIFACT}-${DELTA_VERSION}.jar" \
               "delta-storage-${DELTA_VERSION}.jar" "hadoop-aws-$hadoop.jar"; do \
        test -f "/jars/$jar" || { echo "missing /jars/$jar" >&2; exit 1; }; \
    done; \
    ls /jars/kafka-clients-*.jar; \
    ls /jars

# --------------------------------------------------------------------------------------------- hadoop
# Hadoop's local file system without a process per file operation (kappa/runtime/java: chmod and readlink through
# java.nio; kappa.runtime.spark.forkless_fs) and the plan-metrics helper (kappa.runtime.late), compiled as `make
# setup` compiles them (bootstrap.sh, hadoop_step). The
# drivers' class-data archive below is dumped with it on the class path, as the drivers run.
FROM ${MAVEN_IMAGE} AS hadoop
ARG PYTHON_VERSION=3.11
COPY --from=python /opt/venv/lib/python${PYTHON_VERSION}/site-packages/pyspark/jars /pyspark-jars
COPY kappa/runtime/java /build/hadoop-java
RUN set -eu; \
    mkdir -p /build/hadoop-classes /hadoop; \
    javac -nowarn --release 17 -d /build/hadoop-classes -cp "/pyspark-jars/*" $(find /build/hadoop-java -name '*.java' | sort); \
    jar cf /hadoop/kappa-hadoop.jar -C /build/hadoop-classes kappa; \
    jar tf /hadoop/kappa-hadoop.jar | grep -qx 'kappa/hadoop/ForklessLocalFileSystem.class'; \
    jar tf /hadoop/kappa-hadoop.jar | grep -qx 'kappa/spark/PlanMetrics.class'

# --------------------------------------------------------------------------------------------- sql
# The SQL service's guards (kappa/front/sql/java: the read-only check rule, the JDBC token check, the Spark Connect
# request filter), compiled with the Maven image's JDK against the jars of this image's own pyspark, as `make setup`
# compiles them (infra/local/bootstrap.sh, sql_step): `kappa sql serve` refuses to start without them. A stage of
# its own, so a change to the Java sources leaves the Maven stage's downloads cached.
FROM ${MAVEN_IMAGE} AS sql
ARG PYTHON_VERSION=3.11
COPY --from=python /opt/venv/lib/python${PYTHON_VERSION}/site-packages/pyspark/jars /pyspark-jars
COPY kappa/front/sql/java /build/sql-java
RUN set -eu; \
    mkdir -p /build/sql-classes /sql; \
    javac -nowarn --release 17 -d /build/sql-classes -cp "/pyspark-jars/*" $(find /build/sql-java -name '*.java' | sort); \
    jar cf /sql/kappa-sql.jar -C /build/sql-classes kappa; \
    jar tf /sql/kappa-sql.jar | grep -qx 'kappa/sql/ReadOnly.class'

# --------------------------------------------------------------------------------------------- runtime
# Layers in the order they change, each cached by its content: the JDK, the virtual environment (requirements.lock),
# the jars (the pins above), the drivers' class-data archive (the JDK and the jars), the editable install (the
# packaging metadata); the project's code comes last, so a change under kappa/ or jobs/ rebuilds only its thin layers.
FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Spark 4.1 runs on Java 17/21; tini reaps the JVM/Python workers; procps for Spark's scripts
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless tini procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java; \
    groupadd --gid 10001 kappa; \
    useradd --uid 10001 --gid 10001 --home-dir /home/kappa --create-home --shell /usr/sbin/nologin kappa
COPY --from=python /opt/venv /opt/venv
RUN ln -s "$(/opt/venv/bin/python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')" /opt/spark
WORKDIR /opt/kappa
COPY --from=jars /jars/ .cache/jars/spark/
# where kappa.runtime.spark.forkless_fs looks (<repo>/.cache/jars/hadoop/kappa-hadoop.jar), before the archive
COPY --from=hadoop /hadoop/kappa-hadoop.jar .cache/jars/hadoop/kappa-hadoop.jar
# The class-data archive maps the classes of the JVM and the jars above (a JVM checks them), not the project's code:
# it is dumped by the few modules kappa.runtime.cds imports, copied alone, so a code change elsewhere keeps it.
COPY kappa/__init__.py kappa/errors.py kappa/config.py kappa/process.py /tmp/cds/kappa/
COPY kappa/runtime/__init__.py kappa/runtime/cds.py kappa/runtime/spark.py kappa/runtime/log4j2-file.properties /tmp/cds/kappa/runtime/
RUN cd /tmp/cds \
 && KAPPA_REPO_ROOT=/opt/kappa PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -m kappa.runtime.cds \
 && rm -rf /tmp/cds
# The editable install needs the packaging metadata only: its finder maps the top-level packages (kappa, jobs) to
# /opt/kappa, whatever they hold later; the console script `kappa` comes with it.
COPY pyproject.toml ./
RUN mkdir kappa jobs && touch kappa/__init__.py jobs/__init__.py \
 && /opt/venv/bin/pip install --no-deps -e /opt/kappa \
 && rm -rf kappa jobs
# the project itself: the thin layers
COPY infra/versions.env infra/versions.env
COPY schemas/ schemas/
COPY dags/ dags/
COPY jobs/ jobs/
COPY kappa/ kappa/
# the SQL service's guards: where kappa.front.sql.server.jar_path() looks (<repo>/.cache/jars/sql/kappa-sql.jar)
COPY --from=sql /sql/kappa-sql.jar .cache/jars/sql/kappa-sql.jar
COPY --chmod=0755 infra/images/spark-entrypoint.sh /opt/kappa/bin/entrypoint.sh
RUN PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -c "import kappa.catalog as c, pathlib; assert c.PLATFORM_FILE == pathlib.Path('/opt/kappa/kappa/platform.yaml'), c.PLATFORM_FILE" \
 && PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/kappa --help >/dev/null \
 && test -s /opt/kappa/.cache/jars/cds/spark-driver.jsa \
 && KAPPA_REPO_ROOT=/opt/kappa PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -c "from kappa.config import Settings; from kappa.runtime.spark import forkless_fs; assert forkless_fs(Settings.from_env(), 'local[2]')" \
 && KAPPA_REPO_ROOT=/opt/kappa PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python -c "from kappa.config import Settings; from kappa.front.sql.server import jar_path; p = jar_path(Settings.from_env()); assert p.is_file(), p"
# SPARK_HOME is the pip-installed pyspark, through the /opt/spark link (not a path spelled with PYTHON_VERSION:
# the official python image sets ENV PYTHON_VERSION=3.11.x, which buildah lets win over this stage's ARG)
ENV PATH=/opt/venv/bin:$PATH \
    JAVA_HOME=/opt/java \
    SPARK_HOME=/opt/spark \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python \
    KAPPA_REPO_ROOT=/opt/kappa \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 9400 4040
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/kappa/bin/entrypoint.sh"]
CMD ["kappa", "--help"]
