#!/usr/bin/env bash
# A Garage (S3) provider for tests: garage.sh <base_dir> <s3_port> [s3_listen_addr]
# Writes <base_dir>/garage.toml (single node, sqlite; RPC on s3_port+1,
# admin API on s3_port+2 with a generated admin_token, both on loopback;
# the S3 API on s3_listen_addr, default 127.0.0.1), starts the server
# and, once it answers, assigns and applies a single-node layout. The
# server stays in the foreground (SIGTERM stops it).
# Administer it with `garage -c <base_dir>/garage.toml ...`.
set -euo pipefail

base=$1
port=$2
listen=${3:-127.0.0.1}

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
api_bind_addr = "$listen:$port"

[admin]
api_bind_addr = "127.0.0.1:$((port + 2))"
admin_token = "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
TOML
fi

"$garage" -c "$config" server &
server=$!
trap 'kill -TERM "$server" 2>/dev/null || true' TERM INT

# Apply the one-node layout, bounded (600 × 0.2 s): keep asking until the
# server answers with a layout, then assign and apply version 1 if it still
# has version 0. A first `layout show` that answers neither (the server still
# starting) is asked again, never taken as done.
(
    for _ in $(seq 1 600); do
        if id=$("$garage" -c "$config" node id -q 2>/dev/null) &&
            layout=$("$garage" -c "$config" layout show 2>/dev/null); then
            if grep -q "Current cluster layout version: 0" <<<"$layout"; then
                "$garage" -c "$config" layout assign -z dc1 -c 1G "${id%%@*}" >/dev/null 2>&1 || true
                "$garage" -c "$config" layout apply --version 1 >/dev/null 2>&1 || true
            elif grep -q "Current cluster layout version: [1-9]" <<<"$layout"; then
                exit 0
            fi
        fi
        sleep 0.2
    done
    echo "garage did not take its layout within 120 s" >&2
) &

wait "$server"
