#!/usr/bin/env bash
# Final-loss gaps of the optimizer's main-params modes (fp32, bf16, none)
# under the fp8-blockwise recipe, against a bf16-recipe run with an fp32 main
# copy, all of the same length on the same corpus (the tiny demo model).
#
#   tests/bench/bench_main_params.sh [BUILD_DIR] [STEPS]
# Prints one row per run: final train loss (mean of the last 50 steps),
# final valid loss, gap to the reference. Results: tests/bench/RESULTS.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-$root/build}"
steps="${2:-1500}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
"$build/engine/moetrain-data" synth --output "$dir/syn" --vocab 32 --tokens 4000000 --seed 1 \
  --branching 4 > /dev/null

run() { # NAME RECIPE MAIN
  "$build/service/moetraind" --job "$root/deploy/examples/tiny-cpu.json" --set data.path="$dir/syn" \
    --set model.vocab_size=32 --set train.steps="$steps" --set lr_schedule.warmup_steps=50 \
    --set data.valid_interval="$steps" --set data.valid_batches=16 --set train.log_interval=100000 \
    --set precision.recipe="$2" --set precision.main_params="$3" \
    --metrics-jsonl "$dir/$1.jsonl" > "$dir/$1.log" 2>&1
}
run ref bf16 fp32
for m in fp32 bf16 none; do run "fp8-$m" fp8-blockwise "$m"; done

/usr/bin/python3 - "$dir" "$steps" <<'PY'
import json, sys, os
d, steps = sys.argv[1], int(sys.argv[2])
floor = json.load(open(os.path.join(d, "syn.json")))["conditional_entropy_nats"]
def final(name):
    rows = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl"))]
    tail = [r["loss"] for r in rows[-50:]]
    return sum(tail) / len(tail), rows[-1]["valid_loss"]
rt, rv = final("ref")
print(f"{steps} steps, entropy floor {floor:.4f}")
print(f"| run | recipe | main params | train loss (last 50) | valid loss | gap vs ref (valid) |")
print(f"|---|---|---|---|---|---|")
print(f"| ref | bf16 | fp32 | {rt:.4f} | {rv:.4f} | 0 |")
for m in ("fp32", "bf16", "none"):
    t, v = final("fp8-" + m)
    print(f"| fp8-{m} | fp8-blockwise | {m} | {t:.4f} | {v:.4f} | {v - rv:+.4f} |")
PY
