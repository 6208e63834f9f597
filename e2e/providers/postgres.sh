#!/usr/bin/env bash
# A PostgreSQL provider for tests: postgres.sh <data_dir> <port> [listen_addr]
# initdb on first start, then the server in the foreground (this process
# becomes the postmaster: stop it with SIGINT or SIGTERM).
# Local connections over <data_dir>/sock are trusted (the agent administers
# over the socket); TCP connections need a password (scram-sha-256).
set -euo pipefail

data_dir=$1
port=$2
listen=${3:-127.0.0.1}

bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)
pgdata=$data_dir/pgdata
sock=$data_dir/sock

mkdir -p "$data_dir" "$sock"
if [ "$(id -u)" = 0 ]; then
    chown postgres: "$data_dir" "$sock"
fi

if [ ! -s "$pgdata/PG_VERSION" ]; then
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$bin/initdb" -D "$pgdata" -U postgres -A trust --encoding UTF8 --no-instructions >"$data_dir/initdb.log"
    else
        "$bin/initdb" -D "$pgdata" -U postgres -A trust --encoding UTF8 --no-instructions >"$data_dir/initdb.log"
    fi
    cat >"$pgdata/pg_hba.conf" <<HBA
local all all trust
host all all 0.0.0.0/0 scram-sha-256
host all all ::/0 scram-sha-256
HBA
fi

args=(-D "$pgdata" -p "$port" -c "listen_addresses=$listen" -c "unix_socket_directories=$sock"
      -c password_encryption=scram-sha-256)
if [ "$(id -u)" = 0 ]; then
    # setpriv execs (runuser would stay as a parent): this pid is the postmaster.
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$bin/postgres" "${args[@]}"
fi
exec "$bin/postgres" "${args[@]}"
