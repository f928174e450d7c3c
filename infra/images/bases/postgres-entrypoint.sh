#!/usr/bin/env bash
# Entrypoint of the local PostgreSQL image (infra/images/bases/postgres.Dockerfile): the official postgres image's
# docker-entrypoint.sh contract, as far as the chart's StatefulSet relies on it.
#   postgres [options]   (the default) initialise an empty PGDATA once, then run the server in the foreground
#   -<option> ...        the same with server options (`postgres` implied)
#   anything else        run it
# Environment: POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE (required unless POSTGRES_HOST_AUTH_METHOD=trust),
# POSTGRES_USER (default postgres), POSTGRES_DB (default POSTGRES_USER), POSTGRES_INITDB_ARGS,
# POSTGRES_HOST_AUTH_METHOD (default scram-sha-256: the pg_hba.conf line for remote hosts), PGDATA. A uid without a
# passwd entry (the chart's 10001) gets one from nss_wrapper for initdb; started as root, it steps down to postgres.
set -Eeuo pipefail

# file_env VAR [default]: VAR from the environment or from the file named by VAR_FILE (not both)
file_env() {
    local var="$1" file_var="${1}_FILE" def="${2:-}" val
    if [[ -n "${!var:-}" && -n "${!file_var:-}" ]]; then
        echo "error: both $var and $file_var are set (but are exclusive)" >&2
        exit 1
    fi
    val="$def"
    if [[ -n "${!var:-}" ]]; then
        val="${!var}"
    elif [[ -n "${!file_var:-}" ]]; then
        val="$(<"${!file_var}")"
    fi
    export "$var"="$val"
    unset "$file_var"
}

if [[ "${1:0:1}" == "-" ]]; then
    set -- postgres "$@"
fi

if [[ "$1" != "postgres" ]]; then
    exec "$@"
fi

if [[ "$(id -u)" == "0" ]]; then
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 0700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "${BASH_SOURCE[0]}" "$@"
fi

if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
    file_env POSTGRES_PASSWORD
    file_env POSTGRES_USER postgres
    file_env POSTGRES_DB "$POSTGRES_USER"
    file_env POSTGRES_INITDB_ARGS
    : "${POSTGRES_HOST_AUTH_METHOD:=scram-sha-256}"
    if [[ -z "$POSTGRES_PASSWORD" && "$POSTGRES_HOST_AUTH_METHOD" != "trust" ]]; then
        echo "error: database is uninitialized and superuser password is not specified." >&2
        echo "       Set POSTGRES_PASSWORD (or POSTGRES_PASSWORD_FILE), or POSTGRES_HOST_AUTH_METHOD=trust." >&2
        exit 1
    fi
    mkdir -p "$PGDATA"
    chmod 0700 "$PGDATA" 2>/dev/null || :

    # initdb needs the current uid in the passwd database
    if ! getent passwd "$(id -u)" >/dev/null; then
        wrapper=""
        for candidate in /usr/lib/*/libnss_wrapper.so /usr/lib/libnss_wrapper.so; do
            if [[ -s "$candidate" ]]; then wrapper="$candidate"; break; fi
        done
        if [[ -n "$wrapper" ]]; then
            NSS_WRAPPER_PASSWD="$(mktemp)"
            NSS_WRAPPER_GROUP="$(mktemp)"
            export LD_PRELOAD="$wrapper" NSS_WRAPPER_PASSWD NSS_WRAPPER_GROUP
            echo "postgres:x:$(id -u):$(id -g):PostgreSQL:$PGDATA:/bin/false" >"$NSS_WRAPPER_PASSWD"
            echo "postgres:x:$(id -g):" >"$NSS_WRAPPER_GROUP"
        fi
    fi
    # shellcheck disable=SC2086
    initdb --username="$POSTGRES_USER" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") $POSTGRES_INITDB_ARGS
    if [[ -n "${LD_PRELOAD:-}" ]]; then
        rm -f "$NSS_WRAPPER_PASSWD" "$NSS_WRAPPER_GROUP"
        unset LD_PRELOAD NSS_WRAPPER_PASSWD NSS_WRAPPER_GROUP
    fi
    printf '\nhost all all all %s\n' "$POSTGRES_HOST_AUTH_METHOD" >>"$PGDATA/pg_hba.conf"

    # a server on the unix socket only, to create the database and run the init scripts
    PGUSER="$POSTGRES_USER" PGPASSWORD="$POSTGRES_PASSWORD" \
        pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p ${PGPORT:-5432}" -w start
    export PGPASSWORD="$POSTGRES_PASSWORD"
    psql=(psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --no-password --no-psqlrc --dbname postgres)
    if [[ "$POSTGRES_DB" != "postgres" ]]; then
        "${psql[@]}" --set db="$POSTGRES_DB" <<<'CREATE DATABASE :"db";'
    fi
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sh) echo "running $f"; if [[ -x "$f" ]]; then "$f"; else . "$f"; fi ;;
            *.sql) echo "running $f"; "${psql[@]}" --dbname "$POSTGRES_DB" -f "$f" ;;
            *.sql.gz) echo "running $f"; gunzip -c "$f" | "${psql[@]}" --dbname "$POSTGRES_DB" ;;
            *) if [[ -e "$f" ]]; then echo "ignoring $f"; fi ;;
        esac
    done
    pg_ctl -D "$PGDATA" -m fast -w stop
    unset PGPASSWORD
    echo "PostgreSQL init process complete; ready for start up."
fi

exec "$@"
