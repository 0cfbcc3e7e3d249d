#!/usr/bin/env bash
# moetraind in the foreground: bad job specs fail fast with the field named
# (exit 2), usage errors exit 1, --help-job lists the fields, SIGTERM stops
# the job at a step boundary (exit 0), --metrics-jsonl writes one object per step.
#
#   test_moetraind_cli.sh BUILD_DIR EXAMPLES_DIR SCRATCH_DIR
set -uo pipefail
build="$1" examples="$2" dir="$3"
rm -rf "$dir" && mkdir -p "$dir"
d="$build/service/moetraind"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

"$build/engine/moetrain-data" synth --output "$dir/syn" --vocab 64 --tokens 200000 --seed 2 >/dev/null

# expect_fail NAME CODE NEEDLE -- ARGS...
expect_fail() {
  local name="$1" code="$2" needle="$3"; shift 4
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  if [ "$rc" -ne "$code" ]; then fail "$name: exit $rc, want $code: $out"; return; fi
  if ! grep -qF -- "$needle" <<<"$out"; then fail "$name: no '$needle' in: $out"; return; fi
  echo "ok: $name"
}

job="$examples/tiny-cpu.json"
expect_fail "missing --job" 1 "--job is required" -- "$d"
expect_fail "unknown option" 1 "unknown option" -- "$d" --job "$job" --bogus
expect_fail "missing data files" 2 "data.path" -- "$d" --job "$job" --set data.path="$dir/nothere"
expect_fail "unknown field" 2 "train.stpes: unknown field" -- "$d" --job "$job" \
  --set data.path="$dir/syn" --set train.stpes=3
expect_fail "indivisible batch" 2 "batch.global_batch_size: 8 is not divisible" -- "$d" --job "$job" \
  --set data.path="$dir/syn" --set batch.micro_batch_size=3
expect_fail "experts vs groups" 2 "model.n_routed_experts: 8 is not divisible by n_group 3" -- \
  "$d" --job "$job" --set data.path="$dir/syn" --set model.n_group=3
echo '{"model": {' > "$dir/broken.json"
expect_fail "malformed JSON" 2 "broken.json:2" -- "$d" --job "$dir/broken.json"

# NaN, infinities, invalid UTF-8: bad input naming the field (issue 21,
# defect 5: they were "out of memory"), in --set and in the file, in the
# foreground and in the daemon's --job
expect_fail "NaN in --set" 2 'optimizer.lr: "nan" is not a finite number' -- "$d" --job "$job" \
  --set data.path="$dir/syn" --set optimizer.lr=nan
expect_fail "Inf in --set of an integer" 2 'train.steps: "inf" is not an integer of 64 bits' -- \
  "$d" --job "$job" --set data.path="$dir/syn" --set train.steps=inf
expect_fail "invalid UTF-8 in --set" 2 "name: not valid UTF-8 (byte 0xff at offset 4)" -- \
  "$d" --job "$job" --set data.path="$dir/syn" --set name=$'tiny\xff'
sed 's/"lr": 3e-3/"lr": NaN/' "$job" > "$dir/nan.json"
expect_fail "NaN in the file" 2 "nan.json:36:26: optimizer.lr: invalid token near 'NaN'" -- \
  "$d" --job "$dir/nan.json" --set data.path="$dir/syn"
sed 's/"lr": 3e-3/"lr": 1e999/' "$job" > "$dir/inf.json"
expect_fail "overflow in the file" 2 "optimizer.lr: real number overflow" -- \
  "$d" --job "$dir/inf.json" --set data.path="$dir/syn"
sed $'s/"name": "tiny-cpu"/"name": "tiny\xff"/' "$job" > "$dir/utf8.json"
expect_fail "invalid UTF-8 in the file" 2 "utf8.json:3:15: name: unable to decode byte 0xff" -- \
  "$d" --job "$dir/utf8.json" --set data.path="$dir/syn"
expect_fail "NaN in --set, daemon --job" 2 'optimizer.lr: "nan" is not a finite number' -- \
  "$d" --listen 127.0.0.1:0 --workdir "$dir/wd" --job "$job" --set data.path="$dir/syn" \
  --set optimizer.lr=nan
expect_fail "NaN in the file, daemon --job" 2 "optimizer.lr: invalid token near 'NaN'" -- \
  "$d" --listen 127.0.0.1:0 --workdir "$dir/wd" --job "$dir/nan.json"

# admission: a layout the ranks cannot run is refused before anything runs,
# naming the layout and the world size
expect_fail "tp 2 on one rank" 2 "layout tp=2,pp=1,vpp=1,ep=1,etp=1,dp=0: 1 rank runs the job, not a multiple of tp 2 x pp 1 = 2" -- \
  "$d" --job "$job" --set data.path="$dir/syn" --set parallel.tp=2
expect_fail "dp 2 on one rank" 2 "needs tp 1 x pp 1 x dp 2 = 2 ranks, but 1 rank runs the job" -- \
  "$d" --job "$job" --set data.path="$dir/syn" --set parallel.dp=2
expect_fail "tp 2 on one rank, daemon --job" 2 "1 rank runs the job" -- \
  "$d" --listen 127.0.0.1:0 --workdir "$dir/wd" --job "$job" --set data.path="$dir/syn" \
  --set parallel.tp=2

"$d" --help-job > "$dir/help.txt" 2>&1 || fail "--help-job exit $?"
for f in train.steps precision.main_params model.n_group lr_schedule.decay; do
  grep -q "$f" "$dir/help.txt" || fail "--help-job lacks $f"
done

# SIGTERM mid-run: stops at a step boundary, exit 0, JSONL has only whole steps.
"$d" --job "$job" --set data.path="$dir/syn" --set train.steps=100000 --set batch.seq_len=32 \
  --metrics-jsonl "$dir/m.jsonl" > "$dir/run.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do
  [ -s "$dir/m.jsonl" ] && [ "$(wc -l < "$dir/m.jsonl")" -ge 3 ] && break
  sleep 0.2
done
kill -TERM "$pid"
wait "$pid"; rc=$?
[ "$rc" -eq 0 ] || fail "SIGTERM: exit $rc, want 0"
grep -q "stopped at step" "$dir/run.log" || fail "SIGTERM: no 'stopped at step' in log"
n=$(wc -l < "$dir/m.jsonl")
last=$(tail -n 1 "$dir/m.jsonl" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["step"])')
[ "$n" -ge 3 ] && [ "$last" -eq "$n" ] || fail "JSONL: $n lines, last step $last"
echo "ok: SIGTERM stopped at step $last"

echo "$fails failure(s)"
[ "$fails" -eq 0 ]
