# syntax=docker/dockerfile:1.7
#
# Local equivalent of the official postgres:POSTGRES_IMAGE_TAG image the chart runs as Airflow's bundled metadata
# database, for machines without a container registry (infra/images/build.sh tags it with the version it really
# has: localhost/kappa/postgres:<major.minor> and :<major>). PostgreSQL POSTGRES_MAJOR from Debian
# POSTGRES_DEBIAN_RELEASE (Debian 13 ships 17; Debian 12 only 15), the server binaries first on PATH
# (/usr/lib/postgresql/<major>/bin: postgres, initdb, pg_ctl, pg_isready, psql).
# The official image's contract as the chart uses it (bases/postgres-entrypoint.sh): POSTGRES_USER, POSTGRES_DB,
# POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE, POSTGRES_INITDB_ARGS, PGDATA (default /var/lib/postgresql/data), an
# empty PGDATA is initialised once (initdb under nss_wrapper for a uid without a passwd entry, the database
# created, /docker-entrypoint-initdb.d run, password logins from any host), then `postgres` runs in the foreground;
# any uid (the chart's 10001 with fsGroup), read-only root with /var/run/postgresql and /tmp writable.
# Differences: the default user is postgres (999) rather than root (a root start still steps down to postgres).
#
# Every ARG default equals infra/versions.env (tests/deploy/test_images.py).

ARG POSTGRES_DEBIAN_RELEASE=trixie
ARG DEBIAN_IMAGE=debian:${POSTGRES_DEBIAN_RELEASE}-slim

FROM ${DEBIAN_IMAGE}
ARG POSTGRES_MAJOR=17
RUN set -eu; \
    groupadd --system --gid 999 postgres; \
    useradd --system --uid 999 --gid 999 --home-dir /var/lib/postgresql --shell /bin/bash postgres; \
    install -d -o postgres -g postgres -m 0755 /var/lib/postgresql; \
    apt-get update; \
    apt-get install -y --no-install-recommends postgresql-common; \
    sed -ri 's/^#?\s*(create_main_cluster)\s*=.*$/\1 = false/' /etc/postgresql-common/createcluster.conf; \
    grep -qx 'create_main_cluster = false' /etc/postgresql-common/createcluster.conf; \
    apt-get install -y --no-install-recommends "postgresql-${POSTGRES_MAJOR}" libnss-wrapper; \
    rm -rf /var/lib/apt/lists/*; \
    sample="/usr/share/postgresql/${POSTGRES_MAJOR}/postgresql.conf.sample"; \
    sed -ri "s!^#?(listen_addresses)\s*=\s*\S+.*!\1 = '*'!" "$sample"; \
    grep -F "listen_addresses = '*'" "$sample"; \
    install -d -o postgres -g postgres -m 3777 /var/run/postgresql; \
    install -d -o postgres -g postgres -m 1777 /var/lib/postgresql/data; \
    test ! -e /etc/postgresql/*/main
# initdb takes the cluster's encoding from the locale: the official image's en_US.utf8 gives UTF8; without LANG
# it would be SQL_ASCII, and Airflow's DAG processor fails to store a DAG doc with a non-ASCII character
ENV LANG=C.UTF-8 \
    PG_MAJOR=${POSTGRES_MAJOR} \
    PATH=/usr/lib/postgresql/${POSTGRES_MAJOR}/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY --chmod=0755 infra/images/bases/postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER 999:999
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["postgres"]
