#!/usr/bin/env bash
# The demo's tiny model (fp8-blockwise recipe, CPU backend) trained on a
# synthetic sparse order-2 Markov corpus gets within 0.15 nats of the
# corpus's exact conditional entropy (the loss floor, from PREFIX.json).
# Prints the reached figure. 3000 steps of 1024 tokens: ~4-6 minutes on 2 cores.
#
#   test_trainer_converges.sh BUILD_DIR EXAMPLES_DIR SCRATCH_DIR
set -euo pipefail
build="$1" examples="$2" dir="$3"
rm -rf "$dir" && mkdir -p "$dir"

"$build/engine/moetrain-data" synth --output "$dir/syn" --vocab 32 --tokens 8000000 --seed 1 \
  --branching 4 > /dev/null
"$build/service/moetraind" --job "$examples/tiny-cpu.json" \
  --set data.path="$dir/syn" --set model.vocab_size=32 --set train.steps=3000 \
  --set lr_schedule.warmup_steps=50 --set data.valid_interval=1000 --set data.valid_batches=16 \
  --set train.log_interval=500 --metrics-jsonl "$dir/metrics.jsonl"

/usr/bin/python3 - "$dir/syn.json" "$dir/metrics.jsonl" <<'PY'
import json, sys
floor = json.load(open(sys.argv[1]))["conditional_entropy_nats"]
steps = [json.loads(l) for l in open(sys.argv[2])]
valid = [s["valid_loss"] for s in steps if s["valid_loss"] is not None]
gap = valid[-1] - floor
print(f"entropy floor {floor:.4f} nats/token; valid loss after {len(steps)} steps "
      f"{valid[-1]:.4f}; gap {gap:.4f} nats (required < 0.15); valid curve "
      + " ".join(f"{v:.3f}" for v in valid))
sys.exit(0 if len(steps) == 3000 and gap < 0.15 else 1)
PY
