#!/bin/bash
# ckpt_kill.sh BIN_DIR SOURCE_DIR TMP [ROUNDS]
#
# Property: a kill -9 of the saving process at ROUNDS (50) random moments
# never costs the checkpoint history: after every kill the newest committed
# checkpoint verifies (every checksum, coverage, index) and loads into a
# trainer; a partial directory is never taken for a checkpoint; the next run
# removes the leftovers and continues from the newest checkpoint.
#
# The saver trains the tiny model with 64 experts (a checkpoint of 30 MB
# for the compute of 2 active experts) and saves every step (alternately
# asynchronous and synchronous, keep_last 2; every third run every other
# step), so kills land before, during
# and after writes, commits, retention.
set -euo pipefail
bin=$1 src=$2 tmp=$3 rounds=${4:-50}
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"
root="$tmp/root"
RANDOM=20251121

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 8 > /dev/null
job=(--job "$src/deploy/examples/tiny-cpu.json" --threads 2 --set data.path="$tmp/syn"
     --set model.n_routed_experts=64
     --set batch.seq_len=32 --set batch.micro_batch_size=2 --set batch.global_batch_size=2
     --set lr_schedule.warmup_steps=1 --set data.valid_interval=0 --set train.log_interval=1000)

# on failure: what the root held and what the saver and the loader said
trap 'st=$?; if [ $st -ne 0 ]; then ls -la "$root" 2>&1 | tail -n 8; tail -n 5 "$tmp/saver.log" "$tmp/load.log" 2>/dev/null; fi' EXIT
kills=0 during=0 verified=0 empty=0
for ((i = 1; i <= rounds; i++)); do
    init=()
    if [ -n "$("$ck" list "$root" 2> /dev/null)" ]; then
        init=(--set init.kind=checkpoint --set init.path="$root")
    fi
    async=$([ $((i % 2)) -eq 0 ] && echo true || echo false)
    interval=$((1 + (i % 3 == 0)))  # every third round trains a step between saves
    "$bin/tests/ckpt_run" "${job[@]}" "${init[@]}" --set train.steps=100000 \
        --set checkpoint.dir="$root" --set checkpoint.interval=$interval --set checkpoint.keep_last=2 \
        --set checkpoint.async=$async 2> "$tmp/saver.log" &
    pid=$!
    # 0.2 .. 1.7 s: startup, restore, and a few steps with their saves
    sleep "$(printf '%d.%03d' $((RANDOM % 2)) $((RANDOM % 1000)))"
    sleep 0.2
    kill -9 "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
    kills=$((kills + 1))
    if compgen -G "$root/*.partial" > /dev/null; then during=$((during + 1)); fi
    newest=$("$ck" list "$root" | tail -n 1)
    if [ -z "$newest" ]; then empty=$((empty + 1)); continue; fi
    out=$("$ck" verify --quiet "$root" 2>&1) || {
        echo "FAIL round $i: the newest committed checkpoint does not verify:"; echo "$out"; exit 1; }
    [ "$out" = "$root/$newest: OK" ] || { echo "FAIL round $i: verify took '$out', newest is $newest"; exit 1; }
    step=$((10#${newest#step_}))
    "$bin/tests/ckpt_run" "${job[@]}" --set init.kind=checkpoint --set init.path="$root" \
        --set train.steps=$((step + 1)) 2> "$tmp/load.log" || {
        echo "FAIL round $i: $newest does not load:"; cat "$tmp/load.log"; exit 1; }
    grep -q "restored step $step " "$tmp/load.log" || {
        echo "FAIL round $i: loaded something else than $newest:"; cat "$tmp/load.log"; exit 1; }
    verified=$((verified + 1))
done
echo "kill -9 at $kills moments ($during during a save): the newest committed checkpoint" \
     "verified and loaded $verified times ($empty kills before the first commit)"
# the kills must have hit saves in progress, or the test proves nothing
[ "$during" -ge 3 ] || { echo "FAIL: only $during kills landed during a save"; exit 1; }
[ "$verified" -ge $((rounds / 2)) ] || { echo "FAIL: only $verified rounds had a checkpoint"; exit 1; }
trap - EXIT
rm -rf "$tmp"
