#!/bin/bash
# ckpt_resume.sh BIN_DIR SOURCE_DIR TMP [RUNNER]
#
# Property: continuing from a checkpoint is bit-identical to the
# uninterrupted run (CPU): a run saved at step 4 (async) and resumed to
# step 8 logs the same losses as the run that never stopped, and its final
# checkpoint (weights, FP8 scales, optimizer state, router biases, step,
# data position) is byte-identical to the uninterrupted run's; the same for
# a synchronous save taken when the job is stopped by SIGTERM (save_on_stop);
# saving does not perturb training.
#
# RUNNER (default BIN_DIR/tests/ckpt_run) is the program that runs the job;
# with moetraind, the test is skipped (77) when that build does not write
# checkpoints yet.
set -euo pipefail
bin=$1 src=$2 tmp=$3
runner=${4:-$bin/tests/ckpt_run}
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 100000 --seed 6 > /dev/null
common=(--job "$src/deploy/examples/tiny-cpu.json" --threads 2
        --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
        --set batch.global_batch_size=4 --set train.steps=8 --set lr_schedule.warmup_steps=2
        --set data.valid_interval=4 --set data.valid_batches=2 --set train.log_interval=100)
run() {
    local name=$1; shift
    "$runner" "${common[@]}" --metrics-jsonl "$tmp/$name.jsonl" "$@" 2> "$tmp/$name.log" || {
        cat "$tmp/$name.log"; exit 1; }
}
losses() { grep -o '"step":[0-9]*\|"loss":[^,]*\|"valid_loss":[^,]*\|"grad_norm":[^,]*' "$1" | paste -sd' ' | sed 's/ "step"/\n"step"/g'; }
steps_from() { losses "$1" | awk -v s="$2" -F'[:, ]' '$2 >= s'; }

# uninterrupted
run a
# saved at 4 and 8 in the background
run b --set checkpoint.dir="$tmp/b" --set checkpoint.interval=4 --set checkpoint.async=true
if [ ! -d "$tmp/b/step_00000004" ]; then
    if [ "$runner" != "$bin/tests/ckpt_run" ]; then
        echo "SKIP: $runner does not write checkpoints yet"; exit 77
    fi
    echo "FAIL: no checkpoint written"; exit 1
fi
[ "$(losses "$tmp/a.jsonl")" = "$(losses "$tmp/b.jsonl")" ] || { echo "FAIL: saving changed the losses"; exit 1; }
# resumed from step 4
run c --set init.kind=checkpoint --set init.path="$tmp/b/step_00000004" \
    --set checkpoint.dir="$tmp/c" --set checkpoint.interval=4
[ "$(steps_from "$tmp/a.jsonl" 5)" = "$(losses "$tmp/c.jsonl")" ] || {
    echo "FAIL: resumed losses differ"; diff <(steps_from "$tmp/a.jsonl" 5) <(losses "$tmp/c.jsonl"); exit 1; }
[ "$(losses "$tmp/c.jsonl" | wc -l)" -eq 4 ] || { echo "FAIL: the resumed run did not run steps 5-8"; exit 1; }
"$ck" diff --meta "$tmp/b/step_00000008" "$tmp/c/step_00000008" > /dev/null || {
    echo "FAIL: the final state of the resumed run differs"; exit 1; }

# stopped by SIGTERM after step 3 or so, saving on stop (sync); resumed from the root.
# The signal races the run's last steps (a few ms each): when the run has
# already finished all 8 steps before it arrives, that attempt did not test
# a stop, so it is repeated (at most 5 times); a run stopped early that
# wrote nothing fails at once.
stopped=
for attempt in 1 2 3 4 5; do
    rm -rf "$tmp/d" "$tmp/d.jsonl"
    "$runner" "${common[@]}" --metrics-jsonl "$tmp/d.jsonl" --set checkpoint.dir="$tmp/d" \
        --set checkpoint.save_on_stop=true --set checkpoint.async=false 2> "$tmp/d.log" &
    pid=$!
    for _ in $(seq 600); do
        [ -f "$tmp/d.jsonl" ] && [ "$(wc -l < "$tmp/d.jsonl")" -ge 3 ] && break
        sleep 0.05
    done
    kill -TERM "$pid" 2> /dev/null || true  # it may have ended already
    wait "$pid" || { echo "FAIL: the stopped run failed"; cat "$tmp/d.log"; exit 1; }
    stopped=$("$ck" list "$tmp/d" | tail -n 1)
    [ -n "$stopped" ] && break
    grep -q '"step":8[,}]' "$tmp/d.jsonl" || { echo "FAIL: no checkpoint on stop"; cat "$tmp/d.log"; exit 1; }
    echo "attempt $attempt: the run finished before SIGTERM arrived; again"
done
[ -n "$stopped" ] || { echo "FAIL: no run was stopped before its end in 5 attempts"; exit 1; }
s=$((10#${stopped#step_}))
[ "$s" -ge 3 ] && [ "$s" -lt 8 ] || { echo "FAIL: stopped at step $s"; exit 1; }
run e --set init.kind=checkpoint --set init.path="$tmp/d" --set checkpoint.dir="$tmp/d" \
    --set checkpoint.interval=8
[ "$(steps_from "$tmp/a.jsonl" $((s + 1)))" = "$(losses "$tmp/e.jsonl")" ] || {
    echo "FAIL: losses after stop/resume differ"; exit 1; }
"$ck" diff --meta "$tmp/b/step_00000008" "$tmp/d/step_00000008" > /dev/null || {
    echo "FAIL: the final state after stop/resume differs"; exit 1; }
echo "resume: bit-identical to the uninterrupted run (async save, stop + sync save)"
rm -rf "$tmp"
