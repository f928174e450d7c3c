# syntax=docker/dockerfile:1.7
#
# The analysts' client image: what infra/local/requirements-analyst.lock installs on an analyst's laptop - the Spark
# Connect client without a JVM (pyspark-client), PyHive for the SQL service's JDBC/HiveServer2 endpoint, delta-rs
# and DuckDB for the lake's files - in a container, as the non-root user 10001. Nothing of the platform: no kappa
# package, no JVM, no Spark. The chart runs no pod of it; it is what an analyst's notebook or job pod looks like
# (docs/analysts.md), and the cluster tests query the SQL service's in-cluster address from it
# (tests/cluster/test_platform.py).
#
#   docker build -f infra/images/analyst.Dockerfile -t kappa/analyst:0.1.0 .      (from the repository root)
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py); infra/images/build.sh passes the local
# python base (no registry here).

ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm
ARG PYTHON_IMAGE=python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}

FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY infra/local/requirements-analyst.lock /tmp/requirements-analyst.lock
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/requirements-analyst.lock \
 && /opt/venv/bin/python -c "from pyspark.sql import SparkSession; import pyhive.hive, deltalake, duckdb" \
 && rm /tmp/requirements-analyst.lock
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp
CMD ["python"]
