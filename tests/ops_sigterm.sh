#!/bin/bash
# ops_sigterm.sh BIN_DIR SOURCE_DIR TMP
#
# Property: SIGTERM (Slurm preemption, a pod's deletion) ends a job cleanly:
#   - the step in progress finishes, a checkpoint of that step is saved and
#     moetraind exits 0 well within train.term_grace_s; --resume auto then
#     continues with the losses of the uninterrupted run;
#   - when the save would end after the grace period (the last save's time
#     says so) it exits 75 without saving and says why; the newest committed
#     checkpoint is untouched;
#   - when the step in progress itself outlasts the grace period, the
#     backstop ends the process at the deadline with 75, saying so.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
d="$bin/service/moetraind"
ck="$bin/ckpt/moetrain-ckpt"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 200000 --seed 7 > /dev/null
common=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1
        --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
        --set batch.global_batch_size=4 --set lr_schedule.warmup_steps=2
        --set data.valid_interval=0 --set train.log_interval=100)
fail() { echo "FAIL: $*"; exit 1; }
losses() { grep -o '"step":[0-9]*\|"loss":[^,]*\|"grad_norm":[^,]*' "$1" | paste -sd' ' | sed 's/ "step"/\n"step"/g'; }
steps_from() { losses "$1" | awk -v s="$2" -F'[:, ]' '$2 >= s'; }
# start NAME ARGS...: moetraind in the background, its pid in $pid
start() {
    local name=$1; shift
    "$d" "${common[@]}" --metrics-jsonl "$tmp/$name.jsonl" "$@" > "$tmp/$name.log" 2>&1 &
    pid=$!
}
# until FILE has N lines (60 s at most)
wait_lines() {
    for _ in $(seq 600); do
        [ -f "$1" ] && [ "$(wc -l < "$1")" -ge "$2" ] && return 0
        kill -0 "$pid" 2> /dev/null || fail "moetraind ended early: $(tail -n 5 "$tmp"/*.log)"
        sleep 0.1
    done
    fail "no $2 steps in $1"
}
# term: SIGTERM, then the exit status in $rc and the seconds it took in $took
term() {
    local t0; t0=$(date +%s.%N)
    kill -TERM "$pid" 2> /dev/null || true  # it may have ended already
    rc=0; wait "$pid" || rc=$?
    took=$(echo "$(date +%s.%N) - $t0" | bc)
}

# the uninterrupted run
"$d" "${common[@]}" --set train.steps=12 --metrics-jsonl "$tmp/a.jsonl" > "$tmp/a.log" 2>&1 ||
    fail "uninterrupted run: $(tail -n 5 "$tmp/a.log")"

# 1. SIGTERM mid-run: saves the step it stopped at, exits 0 within the grace period.
# The signal races the run's last steps: an attempt whose run logged all 12
# steps before the signal arrived tested no stop and is repeated (5 at most).
for attempt in 1 2 3 4 5; do
    rm -rf "$tmp/b" "$tmp/b.jsonl"
    start b --set train.steps=12 --set checkpoint.dir="$tmp/b" --set checkpoint.interval=2 \
        --set checkpoint.keep_last=0
    wait_lines "$tmp/b.jsonl" 3
    term
    [ $rc = 0 ] && [ "$(wc -l < "$tmp/b.jsonl")" -eq 12 ] && ! grep -q "SIGTERM" "$tmp/b.log" ||
        break
    echo "attempt $attempt: the run finished before SIGTERM arrived; again"
done
[ $rc = 0 ] || fail "SIGTERM with time to save: exit $rc: $(tail -n 5 "$tmp/b.log")"
grep -q "SIGTERM: stopping at this step boundary: .* saving" "$tmp/b.log" || fail "no decision logged"
s=$(wc -l < "$tmp/b.jsonl")
newest=$("$ck" list "$tmp/b" | tail -n 1)
[ "$newest" = "$(printf 'step_%08d' "$s")" ] || fail "stopped after step $s, newest checkpoint $newest"
"$ck" verify --quiet "$tmp/b/$newest" > /dev/null || fail "$newest does not verify"
awk -v t="$took" 'BEGIN { exit !(t < 25) }' || fail "took $took s, the grace period is 25 s"
echo "ok: SIGTERM after step $s: saved $newest, exit 0 in $took s"
"$d" "${common[@]}" --set train.steps=12 --set checkpoint.dir="$tmp/b" --resume auto \
    --metrics-jsonl "$tmp/c.jsonl" > "$tmp/c.log" 2>&1 || fail "resume: $(tail -n 5 "$tmp/c.log")"
[ "$(steps_from "$tmp/a.jsonl" $((s + 1)))" = "$(losses "$tmp/c.jsonl")" ] ||
    fail "the resumed losses differ from the uninterrupted run's"
echo "ok: resumed from step $s with the uninterrupted run's losses"

# 2. a grace period shorter than a save: exit 75, nothing saved, newest untouched
start e --set train.steps=100000 --set checkpoint.dir="$tmp/e" --set checkpoint.interval=2 \
    --set train.term_grace_s=0.5
wait_lines "$tmp/e.jsonl" 3
term
[ $rc = 75 ] || fail "SIGTERM without time to save: exit $rc, want 75: $(tail -n 5 "$tmp/e.log")"
grep -q "would end after the grace period of 0.5 s: exiting without a checkpoint" "$tmp/e.log" ||
    fail "the reason is not logged: $(grep SIGTERM "$tmp/e.log")"
grep -q "stopped by SIGTERM without saving a checkpoint" "$tmp/e.log" || fail "no final word"
s=$(wc -l < "$tmp/e.jsonl")
newest=$("$ck" list "$tmp/e" | tail -n 1)
[ "$newest" = "$(printf 'step_%08d' $((s - s % 2)))" ] || fail "after step $s the newest is $newest"
echo "ok: grace period too short: exit 75 after step $s, newest stays $newest"

# 3. a step longer than the grace period: the backstop ends it at the deadline
start f --set train.steps=100000 --set checkpoint.dir="$tmp/f" --set batch.seq_len=1024 \
    --set batch.micro_batch_size=8 --set batch.global_batch_size=16 --set train.term_grace_s=0.3
wait_lines "$tmp/f.jsonl" 1
term
[ $rc = 75 ] || fail "backstop: exit $rc, want 75: $(tail -n 5 "$tmp/f.log")"
grep -q "the grace period of 0.3 s (train.term_grace_s) is over" "$tmp/f.log" ||
    fail "the backstop did not say why: $(tail -n 3 "$tmp/f.log")"
[ "$(wc -l < "$tmp/f.jsonl")" -eq 1 ] || fail "a step finished after the deadline"
echo "ok: a step outlasting the grace period: ended by the backstop in $took s, exit 75"
[ -n "${KEEP:-}" ] || rm -rf "$tmp"
