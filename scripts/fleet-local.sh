#!/usr/bin/env bash
# A fleet on loopback to try: a private Redis, two gateways and three node
# agents (two virtual 80 GB GPUs each) serving the mock models of
# examples/fleet-local.toml. Prints where each answers, then waits; Ctrl-C
# stops everything it started. See docs/cluster.md.
#
#   scripts/fleet-local.sh                  # gateways on :8080 and :8081
#   curl -s localhost:8080/admin/status     # which gateway leads, where replicas run
#   kill -9 <an agent's pid>                # its replicas run again elsewhere within ~10 s
#
# HANGAR names the binary to run; by default `cargo run --release` builds
# it. Needs `redis-server` (Debian: apt-get install redis-server).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ -n "${HANGAR:-}" ]; then
    hangar=("$HANGAR")
else
    cargo build --release --quiet --manifest-path "$repo/Cargo.toml" -p hangar
    hangar=("${CARGO_TARGET_DIR:-$repo/target}/release/hangar")
fi
command -v redis-server >/dev/null || { echo "needs redis-server (apt-get install redis-server)" >&2; exit 1; }

work="$(mktemp -d)"
pids=()
stop() {
    trap - EXIT INT TERM
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap stop EXIT INT TERM

redis-server --port 0 --unixsocket "$work/redis.sock" --unixsocketperm 700 --dir "$work" \
    --appendonly yes --save "" --logfile "$work/redis.log" &
pids+=($!)
redis="unix://$work/redis.sock"
for _ in $(seq 50); do [ -S "$work/redis.sock" ] && break; sleep 0.1; done

# Each process prints its address on its first line; the log goes to $work.
start() {
    local name="$1"; shift
    "${hangar[@]}" "$@" >"$work/$name.out" 2>"$work/$name.log" &
    pids+=($!)
    for _ in $(seq 100); do [ -s "$work/$name.out" ] && break; sleep 0.1; done
    echo "$name (pid $!): $(head -n1 "$work/$name.out")"
}
config="$repo/examples/fleet-local.toml"
start gateway-1 serve --config "$config" --redis "$redis" --listen 127.0.0.1:${PORT_1:-8080}
start gateway-2 serve --config "$config" --redis "$redis" --listen 127.0.0.1:${PORT_2:-8081}
for n in 1 2 3; do
    start "agent-$n" agent --config "$config" --redis "$redis" --name "node-$n" \
        --gpus 2 --gpu-memory 80GB --virtual-gpus
done
echo "logs in $work; Ctrl-C stops the fleet"
wait
