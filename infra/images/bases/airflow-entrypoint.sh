#!/usr/bin/env bash
# Entrypoint of the local Airflow base image (infra/images/bases/airflow.Dockerfile): what the official
# apache/airflow image's /entrypoint (airflow's scripts/docker/entrypoint_prod.sh) does that the chart relies on.
#   airflow <subcommand> ...   run Airflow (the chart's `args: ["airflow", ...]`)
#   <subcommand> ...           the same: a bare subcommand runs `airflow <subcommand> ...`
#   bash ... | python ...      run bash / python (after the database check, as upstream)
# Before that, as upstream: the gid must be 0 (a warning for uid 50000, an error for any other uid), umask 0002,
# a passwd entry (when /etc/passwd is writable) and HOME=/home/airflow for a uid without one, PYTHONPATH of the
# airflow user's packages for root, and `airflow db check` until it succeeds while CONNECTION_CHECK_MAX_COUNT > 0
# (default 20 tries, 3 s apart).
# Not reproduced: _AIRFLOW_DB_MIGRATE, _AIRFLOW_WWW_USER_CREATE, _PIP_ADDITIONAL_REQUIREMENTS, the Celery broker
# wait, the libstdc++ LD_PRELOAD workaround.
AIRFLOW_COMMAND="${1:-}"
set -euo pipefail

# PIP_USER=true is for building images on this one; PythonVirtualenvOperator's pip must not inherit it
unset PIP_USER

if [[ "$(id -g)" != "0" ]]; then
    if [[ "$(id -u)" == "50000" ]]; then
        echo "WARNING! You should run the image with GID (Group ID) set to 0 (started with UID=$(id -u) GID=$(id -g))" >&2
    else
        echo "ERROR! You should run the image with GID=0 (started with UID=$(id -u) GID=$(id -g))" >&2
        exit 1
    fi
fi

# directories created by this user stay writable for any uid of group 0
umask 0002

CONNECTION_CHECK_MAX_COUNT="${CONNECTION_CHECK_MAX_COUNT:-20}"
CONNECTION_CHECK_SLEEP_TIME="${CONNECTION_CHECK_SLEEP_TIME:-3}"

# an arbitrary uid (OpenShift): a passwd entry when /etc/passwd is writable (group 0), HOME where Airflow is
if ! whoami >/dev/null 2>&1; then
    if [[ -w /etc/passwd ]]; then
        echo "${USER_NAME:-default}:x:$(id -u):0:${USER_NAME:-default} user:${AIRFLOW_USER_HOME_DIR}:/sbin/nologin" >>/etc/passwd
    fi
    export HOME="${AIRFLOW_USER_HOME_DIR}"
fi
if [[ "$(id -u)" == "0" ]]; then
    python_minor="$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    export PYTHONPATH="${AIRFLOW_USER_HOME_DIR}/.local/lib/python${python_minor}/site-packages:${PYTHONPATH:-}"
    echo "The container is run as root user. For security, consider using a regular user account." >&2
fi

if [[ "${CONNECTION_CHECK_MAX_COUNT}" -gt 0 ]]; then
    countdown="${CONNECTION_CHECK_MAX_COUNT}"
    while ! last_check="$(airflow db check 2>&1)"; do
        countdown=$((countdown - 1))
        if [[ "${countdown}" -le 0 ]]; then
            echo "ERROR! Maximum number of retries (${CONNECTION_CHECK_MAX_COUNT}) reached." >&2
            echo "Last check result:" >&2
            echo "\$ airflow db check" >&2
            echo "${last_check}" >&2
            exit 1
        fi
        echo -n "." >&2
        sleep "${CONNECTION_CHECK_SLEEP_TIME}"
    done
fi

case "${AIRFLOW_COMMAND}" in
    bash) shift; exec /bin/bash "$@" ;;
    python) shift; exec python "$@" ;;
    airflow) shift ;;
esac
exec airflow "$@"
