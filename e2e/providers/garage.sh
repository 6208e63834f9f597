#!/usr/bin/env bash
# A Garage (S3) provider for tests: garage.sh <base_dir> <s3_port>
# Writes <base_dir>/garage.toml (single node, sqlite; RPC on s3_port+1,
# admin API on s3_port+2 with a generated admin_token), starts the server
# and, once it answers, assigns and applies a single-node layout. The
# server stays in the foreground (SIGTERM stops it).
# Administer it with `garage -c <base_dir>/garage.toml ...`.
set -euo pipefail

base=$1
port=$2

garage=$(command -v garage || true)
[ -n "$garage" ] || garage=/var/cache/mesh-ci/garage-2.5.0/bin/garage

mkdir -p "$base/meta" "$base/data"
config=$base/garage.toml
if [ ! -s "$config" ]; then
    umask 077
    cat >"$config" <<TOML
metadata_dir = "$base/meta"
data_dir = "$base/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$((port + 1))"
rpc_public_addr = "127.0.0.1:$((port + 1))"
rpc_secret = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$port"

[admin]
api_bind_addr = "127.0.0.1:$((port + 2))"
admin_token = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
TOML
fi

"$garage" -c "$config" server &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT

(
    for _ in $(seq 1 300); do
        if id=$("$garage" -c "$config" node id -q 2>/dev/null); then
            if "$garage" -c "$config" layout show 2>/dev/null | grep -q "Current cluster layout version: 0"; then
                "$garage" -c "$config" layout assign -z dc1 -c 1G "${id%%@*}" >/dev/null
                "$garage" -c "$config" layout apply --version 1 >/dev/null
            fi
            exit 0
        fi
        sleep 0.2
    done
    echo "garage did not answer" >&2
) &

wait "$server"
