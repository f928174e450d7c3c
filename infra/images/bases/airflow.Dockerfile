# syntax=docker/dockerfile:1.7
#
# Local stand-in for the official apache/airflow:AIRFLOW_VERSION-pythonPYTHON_VERSION image, for machines without a
# container registry (infra/images/build.sh passes it to infra/images/airflow.Dockerfile as AIRFLOW_IMAGE). Built on
# the local python base (bases/python.Dockerfile). Equivalent where the chart and airflow.Dockerfile rely on it:
#   - user airflow, uid 50000, gid 0, HOME=/home/airflow; Airflow installed `pip install --user` into
#     /home/airflow/.local (bin/ on PATH), PIP_USER=true so later `pip install`s go there too;
#   - AIRFLOW_HOME=/opt/airflow (group 0 writable), WORKDIR /opt/airflow, port 8080;
#   - ENTRYPOINT dumb-init + /entrypoint (bases/airflow-entrypoint.sh): runs `airflow ...` (or a bare
#     subcommand, `bash ...`, `python ...`) after the official entrypoint's uid/gid check, umask 0002 and
#     `airflow db check` wait; an arbitrary uid of group 0 gets a passwd entry (/etc/passwd is group-writable, as
#     upstream; not on a read-only root filesystem, where only uid 50000 has a user name, which Airflow needs);
#   - apache-airflow AIRFLOW_VERSION with the providers the chart needs: postgres (psycopg2, the bundled metadata
#     DB) and cncf.kubernetes (the kubernetes client the Kubernetes runner imports).
# Not the official image's: its many other providers and system packages, its constraints file (from GitHub):
# dependencies resolve with requirements.lock as constraints, except the lock's kubernetes client pin, which the
# cncf.kubernetes provider caps below (AIRFLOW_KUBERNETES_CLIENT_VERSION instead).
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py).

ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG PYTHON_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

FROM ${PYTHON_IMAGE}
ARG AIRFLOW_VERSION=3.3.2
ARG AIRFLOW_PROVIDERS_CNCF_KUBERNETES_VERSION=10.25.0
ARG AIRFLOW_PROVIDERS_POSTGRES_VERSION=7.1.1
ARG AIRFLOW_KUBERNETES_CLIENT_VERSION=36.0.3
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends dumb-init; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --uid 50000 --gid 0 --home-dir /home/airflow --create-home --shell /bin/bash airflow; \
    install -d -o airflow -g 0 -m 0775 /opt/airflow /opt/airflow/dags /opt/airflow/logs; \
    chmod 0775 /home/airflow; \
    chmod g=u /etc/passwd
COPY --chmod=0755 infra/images/bases/airflow-entrypoint.sh /entrypoint
ENV AIRFLOW_VERSION=${AIRFLOW_VERSION} \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW_UID=50000 \
    AIRFLOW_USER_HOME_DIR=/home/airflow \
    PATH=/home/airflow/.local/bin:$PATH \
    PIP_USER=true \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DUMB_INIT_SETSID=1
USER 50000:0
WORKDIR /opt/airflow
COPY --chown=50000:0 requirements.lock /home/airflow/requirements.lock
RUN set -eu; \
    grep -viE '^kubernetes==' /home/airflow/requirements.lock >/home/airflow/constraints.txt; \
    rm /home/airflow/requirements.lock; \
    pip install --user --no-cache-dir --constraint /home/airflow/constraints.txt \
        "apache-airflow[postgres,cncf.kubernetes]==${AIRFLOW_VERSION}" \
        "apache-airflow-providers-cncf-kubernetes==${AIRFLOW_PROVIDERS_CNCF_KUBERNETES_VERSION}" \
        "apache-airflow-providers-postgres==${AIRFLOW_PROVIDERS_POSTGRES_VERSION}" \
        "kubernetes==${AIRFLOW_KUBERNETES_CLIENT_VERSION}"; \
    pip check; \
    python -c "import airflow, psycopg2, kubernetes, airflow.providers.cncf.kubernetes, airflow.providers.postgres; assert airflow.__version__ == '${AIRFLOW_VERSION}', airflow.__version__"; \
    airflow version
EXPOSE 8080
ENTRYPOINT ["/usr/bin/dumb-init", "--", "/entrypoint"]
CMD []
