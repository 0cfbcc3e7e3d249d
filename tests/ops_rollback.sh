#!/bin/bash
# ops_rollback.sh BIN_DIR SOURCE_DIR TMP
#
# Property: a loss spike or a NaN streak rolls the job back to its last good
# checkpoint and skips the data that caused it; the run then continues
# normally. With injected faults (train.fault, tied to the data of given
# steps; refused unless MOETRAIN_ALLOW_FAULTS=1):
#   - loss x1000 in the data of steps 21-23: the detector fires at step 23
#     (3 abnormal steps since 21), the job restores step 20, sets aside the
#     checkpoint of step 22 (saved during the spike), skips samples
#     [80, 92), logs one line, and completes 40 steps with no other
#     abnormal step; rollbacks_total is 1;
#   - NaN gradients in the data of steps 21-25: after train.max_bad_steps
#     (5) the same happens for samples [80, 100);
#   - bad data that outlasts the skips: after train.max_rollbacks (2) the
#     next trigger fails the job (exit 2), saying so;
#   - no checkpoint: the spike's step is dropped and training goes on;
#   - train.max_rollbacks 0: a NaN streak fails the job as before.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
d="$bin/service/moetraind"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 200000 --seed 4 > /dev/null
common=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1
        --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
        --set batch.global_batch_size=4 --set train.steps=40 --set lr_schedule.warmup_steps=4
        --set data.valid_interval=0 --set train.log_interval=100 --set train.spike_window=16)
fail() { echo "FAIL: $*"; exit 1; }
# run NAME ARGS...: exit status in $rc
run() {
    local name=$1; shift
    rc=0
    MOETRAIN_ALLOW_FAULTS=1 "$d" "${common[@]}" --metrics-jsonl "$tmp/$name.jsonl" "$@" \
        > "$tmp/$name.log" 2>&1 || rc=$?
}
# field STEP-OCCURRENCE KEY FILE: KEY of the N-th line with "step":S (S:N)
field() {
    /usr/bin/python3 - "$1" "$2" "$3" << 'PY'
import json, sys
want, key, path = sys.argv[1], sys.argv[2], sys.argv[3]
s, n = (int(x) for x in want.split(":"))
seen = 0
for line in open(path):
    m = json.loads(line)
    if m["step"] == s:
        seen += 1
        if seen == n:
            print(m[key])
            sys.exit(0)
print("none")
PY
}
count() { /usr/bin/python3 -c 'import json,sys; print(sum(1 for l in open(sys.argv[1]) if json.loads(l)[sys.argv[2]] not in (0, False)))' "$1" "$2"; }
ck=(--set checkpoint.dir="$tmp/ck" --set checkpoint.interval=2 --set checkpoint.async=false
    --set checkpoint.keep_last=0)
spike=(--set train.fault.kind=loss_scale --set train.fault.step=21 --set train.fault.steps=3)

# refused unless allowed
set +e
out=$("$d" "${common[@]}" "${spike[@]}" 2>&1); r=$?
set -e
[ $r = 2 ] && grep -q "train.fault.kind: fault injection is refused" <<< "$out" ||
    fail "fault injection without MOETRAIN_ALLOW_FAULTS: exit $r: $out"

# 1. a loss spike
run spike "${ck[@]}" "${spike[@]}"
[ $rc = 0 ] || fail "spike run: exit $rc: $(tail -n 5 "$tmp/spike.log")"
line=$(grep "rollback 1 of 3:" "$tmp/spike.log" | sed 's/^\[[^]]*\] //') || true
[ -n "$line" ] || fail "no rollback line: $(grep -i 'spike\|roll' "$tmp/spike.log")"
grep -q "rollback 1 of 3: step 23: loss .* above .*; 3 abnormal steps since step 21; restored step 20 from $tmp/ck/step_00000020; skipped samples \[80, 92) (the data of 3 steps)" \
    <<< "$line" || fail "rollback line: $line"
echo "event: $line"
[ -d "$tmp/ck/step_00000022.rolledback" ] || fail "the checkpoint of step 22 was not set aside"
[ "$(field 21:1 spike "$tmp/spike.jsonl")" = 2 ] || fail "step 21 not marked as a loss spike (2)"
[ "$(field 21:2 samples "$tmp/spike.jsonl")" = 96 ] ||
    fail "the step after the rollback read from sample $(field 21:2 samples "$tmp/spike.jsonl"), not past 92"
[ "$(field 21:2 spike "$tmp/spike.jsonl")" = 0 ] || fail "the spike came back after the rollback"
[ "$(field 40:1 rollbacks_total "$tmp/spike.jsonl")" = 1 ] || fail "rollbacks_total at the end"
[ "$(count "$tmp/spike.jsonl" spike)" = 2 ] || fail "abnormal steps: $(count "$tmp/spike.jsonl" spike), want 2 (21, 22)"
/usr/bin/python3 - "$tmp/spike.jsonl" << 'PY' || fail "losses after the rollback are not back to normal"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
before = [r["loss"] for r in rows[:20]]
after = [r["loss"] for r in rows[22:]]  # steps 21..40 of the second pass
assert len(after) == 20 and max(after) < max(before), (before, after)
PY
echo "ok: loss spike: rolled back to step 20, data of steps 21-23 skipped, completed"

# 2. a NaN streak
rm -rf "$tmp/ck"
run nan "${ck[@]}" --set train.fault.kind=nan_grad --set train.fault.step=21 --set train.fault.steps=5
[ $rc = 0 ] || fail "nan run: exit $rc: $(tail -n 5 "$tmp/nan.log")"
grep -q "rollback 1 of 3: step 25: loss .*, gradient norm nan; 5 abnormal steps since step 21; restored step 20 .* skipped samples \[80, 100)" \
    "$tmp/nan.log" || fail "NaN rollback: $(grep -i roll "$tmp/nan.log")"
[ "$(field 40:1 rollbacks_total "$tmp/nan.jsonl")" = 1 ] || fail "NaN: rollbacks_total"
[ "$(field 40:1 skipped_total "$tmp/nan.jsonl")" = 0 ] ||
    fail "NaN: skipped steps survived the rollback: $(field 40:1 skipped_total "$tmp/nan.jsonl")"
echo "ok: NaN streak: rolled back to step 20, data of steps 21-25 skipped, completed"

# 3. bad data that outlasts the skips: two rollbacks, then the job fails
rm -rf "$tmp/ck"
run limit "${ck[@]}" --set train.fault.kind=loss_scale --set train.fault.step=21 \
    --set train.fault.steps=12 --set train.max_rollbacks=2
[ $rc = 2 ] || fail "beyond max_rollbacks: exit $rc, want 2: $(tail -n 3 "$tmp/limit.log")"
grep -q "rollback 2 of 2:" "$tmp/limit.log" || fail "no second rollback"
grep -q "and the job rolled back 2 time(s) already (train.max_rollbacks)" "$tmp/limit.log" ||
    fail "the failure does not name train.max_rollbacks: $(tail -n 2 "$tmp/limit.log")"
echo "ok: max_rollbacks: two rollbacks, then the job failed, saying why"

# 4. no checkpoint to go back to: the step is dropped, training goes on
run nock "${spike[@]}"
[ $rc = 0 ] || fail "no-checkpoint run: exit $rc"
grep -q "no checkpoint from before step 21 to roll back to: step 23 is dropped, training goes on" \
    "$tmp/nock.log" || fail "no-checkpoint message: $(grep -i roll "$tmp/nock.log")"

# 5. rollbacks off: a NaN streak fails as before
run off --set train.max_rollbacks=0 --set train.fault.kind=nan_grad --set train.fault.step=3 \
    --set train.fault.steps=5
[ $rc = 2 ] && grep -q "non-finite in 5 steps in a row (train.max_bad_steps)" "$tmp/off.log" ||
    fail "max_rollbacks 0: exit $rc: $(tail -n 2 "$tmp/off.log")"
echo "ok: without a checkpoint the step is dropped; with rollbacks off a NaN streak fails"
[ -n "${KEEP:-}" ] || rm -rf "$tmp"
