#!/usr/bin/env bash
# The worked example of docs/sim.md, "Whole-fleet simulation": a bursty
# four-model trace run on examples/fleet.toml, drawn over time, then the
# same trace under three scaling policies. Writes docs/fleet-example.svg
# and docs/fleet-compare.svg; the same inputs draw the same bytes, so a
# rerun changes them only when the simulation does.
#
# HANGAR names the binary to run; by default `cargo run` builds it.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

if [ -n "${HANGAR:-}" ]; then
    hangar() { "$HANGAR" "$@"; }
else
    hangar() { cargo run --quiet --manifest-path "$repo/Cargo.toml" -p hangar -- "$@"; }
fi

# Run where the trace is, with examples/ beside it, so the plots' titles
# name `bursty.jsonl` and `examples/fleet.toml` rather than a temporary path.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
ln -s "$repo/examples" "$work/examples"
cd "$work"

hangar trace synth --requests 3000 --rate 5 --models 4 --pattern bursty --period-s 120 \
    --max-turns 1 --seed 0 -o bursty.jsonl
hangar sim --fleet examples/fleet.toml bursty.jsonl --plot "$repo/docs/fleet-example.svg"
hangar sim compare --fleet examples/fleet.toml bursty.jsonl \
    --policy hangar --policy replicate --policy workers-ai --plot "$repo/docs/fleet-compare.svg"
