# syntax=docker/dockerfile:1.7
#
# Local stand-in for the official python:PYTHON_VERSION-slim-DEBIAN_RELEASE image, for machines without a container
# registry (infra/images/build.sh passes it to view-job.Dockerfile as PYTHON_IMAGE). What the project relies on is
# the same: `python`, `python3` and `pip` on PATH in /usr/local/bin, `python -m venv` (with pip), Python
# PYTHON_VERSION on Debian DEBIAN_RELEASE. What differs: the interpreter is Debian's python3.11 package (Debian 12:
# 3.11.2) instead of a CPython built from source (newest 3.11.x) - the same interpreter `make setup` uses on a
# Debian host -, pip is Debian's (23.0.1), and ENV PYTHON_VERSION is not set.
#
#   podman build -f infra/images/bases/python.Dockerfile --build-arg DEBIAN_IMAGE=localhost/kappa-base/debian:bookworm .
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py).

ARG DEBIAN_RELEASE=bookworm
ARG DEBIAN_IMAGE=debian:${DEBIAN_RELEASE}-slim

FROM ${DEBIAN_IMAGE}
ARG PYTHON_VERSION=3.11
ENV LANG=C.UTF-8
# Debian marks its Python "externally managed" (PEP 668): pip would refuse `pip install` / `pip install --user`
# outside a venv, which the official image (and the Airflow image built on this one) relies on.
RUN set -eu; \
    apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" python3-pip; \
    rm -rf /var/lib/apt/lists/*; \
    rm -f "/usr/lib/python${PYTHON_VERSION}/EXTERNALLY-MANAGED"; \
    for name in python python3 "python${PYTHON_VERSION}"; do ln -sf "/usr/bin/python${PYTHON_VERSION}" "/usr/local/bin/$name"; done; \
    for name in pip pip3 "pip${PYTHON_VERSION}"; do ln -sf /usr/bin/pip3 "/usr/local/bin/$name"; done; \
    python -c "import sys, venv, ensurepip; assert sys.version.startswith('${PYTHON_VERSION}.'), sys.version"; \
    pip --version
CMD ["python3"]
