#!/usr/bin/env bash
# test_service_mpi.sh - moetraind on 2 MPI ranks, driven over gRPC by the
# moetrain CLI (issue 13's service scenario). Properties:
#   - StartJob with parallel.dp=2 runs on both ranks; pause stops the step
#     on both, save writes a checkpoint holding the shard files of both
#     ranks (and its save time and verify result are listed), resume goes
#     on, stop --save ends it with a final checkpoint;
#   - status shows 2 ranks with each rank's step time and memory and names
#     the slowest; /metrics has them per rank, and the per-expert loads;
#     /api/experts has every MoE layer's loads (the heat map);
#   - a job started from the last checkpoint continues at its step on the
#     2 ranks;
#   - StartJob with a setting not implemented across ranks (bf16 gradient
#     accumulators with dp = 2) is refused at admission with
#     INVALID_ARGUMENT naming precision.grads, and the daemon stays IDLE;
#   - SIGTERM ends every rank (mpirun exits 0).
# Loopback only, ports picked by the daemon. Exit 77 without mpirun.
#
#   test_service_mpi.sh BUILD_DIR JOB_JSON SCRATCH_DIR
set -euo pipefail

build=$1
job=$2
tmp=$3
command -v mpirun > /dev/null || { echo "SKIP: no mpirun"; exit 77; }
daemon="$build/service/moetraind"
cli_bin="$build/service/moetrain"
py=/usr/bin/python3

rm -rf "$tmp"
mkdir -p "$tmp"
"$build/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 1 > /dev/null

mpid=
cleanup() { [ -z "$mpid" ] || kill -KILL "$mpid" 2> /dev/null || true; }
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  echo "---- daemon log" >&2
  tail -n 40 "$tmp/daemon.log" >&2 || true
  exit 1
}

OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 "$daemon" \
  --listen 127.0.0.1:0 --http 127.0.0.1:0 --workdir "$tmp/wd" --ready-file "$tmp/ready" \
  --threads 1 > "$tmp/daemon.log" 2>&1 &
mpid=$!
for _ in $(seq 600); do
  [ -f "$tmp/ready" ] && break
  kill -0 "$mpid" 2> /dev/null || fail "mpirun moetraind exited at start"
  sleep 0.1
done
[ -f "$tmp/ready" ] || fail "moetraind did not become ready"
grpc=$(sed -n 's/^grpc=//p' "$tmp/ready")
http=$(sed -n 's/^http=//p' "$tmp/ready")

cli() { "$cli_bin" --server "$grpc" --timeout 60 "$@"; }
# A value of `moetrain status --json` by a Python expression over `s`.
status_py() { cli status --json | "$py" -c 'import json,sys; s=json.load(sys.stdin); print(eval(sys.argv[1]))' "$1"; }
step() { status_py 'int(s.get("step", 0))'; }
wait_step_above() { # STEP SECONDS
  local deadline=$((SECONDS + $2))
  while [ "$(step)" -le "$1" ]; do
    [ $SECONDS -lt $deadline ] || fail "the step did not pass $1 within $2 s"
    sleep 0.2
  done
}
http_get() { "$py" -c 'import sys,urllib.request; print(urllib.request.urlopen("http://" + sys.argv[1], timeout=10).read().decode())' "$http$1"; }

t0=$SECONDS
[ "$(status_py 's["ranks"]')" = 2 ] || fail "status does not say 2 ranks"
sets=(--set "data.path=$tmp/syn" --set parallel.dp=2 --set train.steps=100000
  --set batch.seq_len=32 --set data.valid_interval=0 --set train.log_interval=1000
  --set lr_schedule.warmup_steps=10)

# ---- a dp=2 job
out=$(cli start "$job" "${sets[@]}") || fail "start: $out"
echo "$out" | grep -q "started job tiny-cpu (run 1) at step 0 of 100000" || fail "start said: $out"
wait_step_above 2 60
[ "$(status_py 's["layout"]["dp"]')" = 2 ] || fail "the job's layout is not dp=2"
# every rank's step time and memory, the slowest named
check=$(status_py '("ok" if len(s["rankStats"]) == 2 and [r.get("rank", 0) for r in s["rankStats"]] == [0, 1]
  and all(int(r["memInUse"]) > 0 and int(r["memPeak"]) >= int(r["memInUse"]) and r["stepMs"] > 0
          and 0 < r["computeMs"] <= r["stepMs"] and int(r["step"]) > 0 for r in s["rankStats"])
  and s.get("slowestRank", 0) in (0, 1) else s.get("rankStats"))') || fail "status --json"
[ "$check" = ok ] || fail "rank stats: $check"
out=$(cli status) || fail "status: $out"
[ "$(echo "$out" | grep -c '^rank [01] ')" = 2 ] || fail "status text lacks a line per rank: $out"
echo "$out" | grep -q "<- slowest" || fail "status text names no slowest rank: $out"
page=$(http_get /metrics)
for m in 'moetrain_ranks 2' 'moetrain_rank_memory_in_use_bytes{rank="1"} ' \
  'moetrain_rank_compute_duration_seconds{rank="0"} ' 'moetrain_slowest_rank ' \
  'moetrain_expert_tokens{layer="1",expert="7"} ' 'moetrain_router_bias{layer="2",expert="0"} '; do
  echo "$page" | grep -qF "$m" || fail "/metrics lacks $m"
done
check=$(http_get /api/experts | "$py" -c 'import json,sys; e=json.load(sys.stdin)
L=e["layers"]
print("ok" if e["step"] > 0 and e["experts"] == 8 and [l["layer"] for l in L] == [1, 2]
      and all(len(l["load"]) == 8 and len(l["bias"]) == 8 for l in L)
      else e)')
[ "$check" = ok ] || fail "/api/experts: $check"

# ---- pause, save (both ranks' shards), resume
out=$(cli pause) || fail "pause: $out"
paused=$(echo "$out" | sed -n 's/^paused at step \([0-9]*\)$/\1/p')
[ -n "$paused" ] || fail "pause said: $out"
sleep 1
[ "$(step)" = "$paused" ] || fail "the step moved while paused"
out=$(cli save) || fail "save: $out"
echo "$out" | grep -q "saved checkpoint step_0*$paused at step $paused" || fail "save said: $out"
ck=$(printf '%s/wd/checkpoints/tiny-cpu/step_%08d' "$tmp" "$paused")
for f in index.h5 shard_00000.h5 shard_00001.h5; do
  [ -s "$ck/$f" ] || fail "the checkpoint lacks $f: $(ls "$ck")"
done
deadline=$((SECONDS + 30))
until out=$(cli checkpoints) && echo "$out" | grep "step_0*$paused " | grep -q "verify ok"; do
  [ $SECONDS -lt $deadline ] || fail "the save was not verified: $out"
  sleep 0.3
done
echo "$out" | grep "step_0*$paused " | grep -q "dp=2 (1f1b); written in [0-9]* ms (training stalled [0-9]* ms)" ||
  fail "the listing lacks the save's layout and times: $out"
out=$(cli resume) || fail "resume: $out"
[ "$out" = "resumed at step $paused" ] || fail "resume said: $out"
wait_step_above "$paused" 60

# ---- stop with a final checkpoint, start again from it
out=$(cli stop --save) || fail "stop: $out"
stopped=$(echo "$out" | sed -n 's/^stopped at step \([0-9]*\); checkpoint step_[0-9]* saved.*/\1/p')
[ -n "$stopped" ] || fail "stop said: $out"
[ "$(status_py 's["state"]')" = JOB_STATE_IDLE ] || fail "not IDLE after stop"
out=$(cli start "$job" "${sets[@]}" --from-checkpoint latest) || fail "start from checkpoint: $out"
echo "$out" | grep -q "started job tiny-cpu (run 2) at step $stopped of 100000" ||
  fail "start from checkpoint said: $out"
wait_step_above "$stopped" 60
out=$(cli stop) || fail "second stop: $out"

# ---- a setting the trainer does not run on these ranks: refused at admission
set +e
out=$(cli start "$job" "${sets[@]}" --set precision.grads=bf16 2>&1)
rc=$?
set -e
[ $rc = 3 ] && echo "$out" | grep -q "INVALID_ARGUMENT: .*precision.grads.*bf16 runs on one rank only" ||
  fail "precision.grads=bf16 x dp=2: rc $rc: $out"
[ "$(status_py 's["state"] + " " + s["runId"]')" = "JOB_STATE_IDLE 2" ] ||
  fail "a refused start changed the state or the run: $(cli status)"

# ---- SIGTERM: every rank ends, mpirun exits 0
kill -TERM "$(sed -n 's/^pid=//p' "$tmp/ready")"
rc=0
wait "$mpid" || rc=$?
mpid=
[ $rc = 0 ] || fail "mpirun moetraind exited $rc on SIGTERM"
grep -q "r1 I .*job tiny-cpu stopped at step" "$tmp/daemon.log" || fail "rank 1 did not log the stop"
echo "service on 2 ranks: all checks passed in $((SECONDS - t0)) s"
rm -rf "$tmp"
