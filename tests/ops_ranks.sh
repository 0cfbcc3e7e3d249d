#!/bin/bash
# ops_ranks.sh BIN_DIR SOURCE_DIR TMP [TRIALS]
#
# Property, under mpirun with two ranks of the tiny job:
#   - a rank that stops answering (SIGSTOP: a hung node) ends every rank
#     within train.step_timeout_s (3 s here) plus a few seconds: the step
#     watchdog of the others fires, names the step and the cause, and exits
#     75; no moetraind process is left;
#   - a rank killed (kill -9) at a random moment in the 3 s after a run's
#     first step (steps, saves, commits), TRIALS times (20): every
#     rank is gone within BOUND_S (10 s) each time (the times are printed
#     for the record); --resume auto continues each time, and every step any
#     trial logged has the loss and gradient norm of the uninterrupted
#     two-rank run; the run finally completed has its final checkpoint
#     byte-identical to the uninterrupted run's; mpirun leaves no OpenMPI
#     session folder behind;
#   - the daemon under mpirun: when a non-root rank hangs, a client following
#     the metrics stream (moetrain watch) sees the job FAILED with the
#     watchdog's cause before rank 0 exits 75;
#   - SIGTERM to every rank (as srun and Kubernetes deliver it): both ranks
#     stop at the same step boundary, the checkpoint of that step is saved,
#     exit 0.
set -euo pipefail
bin=$1 src=$2 tmp=$3 trials=${4:-20}
command -v mpirun > /dev/null || { echo "SKIP: no mpirun"; exit 77; }
rm -rf "$tmp" && mkdir -p "$tmp"
d="$bin/service/moetraind"
ck="$bin/ckpt/moetrain-ckpt"
BOUND_S=10
RANDOM=20261126
# long enough that a kill 0-3 s after the first step lands before the end on
# a quiet machine too (40 steps took under 3 s there: most trials completed
# instead of being killed, and too few resumed)
STEPS=120
export OMPI_MCA_orte_tmpdir_base="$tmp/ompi"
mkdir -p "$OMPI_MCA_orte_tmpdir_base"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 200000 --seed 7 > /dev/null
job=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1 --set data.path="$tmp/syn"
     --set batch.seq_len=32 --set batch.micro_batch_size=2 --set batch.global_batch_size=4
     --set lr_schedule.warmup_steps=2 --set data.valid_interval=0 --set train.log_interval=1000
     --set train.steps=$STEPS --set checkpoint.interval=2 --set checkpoint.keep_last=0)
fail() { echo "FAIL: $*"; exit 1; }
mpi() { mpirun --allow-run-as-root --oversubscribe -np 2 "$d" "${job[@]}" "$@"; }
# mpi_bg LOG ARGS...: in the background, mpirun's pid in $mp
mpi_bg() {
    local log=$1; shift
    mpirun --allow-run-as-root --oversubscribe -np 2 "$d" "${job[@]}" "$@" > "$log" 2>&1 &
    mp=$!
}
# the rank pids of mpirun $mp, once both run (20 s at most)
ranks() {
    for _ in $(seq 200); do
        mapfile -t kids < <(pgrep -P "$mp" || true)
        [ "${#kids[@]}" -ge 2 ] && return 0
        kill -0 "$mp" 2> /dev/null || return 1
        sleep 0.1
    done
    fail "mpirun did not start two ranks"
}
# seconds from $t0 until every pid in kids[] and mpirun are gone (BOUND_S + 20 at most)
gone_after() {
    for _ in $(seq $(((BOUND_S + 20) * 20))); do
        local alive=0
        for p in "${kids[@]}" "$mp"; do kill -0 "$p" 2> /dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.05
    done
    for p in "${kids[@]}"; do kill -0 "$p" 2> /dev/null && {
        kill -9 "${kids[@]}" 2> /dev/null; fail "rank pid $p still alive after $((BOUND_S + 20)) s"; }
    done
    echo "$(date +%s.%N) - $t0" | bc
}
# every complete step line of jsonl $1 matches the uninterrupted run's
same_as_ref() {
    /usr/bin/python3 - "$tmp/ref.jsonl" "$1" << 'PY'
import json, sys
def steps(path):
    out = {}
    try:
        lines = open(path).readlines()
    except FileNotFoundError:
        return out  # killed before its first step
    for line in lines:
        try:
            m = json.loads(line)
        except ValueError:
            continue  # the line a kill cut short
        out[m["step"]] = (m["loss"], m["grad_norm"])
    return out
ref, got = steps(sys.argv[1]), steps(sys.argv[2])
bad = [s for s in got if got[s] != ref.get(s)]
if bad:
    print("steps %s differ: %s vs %s" % (bad, [got[s] for s in bad], [ref.get(s) for s in bad]))
    sys.exit(1)
print(len(got))
PY
}

# the uninterrupted two-rank run
mpi --set checkpoint.dir="$tmp/ref" --metrics-jsonl "$tmp/ref.jsonl" > "$tmp/ref.log" 2>&1 ||
    fail "uninterrupted run: $(tail -n 5 "$tmp/ref.log")"
[ "$(wc -l < "$tmp/ref.jsonl")" = $STEPS ] || fail "the uninterrupted run did not log $STEPS steps"

# 1. a hung rank: the watchdog ends every rank
mpi_bg "$tmp/hang.log" --set checkpoint.dir="$tmp/hang" --set train.step_timeout_s=3 \
    --set train.steps=100000 --metrics-jsonl "$tmp/hang.jsonl"
ranks
for _ in $(seq 300); do [ -s "$tmp/hang.jsonl" ] && [ "$(wc -l < "$tmp/hang.jsonl")" -ge 2 ] && break; sleep 0.1; done
victim=${kids[$((RANDOM % 2))]}
t0=$(date +%s.%N)
kill -STOP "$victim"
took=$(gone_after)
rc=0; wait "$mp" || rc=$?
grep -q "has not finished after 3.0 s (train.step_timeout_s): a rank died or a collective stalled; exiting with status 75" \
    "$tmp/hang.log" || fail "no watchdog report: $(tail -n 5 "$tmp/hang.log")"
[ $rc = 75 ] || fail "mpirun exited $rc after the watchdog, want 75"
awk -v t="$took" -v b="$BOUND_S" 'BEGIN { exit !(t < b) }' || fail "a hung rank took $took s to end every rank"
echo "ok: a hung rank (SIGSTOP): every rank gone after $took s (step_timeout_s 3), mpirun exit 75"

# 2. kill -9 of a random rank at random moments; --resume auto each time
times=() restarts=0 completed=0 logged=0
# trial $i finished the job before its kill (a resumed one may be near the
# end): its resume counts, its steps must be the uninterrupted run's, and
# the next trial starts afresh
ended_alone() {
    grep -q "resume auto: continuing from" "$tmp/kill.$i.log" && restarts=$((restarts + 1))
    local n
    n=$(same_as_ref "$tmp/kill.$i.jsonl") || fail "trial $i: $n"
    logged=$((logged + n))
    completed=$((completed + 1)); mv "$tmp/kill" "$tmp/kill.done.$completed"
}
for ((i = 1; i <= trials; i++)); do
    mpi_bg "$tmp/kill.$i.log" --set checkpoint.dir="$tmp/kill" --resume auto \
        --metrics-jsonl "$tmp/kill.$i.jsonl"
    if ! ranks; then
        wait "$mp" || fail "trial $i ended on its own: $(tail -n 5 "$tmp/kill.$i.log")"
        ended_alone; continue
    fi
    # a random moment in the 3 s after the first step: steps, saves, commits
    for _ in $(seq 300); do [ -s "$tmp/kill.$i.jsonl" ] || ! kill -0 "$mp" 2> /dev/null && break; sleep 0.1; done
    sleep "$(printf '%d.%03d' $((RANDOM % 3)) $((RANDOM % 1000)))"
    if ! kill -0 "$mp" 2> /dev/null; then
        wait "$mp" || fail "trial $i failed: $(tail -n 5 "$tmp/kill.$i.log")"
        ended_alone; continue
    fi
    victim=${kids[$((RANDOM % 2))]}
    t0=$(date +%s.%N)
    kill -9 "$victim" 2> /dev/null || true
    took=$(gone_after)
    wait "$mp" 2> /dev/null || true
    times+=("$took")
    awk -v t="$took" -v b="$BOUND_S" 'BEGIN { exit !(t < b) }' || fail "trial $i: $took s until every rank was gone"
    grep -q "resume auto: continuing from" "$tmp/kill.$i.log" && restarts=$((restarts + 1))
    n=$(same_as_ref "$tmp/kill.$i.jsonl") || fail "trial $i: $n"
    logged=$((logged + n))
done
echo "kill -9 trials: every rank gone after: ${times[*]} s"
[ "$restarts" -ge $((trials / 2)) ] || fail "only $restarts trials resumed from a checkpoint"
# finish the job: its final state is the uninterrupted run's
mpi --set checkpoint.dir="$tmp/kill" --resume auto --metrics-jsonl "$tmp/kill.end.jsonl" \
    > "$tmp/kill.end.log" 2>&1 || fail "the final resumed run: $(tail -n 5 "$tmp/kill.end.log")"
same_as_ref "$tmp/kill.end.jsonl" > /dev/null || fail "the final resumed run's losses differ"
last=$(printf 'step_%08d' $STEPS)
"$ck" diff --meta "$tmp/ref/$last" "$tmp/kill/$last" > /dev/null ||
    fail "the final checkpoint differs from the uninterrupted run's"
left=$(find "$OMPI_MCA_orte_tmpdir_base" -mindepth 1 -maxdepth 1 | wc -l)
[ "$left" = 0 ] || fail "$left OpenMPI session folder(s) left in $OMPI_MCA_orte_tmpdir_base"
echo "ok: ${#times[@]} kills, $restarts resumed from a checkpoint, $completed completed runs;" \
     "$logged steps logged by the trials' runs all equal the uninterrupted run's; final checkpoint identical"

# 3. the daemon: rank 0 reports the failure to its clients before it exits
mpirun --allow-run-as-root --oversubscribe -np 2 "$d" --listen 127.0.0.1:0 --workdir "$tmp/wd" \
    --ready-file "$tmp/ready" "${job[@]}" --set checkpoint.dir=ck --set train.steps=100000 \
    --set checkpoint.interval=1 --set train.step_timeout_s=3 > "$tmp/daemon.log" 2>&1 &
mp=$!
ranks
for _ in $(seq 300); do [ -s "$tmp/ready" ] && break; sleep 0.1; done
addr=$(sed -n 's/^grpc=//p' "$tmp/ready")
[ -n "$addr" ] || fail "the daemon did not serve: $(tail -n 5 "$tmp/daemon.log")"
"$bin/service/moetrain" --server "$addr" watch > "$tmp/watch.out" 2>&1 &
wp=$!
for _ in $(seq 300); do [ "$(grep -c '^step ' "$tmp/watch.out")" -ge 2 ] && break; sleep 0.1; done
for k in "${kids[@]}"; do # the rank that is not 0
    tr '\0' '\n' < "/proc/$k/environ" | grep -qx OMPI_COMM_WORLD_RANK=1 && victim=$k
done
kill -STOP "$victim"
rc=0; wait "$mp" || rc=$?
wait "$wp" || true
kill -9 "$victim" 2> /dev/null || true
[ $rc = 75 ] || fail "daemon with a hung rank: mpirun exit $rc, want 75"
grep -q "^-- FAILED: rank 0: step [0-9]* has not finished after 3.0 s (train.step_timeout_s): a rank died or a collective stalled" \
    "$tmp/watch.out" || fail "the client did not see FAILED with the cause: $(tail -n 3 "$tmp/watch.out")"
echo "ok: daemon: the client saw '$(grep '^-- FAILED' "$tmp/watch.out" | cut -c1-60)...' before rank 0 exited 75"

# 4. SIGTERM to every rank, as Slurm and Kubernetes deliver it: one boundary,
# one checkpoint, exit 0. (mpirun's own SIGTERM is no preemption: it waits
# odls_base_sigkill_timeout, signals the ranks and exits 1.)
mpi_bg "$tmp/term.log" --set checkpoint.dir="$tmp/term" --set train.steps=100000 \
    --metrics-jsonl "$tmp/term.jsonl"
ranks
for _ in $(seq 300); do [ -s "$tmp/term.jsonl" ] && [ "$(wc -l < "$tmp/term.jsonl")" -ge 3 ] && break; sleep 0.1; done
kill -TERM "${kids[@]}"
rc=0; wait "$mp" || rc=$?
[ $rc = 0 ] || fail "SIGTERM to the ranks: mpirun exit $rc: $(tail -n 5 "$tmp/term.log")"
s0=$(sed -n 's/.*r0 I .*job tiny-cpu stopped at step \([0-9]*\).*/\1/p' "$tmp/term.log")
s1=$(sed -n 's/.*r1 I .*job tiny-cpu stopped at step \([0-9]*\).*/\1/p' "$tmp/term.log")
[ -n "$s0" ] && [ "$s0" = "$s1" ] || fail "the ranks stopped at steps '$s0' and '$s1'"
[ "$("$ck" list "$tmp/term" | tail -n 1)" = "$(printf 'step_%08d' "$s0")" ] || fail "no checkpoint of step $s0"
echo "ok: SIGTERM to the ranks: both stopped at step $s0, saved, exit 0"
[ -n "${KEEP:-}" ] || rm -rf "$tmp"
