# syntax=docker/dockerfile:1.7
#
# Airflow image of the platform: the official apache/airflow image (AIRFLOW_VERSION, Python PYTHON_VERSION) with
# the project's DAGs (dags/, the AIRFLOW__CORE__DAGS_FOLDER the chart sets) and the kappa package installed
# from /opt/kappa, resolved against requirements.lock. Runs as the image's non-root user airflow (50000).
# The verify task recomputes a view version with Spark (kappa.recompute): a Java 17 runtime from Debian and the
# Spark jars of the view-job image of the same project version (KAPPA_VERSION, built first) come with it.
#
#   docker build -f infra/images/airflow.Dockerfile -t kappa/airflow:0.1.0 .        (from the repository root)
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py); the base image and the view-job image
# the jars come from are build args too (AIRFLOW_IMAGE, VIEW_JOB_IMAGE): without a registry, infra/images/build.sh
# (`make images`) passes a local equivalent of the official image (infra/images/bases/airflow.Dockerfile) and
# localhost/kappa/view-job:KAPPA_VERSION.

ARG AIRFLOW_VERSION=3.3.2
ARG PYTHON_VERSION=3.11
ARG KAPPA_VERSION=0.1.0
ARG AIRFLOW_IMAGE=apache/airflow:${AIRFLOW_VERSION}-python${PYTHON_VERSION}
ARG VIEW_JOB_IMAGE=kappa/view-job:${KAPPA_VERSION}

FROM ${VIEW_JOB_IMAGE} AS viewjob

FROM ${AIRFLOW_IMAGE}
ARG AIRFLOW_VERSION=3.3.2

USER root
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java; \
    install -d -o airflow -g 0 -m 0775 /opt/kappa
USER airflow
WORKDIR /opt/kappa
# Layers in the order they change, each cached by its content: the JDK above, the dependencies (the lock and the
# packaging metadata), the Spark jars; the project's code comes last, so a change under kappa/ or jobs/ rebuilds only
# its thin layers. Airflow stays at AIRFLOW_VERSION; everything else resolves to the project's tested versions (the
# lock as constraints). The kubernetes client for the Kubernetes runner comes with the image's cncf.kubernetes
# provider. The editable install needs the packaging metadata only: its finder maps the top-level packages (kappa,
# jobs) to /opt/kappa, whatever they hold later.
COPY --chown=airflow:0 pyproject.toml requirements.lock ./
RUN mkdir kappa jobs && touch kappa/__init__.py jobs/__init__.py \
 && pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" --constraint requirements.lock -e /opt/kappa \
 && rm -rf kappa jobs
COPY --from=viewjob --chown=airflow:0 /opt/kappa/.cache/jars/spark/ .cache/jars/spark/
COPY --chown=airflow:0 infra/versions.env infra/versions.env
COPY --chown=airflow:0 schemas/ schemas/
COPY --chown=airflow:0 dags/ dags/
COPY --chown=airflow:0 jobs/ jobs/
COPY --chown=airflow:0 kappa/ kappa/
RUN PYTHONDONTWRITEBYTECODE=1 python -c "import airflow, kappa.control.runners.kubernetes, kubernetes; assert airflow.__version__ == '${AIRFLOW_VERSION}', airflow.__version__"
ENV KAPPA_REPO_ROOT=/opt/kappa \
    JAVA_HOME=/opt/java \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/kappa/dags \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    PYTHONDONTWRITEBYTECODE=1
USER 50000
