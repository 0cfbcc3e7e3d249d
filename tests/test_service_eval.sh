#!/usr/bin/env bash
# test_service_eval.sh - the Evaluate RPC through `moetrain eval`: it
# scores a checkpoint in the daemon's workdir while a job trains, with the
# loss the trainer logged for the same weights and the same output files
# as `moetrain-ckpt eval`; every path stays inside the workdir; bad input
# gets INVALID_ARGUMENT / NOT_FOUND naming the field. Loopback only, the
# daemon killed at the end.
#
#   test_service_eval.sh BUILD_DIR SOURCE_DIR SCRATCH_DIR
set -euo pipefail
. "$(dirname "$0")/shell_checks.sh" # has, has_line: never `echo | grep -q` here
build=$1 src=$2 tmp=$3
job="$src/deploy/examples/tiny-cpu.json"
py=/usr/bin/python3
export OMP_NUM_THREADS=1
rm -rf "$tmp" && mkdir -p "$tmp/wd"

pids=()
cleanup() { for p in "${pids[@]}"; do kill -KILL "$p" 2> /dev/null || true; done; }
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  tail -n 30 "$tmp/daemon.log" >&2 || true
  exit 1
}

# a checkpoint inside the workdir, with the valid loss of its weights
"$build/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 4 > /dev/null
sets=(--set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
      --set batch.global_batch_size=2 --set lr_schedule.warmup_steps=1
      --set data.valid_batches=3 --set train.log_interval=100)
"$build/tests/ckpt_run" --job "$job" --threads 1 "${sets[@]}" --set train.steps=2 \
    --set data.valid_interval=2 --set checkpoint.dir="$tmp/wd/ck" --set checkpoint.interval=2 \
    --metrics-jsonl "$tmp/m.jsonl" 2> "$tmp/run.log" || { cat "$tmp/run.log"; exit 1; }
valid=$("$py" -c 'import json,sys; print("%.9g" % [json.loads(l) for l in open(sys.argv[1])][-1]["valid_loss"])' "$tmp/m.jsonl")

rm -f "$tmp/ready"
"$build/service/moetraind" --listen 127.0.0.1:0 --workdir "$tmp/wd" --ready-file "$tmp/ready" \
    --threads 1 >> "$tmp/daemon.log" 2>&1 &
pids+=($!)
for _ in $(seq 300); do [ -f "$tmp/ready" ] && break; sleep 0.1; done
[ -f "$tmp/ready" ] || fail "moetraind did not become ready"
grpc=$(sed -n 's/^grpc=//p' "$tmp/ready")
cli() { "$build/service/moetrain" --server "$grpc" --timeout 120 "$@"; }

# a job trains meanwhile (evaluation runs beside it, on rank 0)
cli start "$job" "${sets[@]}" --set train.steps=100000 --set data.valid_interval=0 > /dev/null \
    || fail "start"

out=$(cli eval ck --out scores/loss.npy --logits) || fail "eval: $out"
has_line "$out" "^loss        $valid " || fail "eval's loss is not the trainer's $valid: $out"
has_line "$out" "valid split of $tmp/syn: 6 sequences x 32 tokens" || fail "eval said: $out"
grep -q "evaluate: 100% (192 of 192 tokens)" "$tmp/daemon.log" || fail "no progress in the log"
"$build/ckpt/moetrain-ckpt" eval "$tmp/wd/ck" --quiet --threads 1 --out "$tmp/direct.npy" > /dev/null
cmp "$tmp/wd/scores/loss.npy" "$tmp/direct.npy" || fail "the RPC and moetrain-ckpt eval differ"
"$py" -c '
import numpy as np, sys
d = sys.argv[1] + "/wd/scores/"
l, t, g = np.load(d + "loss.npy"), np.load(d + "loss.tokens.npy"), np.load(d + "loss.logits.npy")
assert l.shape == (6, 32) and t.shape == (6, 33) and g.shape == (6, 32, 64), (l.shape, t.shape, g.shape)
' "$tmp" || fail "numpy cannot read the outputs"

# a token file in the workdir, and the valid split of a job spec: the same
out=$(cli eval ck --tokens scores/loss.tokens.npy --batch 3 --out scores/t.npy --json) || fail "eval --tokens: $out"
cmp "$tmp/wd/scores/loss.npy" "$tmp/wd/scores/t.npy" || fail "--tokens scores differently"
echo "$out" | "$py" -c 'import json,sys; r=json.load(sys.stdin); assert r["recipe"]=="fp8-blockwise" and r["tokens"]=="192", r' \
    || fail "eval --json: $out"
out=$(cli eval ck --job "$job" "${sets[@]}" --set train.steps=2) || fail "eval --job: $out"
has_line "$out" "^loss        $valid " || fail "eval --job: $out"

# bad input: the field is named, nothing is written outside the workdir
expect() { # expect NEEDLE ARGS...
  local needle=$1; shift
  set +e; out=$(cli eval "$@" 2>&1); local rc=$?; set -e
  [ $rc = 3 ] && has "$out" "$needle" || fail "eval $*: rc $rc: $out"
}
expect "INVALID_ARGUMENT: checkpoint" ../
expect "INVALID_ARGUMENT: checkpoint" /etc
expect "INVALID_ARGUMENT: output" ck --out ../escape.npy
expect "INVALID_ARGUMENT: tokens" ck --tokens /etc/hostname
expect "NOT_FOUND" nothere
printf '1 2 3\n4 99 5\n' > "$tmp/wd/oov.txt"
expect "INVALID_ARGUMENT: $tmp/wd/oov.txt: sequence 1, position 1: token 99 is outside the vocabulary" \
  ck --tokens oov.txt --out scores/oov.npy
[ ! -e "$tmp/wd/scores/oov.npy" ] || fail "a failed evaluation left its output"
expect "INVALID_ARGUMENT: logits" ck --logits
expect "INVALID_ARGUMENT: backend" ck --backend tpu
[ ! -e "$tmp/escape.npy" ] || fail "an output escaped the workdir"
[ "$(cli status --json | "$py" -c 'import json,sys; print(json.load(sys.stdin)["state"])')" = JOB_STATE_RUNNING ] \
  || fail "the job did not keep running"
cli stop > /dev/null || fail "stop"
echo "Evaluate RPC: the trainer's loss, the same files as moetrain-ckpt eval, confined to the workdir"
rm -rf "$tmp"
