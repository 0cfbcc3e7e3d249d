#!/bin/bash
# ops_resume.sh BIN_DIR SOURCE_DIR TMP
#
# Property: moetraind --resume auto continues from the newest checkpoint in
# checkpoint.dir that verifies, and says which:
#   - with none it starts as init says ("no checkpoint ... verifies");
#   - after losing the newest checkpoints (a crash before they were saved)
#     it continues from the newest left, with the losses of the
#     uninterrupted run and a final checkpoint byte-identical to its;
#   - when the newest is damaged (a flipped byte in a shard) it sets it
#     aside as step_N.damaged, falls back to the one before, and again
#     continues the uninterrupted run's losses;
#   - a bad --resume value is a usage error (exit 1).
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
d="$bin/service/moetraind"
ck="$bin/ckpt/moetrain-ckpt"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 100000 --seed 6 > /dev/null
common=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1
        --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
        --set batch.global_batch_size=4 --set train.steps=8 --set lr_schedule.warmup_steps=2
        --set data.valid_interval=0 --set train.log_interval=100)
fail() { echo "FAIL: $*"; exit 1; }
run() {
    local name=$1; shift
    "$d" "${common[@]}" --metrics-jsonl "$tmp/$name.jsonl" "$@" > "$tmp/$name.log" 2>&1 || {
        cat "$tmp/$name.log"; fail "run $name exited $?"; }
}
losses() { grep -o '"step":[0-9]*\|"loss":[^,]*\|"grad_norm":[^,]*' "$1" | paste -sd' ' | sed 's/ "step"/\n"step"/g'; }
steps_from() { losses "$1" | awk -v s="$2" -F'[:, ]' '$2 >= s'; }
saves=(--set checkpoint.dir="$tmp/b" --set checkpoint.interval=2 --set checkpoint.async=false --set checkpoint.keep_last=0)

# the uninterrupted run
run a
# nothing to resume from: starts from scratch, saying so; losses unchanged
run b --resume auto "${saves[@]}"
grep -q "resume auto: no checkpoint in $tmp/b verifies: starting as init.kind=random" "$tmp/b.log" ||
    fail "no 'no checkpoint' line: $(grep resume "$tmp/b.log")"
[ "$(losses "$tmp/a.jsonl")" = "$(losses "$tmp/b.jsonl")" ] || fail "resume auto changed a fresh run"
[ "$("$ck" list "$tmp/b" | paste -sd' ')" = "step_00000002 step_00000004 step_00000006 step_00000008" ] ||
    fail "saved: $("$ck" list "$tmp/b")"

# a crash after step 5: steps 6 and 8 were never saved
mv "$tmp/b/step_00000008" "$tmp/ref8"
rm -rf "$tmp/b/step_00000006"
run c --resume auto "${saves[@]}"
grep -q "resume auto: continuing from $tmp/b/step_00000004 (step 4)" "$tmp/c.log" ||
    fail "not continued from step 4: $(grep -i resume "$tmp/c.log")"
[ "$(steps_from "$tmp/a.jsonl" 5)" = "$(losses "$tmp/c.jsonl")" ] || {
    diff <(steps_from "$tmp/a.jsonl" 5) <(losses "$tmp/c.jsonl"); fail "resumed losses differ"; }
"$ck" diff --meta "$tmp/ref8" "$tmp/b/step_00000008" > /dev/null ||
    fail "the final checkpoint differs from the uninterrupted run's"

# the newest is damaged: one byte flipped in the middle of its shard
shard="$tmp/b/step_00000008/shard_00000.h5"
size=$(stat -c %s "$shard")
off=$((size / 2))
byte=$(od -An -tu1 -j "$off" -N1 "$shard" | tr -d ' ')
printf "$(printf '\\%03o' $(((byte + 1) % 256)))" | dd of="$shard" bs=1 seek="$off" conv=notrunc status=none
run e --resume auto "${saves[@]}"
grep -q "checkpoint $tmp/b/step_00000008 does not verify" "$tmp/e.log" ||
    fail "the damage was not reported: $(grep -i 'verif\|resume' "$tmp/e.log")"
grep -q "moved to $tmp/b/step_00000008.damaged" "$tmp/e.log" || fail "not set aside"
grep -q "resume auto: continuing from $tmp/b/step_00000006 (step 6)" "$tmp/e.log" ||
    fail "did not fall back to step 6: $(grep -i resume "$tmp/e.log")"
[ -d "$tmp/b/step_00000008.damaged" ] || fail "no step_00000008.damaged"
[ "$(steps_from "$tmp/a.jsonl" 7)" = "$(losses "$tmp/e.jsonl")" ] || fail "losses after the fallback differ"
"$ck" diff --meta "$tmp/ref8" "$tmp/b/step_00000008" > /dev/null ||
    fail "the re-saved step 8 differs from the uninterrupted run's"
[ "$(cat "$tmp/b/latest")" = step_00000008 ] || fail "latest: $(cat "$tmp/b/latest")"

# the job already complete: resumes at step 8 and ends at once
run f --resume auto "${saves[@]}"
grep -q "continuing from $tmp/b/step_00000008 (step 8)" "$tmp/f.log" || fail "complete job: $(cat "$tmp/f.log")"
[ ! -s "$tmp/f.jsonl" ] || fail "a complete job ran steps"

set +e
out=$("$d" "${common[@]}" --resume sometimes 2>&1); rc=$?
set -e
[ $rc = 1 ] && grep -q "resume takes auto or never" <<< "$out" || fail "--resume sometimes: rc $rc: $out"
echo "resume auto: fresh start, fallback over lost and damaged checkpoints, bit-identical losses"
[ -n "${KEEP:-}" ] || rm -rf "$tmp"
