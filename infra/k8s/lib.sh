# Shared by infra/k8s/cluster.sh and infra/k8s/node.sh (sourced): background processes with pid files and logs,
# waits, certificates signed by the cluster CA. The caller sets RUN (pid files), LOGS, PKI and defines log/die.

alive() { [[ -f "$RUN/$1.pid" ]] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

start() {  # start <name> <binary> [args...]: a background process with a pid file and a log
    local name="$1"; shift
    if alive "$name"; then return 0; fi
    setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
    echo $! > "$RUN/$name.pid"
}

stop() {  # stop <name>: TERM its process group, KILL after 10 s
    local name="$1" pid
    if alive "$name"; then
        pid="$(cat "$RUN/$name.pid")"
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do alive "$name" || break; sleep 0.2; done
        if alive "$name"; then kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; fi
        log "stopped $name"
    fi
    rm -f "$RUN/$name.pid"
}

wait_for() {  # wait_for <what> <seconds> <command...>
    local what="$1" limit="$2"; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || die "$what not ready after ${limit} s (logs in $LOGS)"
        sleep 1
    done
}

sign() {  # sign <name> <subject> [extfile]: a key and a certificate signed by the cluster CA, in $PKI
    ( cd "$PKI"
      openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 3650 \
          ${3:+-extfile "$3"} 2>/dev/null )
}
