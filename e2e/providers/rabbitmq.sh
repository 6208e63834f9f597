#!/usr/bin/env bash
# A RabbitMQ provider for tests: rabbitmq.sh <base_dir> <amqp_port> <nodename>
# Its own node name, ports (distribution: amqp_port + 20000), directories,
# cookie and HOME under base_dir, no plugins; the server in the foreground.
# Administer it with `HOME=<base_dir> rabbitmqctl -n <nodename> ...`.
set -euo pipefail

base=$1
port=$2
node=$3

mkdir -p "$base/mnesia" "$base/log"
if [ ! -s "$base/.erlang.cookie" ]; then
    umask 077
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$base/.erlang.cookie"
    chmod 0400 "$base/.erlang.cookie"
fi
: >"$base/enabled_plugins"

export HOME=$base
export RABBITMQ_NODENAME=$node
export RABBITMQ_NODE_PORT=$port
export RABBITMQ_DIST_PORT=$((port + 20000))
export RABBITMQ_MNESIA_BASE=$base/mnesia
export RABBITMQ_LOG_BASE=$base/log
export RABBITMQ_ENABLED_PLUGINS_FILE=$base/enabled_plugins
export RABBITMQ_CONFIG_FILE=$base/rabbitmq
export RABBITMQ_PID_FILE=$base/rabbitmq.pid
export RABBITMQ_LOGS=-
# The unwrapped server: Debian's /usr/sbin wrapper would su to the rabbitmq
# user and ignore HOME.
server=/usr/lib/rabbitmq/bin/rabbitmq-server
[ -x "$server" ] || server=rabbitmq-server
exec "$server"
