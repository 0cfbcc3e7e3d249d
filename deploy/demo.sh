#!/usr/bin/env bash
# deploy/demo.sh - the main job: prepare the embedded default dataset (a
# synthetic order-2 Markov corpus with a known entropy floor) and train the
# embedded tiny DeepSeek-V3 model on it (deploy/examples/tiny-cpu.json),
# on the CPU unless a GPU is present. Run deploy/setup.sh first.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MOETRAIN_BUILD_DIR:-$root/build}"
work="$build/demo"
mkdir -p "$work"

if [ ! -f "$work/synth.idx" ]; then
  echo "demo: generating the default corpus in $work/synth.{bin,idx}"
  "$build/engine/moetrain-data" synth --output "$work/synth" --vocab 64 --tokens 4000000 \
    --seed 1 --branching 4
fi
"$build/engine/moetrain-data" inspect "$work/synth"
