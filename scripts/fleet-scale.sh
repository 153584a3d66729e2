#!/usr/bin/env bash
# The scale figure of docs/sim.md ("How big a fleet"): one hour of traffic
# at 2,000 requests/s (7.2M requests) over 20 models on 100 nodes of eight
# 80 GB GPUs, with scaling and placement on. Generates the fleet file and
# the trace, runs the simulation twice under /usr/bin/time, prints the wall
# time and peak RSS of each run, and checks the two reports are the same
# bytes.
#
#     scripts/fleet-scale.sh [REQUESTS]     # default 7200000
#
# NODES (default 100), MODELS (default 20) and RATE (requests/s, default
# 2000) size the fleet and the traffic; each model's `max_replicas`
# follows its share of the traffic so the fleet tops out near 4.8
# replicas per node. The fleet-size figure of docs/sim.md runs
#
#     RATE=20000 scripts/fleet-scale.sh                       # 100 nodes, 20 models
#     RATE=20000 NODES=1000 MODELS=100 scripts/fleet-scale.sh
#
# HANGAR names the binary to run (default: a release build by cargo);
# WORK keeps the generated files (default: a temporary directory, removed
# on exit). The trace is about 1.2 GB for the full hour.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
requests="${1:-7200000}"
nodes="${NODES:-100}"
models="${MODELS:-20}"
rate="${RATE:-2000}"

if [ -z "${HANGAR:-}" ]; then
    cargo build --quiet --release --manifest-path "$repo/Cargo.toml" -p hangar
    HANGAR="$(cargo metadata --format-version 1 --no-deps --manifest-path "$repo/Cargo.toml" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/hangar"
fi
if [ -z "${WORK:-}" ]; then
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
fi
cd "$WORK"

# Models of 16, 30 and 70 GB; `max_replicas` follows each model's Zipf
# share of the traffic (the trace's `--model-zipf-s 1`) so the fleet tops
# out near 4.8 replicas per node (480 on 100 nodes).
{
    echo "seed = 1"
    echo
    echo "[[nodes]]"
    echo 'id = "gpu"'
    echo "count = $nodes"
    echo "gpus = 8"
    echo 'gpu_memory = "80GB"'
    echo 'cpu_cache = "512GB"'
    NODES="$nodes" MODELS="$models" python3 - <<'EOF'
import os
sizes = ["16GB", "30GB", "70GB"]
weights = [1 / (k + 1) for k in range(int(os.environ["MODELS"]))]
total = sum(weights)
for k, w in enumerate(weights):
    most = max(2, round(4.8 * int(os.environ["NODES"]) * w / total))
    print(f'\n[[models]]\nkey = "synth/m{k}"\nsize = "{sizes[k % 3]}"\n'
          f'max_replicas = {most}\nconcurrency = 32')
EOF
} > fleet-scale.toml

trace="scale-$requests-$rate-$models.jsonl"
if [ ! -s "$trace" ]; then
    "$HANGAR" trace synth --requests "$requests" --rate "$rate" --models "$models" --max-turns 1 \
        --output-tokens 128 --seed 7 -o "$trace"
fi

for run in 1 2; do
    /usr/bin/time -f "run $run: wall %e s, peak RSS %M KiB" \
        "$HANGAR" sim --fleet fleet-scale.toml "$trace" --json "report-$run.json" > "table-$run.txt"
done
cmp report-1.json report-2.json &&
    echo "the two reports are byte-identical"
cat table-1.txt
python3 -c '
import json, sys
t = json.load(open("report-1.json"))["total"]
print("requests {requests}, completed {completed}, SLO {slo:.1%}, GPU-h {gpuh:.1f}, cold starts {cold}".format(
    requests=t["requests"], completed=t["completed"], slo=t["slo_attainment"],
    gpuh=t["gpu_seconds"]["total"] / 3600, cold=t["cold_starts"]["cold"]))'
