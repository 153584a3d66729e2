#!/usr/bin/env bash
# A network partition between the gateways and one node, under load: the
# node's agent still beats in Redis and its engines still run, but no
# packet from a gateway reaches it (docs/cluster.md, "Faults").
#
#   sudo scripts/fleet-partition.sh             # both gateways cut off from node-3
#   sudo CUT=follower scripts/fleet-partition.sh  # only the gateway that does not lead
#
# HANGAR names the binary (default: a release build). The fleet of
# scripts/fleet-local.sh (a private Redis on a Unix socket, two gateways,
# three agents) runs in a network namespace of its own, so the routing
# rule that makes the partition, and everything else, is gone when the
# script ends. The gateways run as `nobody` and `daemon`; node-3's agent
# and engines answer on 127.0.0.2, and a policy-routing rule drops the
# cut-off gateways' packets to that address for PARTITION_S seconds (20)
# while sync chats go through both gateways at 20 a second; mid-way, the
# model they use is pinned at one replica more. Prints what the first
# gateway shows every 2 s, the answers' status codes, the longest answer,
# and the gateways' warnings. Needs root (a namespace, `ip rule`),
# `setpriv`, `redis-server`, `curl` and `python3`.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${HANGAR_PARTITION_NETNS:-}" ]; then
    [ "$(id -u)" = 0 ] || { echo "needs root: a network namespace and a routing rule" >&2; exit 1; }
    if [ -z "${HANGAR:-}" ]; then
        cargo build --release --quiet --manifest-path "$repo/Cargo.toml" -p hangar
        HANGAR="${CARGO_TARGET_DIR:-$repo/target}/release/hangar"
    fi
    export HANGAR HANGAR_PARTITION_NETNS=1
    exec unshare --net --fork "$0" "$@"
fi
ip link set lo up
hangar="$HANGAR"
partition_s="${PARTITION_S:-20}"
cut="${CUT:-all}"
[ "$cut" = all ] || [ "$cut" = follower ] || { echo "CUT is all or follower, not $cut" >&2; exit 1; }
work="$(mktemp -d)"
config="$work/fleet.toml"
chmod 755 "$work"
pids=()
stop() {
    trap - EXIT INT TERM
    kill "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap stop EXIT INT TERM
# examples/fleet-local.toml, with room for one more replica of demo/chat-small.
sed 's/^min_replicas = 2$/min_replicas = 2\nmax_replicas = 3/' "$repo/examples/fleet-local.toml" >"$config"
grep -q '^max_replicas = 3$' "$config" || { echo "examples/fleet-local.toml changed: update this script" >&2; exit 1; }

redis-server --port 0 --unixsocket "$work/redis.sock" --unixsocketperm 777 --dir "$work" \
    --save "" --logfile "$work/redis.log" &
pids+=($!)
for _ in $(seq 50); do [ -S "$work/redis.sock" ] && break; sleep 0.1; done
redis="unix://$work/redis.sock"
# Each gateway runs as a user of its own, so a rule can cut one or both.
users=(nobody daemon)
for g in 1 2; do
    user="${users[$((g - 1))]}"
    mkdir "$work/gateway-$g" && chown "$user" "$work/gateway-$g"
    (cd "$work/gateway-$g" && exec setpriv --reuid="$user" --regid=nogroup --clear-groups \
        "$hangar" serve --config "$config" --redis "$redis" --listen "127.0.0.1:808$g" \
        >"$work/gateway-$g.out" 2>"$work/gateway-$g.log") &
    pids+=($!)
done
sleep 2
# node-3 first, so placement puts replicas on it.
for n in 3 1 2; do
    host=127.0.0.1
    [ "$n" = 3 ] && host=127.0.0.2
    "$hangar" agent --config "$config" --redis "$redis" --name "node-$n" --gpus 2 --gpu-memory 80GB \
        --virtual-gpus --engine-host "$host" --listen "$host:0" >"$work/agent-$n.out" 2>"$work/agent-$n.log" &
    pids+=($!)
    [ "$n" = 3 ] && sleep 5
done
sleep 8
status() {
    curl -s -m 2 localhost:8081/admin/status | python3 -c '
import json, sys
try:
    s = json.load(sys.stdin)
except ValueError as e:
    sys.exit("status unreadable: %s" % e)
suspect = [n["name"] for n in s["nodes"] if n.get("suspect")]
print(" | ".join([m["model"] + " " + ",".join(sorted("%s:%s" % (r.get("node"), r.get("state"))
      for r in m["replicas"])) for m in s["models"]] + ["suspect: " + (",".join(suspect) or "none")]))'
}
echo "before: $(status)"
requests=$(( (partition_s + 25) * 20 ))
(
    for i in $(seq "$requests"); do
        port=$((8081 + i % 2))
        curl -s -m 60 -o /dev/null -w "%{http_code} %{time_total}\n" "localhost:$port/v1/chat/completions" \
            -H 'content-type: application/json' \
            -d '{"model":"demo/chat-small","messages":[{"role":"user","content":"hi"}],"max_tokens":4}' || true
        sleep 0.05
    done
) >"$work/answers" &
load=$!
sleep 5
# The local table's rule moves behind the partition's, in this namespace only.
ip rule add pref 200 lookup local
ip rule del pref 0
ip route add blackhole 127.0.0.2/32 table 100
if [ "$cut" = follower ]; then
    leads=$(curl -s -m 2 localhost:8081/admin/status | python3 -c 'import json,sys; print(json.load(sys.stdin)["fleet"]["leading"])')
    cut_off=("${users[1]}")
    [ "$leads" = True ] || cut_off=("${users[0]}")
else
    cut_off=("${users[@]}")
fi
for user in "${cut_off[@]}"; do
    ip rule add pref 100 uidrange "$(id -u "$user")-$(id -u "$user")" to 127.0.0.2/32 lookup 100
done
echo "$(date +%T) partitioned: ${cut_off[*]} (CUT=$cut) reach nothing on node-3"
for i in $(seq $((partition_s / 2))); do
    sleep 2
    echo "$(date +%T) $(status)"
    if [ "$i" = 4 ]; then
        # One replica more, while node-3 — whose GPUs are free now — beats
        # but cannot be reached: it must go elsewhere.
        echo "$(date +%T) demo/chat-small pinned at 3 replicas: $(curl -s -m 5 -X POST \
            localhost:8081/admin/models/demo/chat-small/scaling -H 'content-type: application/json' \
            -d '{"action": "pin", "replicas": 3}')"
    fi
done
while ip rule del pref 100 2>/dev/null; do :; done
echo "$(date +%T) healed"
for _ in $(seq 5); do sleep 2; echo "$(date +%T) $(status)"; done
wait "$load"
echo "answers by status:"
awk '{print $1}' "$work/answers" | sort | uniq -c
echo "longest answer: $(sort -k2 -n "$work/answers" | tail -n1 | awk '{print $2}') s"
echo "gateways' warnings:"
grep -h WARN "$work"/gateway-*.log | sed -E 's/^[^ ]+ +//' | cut -c1-200 | sort | uniq -c | sort -rn
