#!/bin/bash
# ops_slurm.sh BIN_DIR SOURCE_DIR TMP
#
# Property: under a real (local, single-node) Slurm, deploy/slurm/moetrain.sbatch
# runs two ranks of the tiny job through srun, and when a rank is killed
# (SIGKILL) mid-run the job is requeued, the requeued start resumes from the
# newest checkpoint (--resume auto), and every step either start logged has
# the loss and gradient norm of the uninterrupted two-rank run (mpirun), bit
# for bit; the final checkpoint equals the uninterrupted run's.
#
# The cluster lives under TMP: munged on its own socket with a fresh key,
# slurmctld and slurmd in the foreground (-D) with their state, spool, logs
# and ports there; no cgroups (proctrack/linuxproc, task/none), SlurmUser
# root. Slurm 22.05 has no CgroupPlugin=disabled, so no cgroup.conf is
# written: slurmd's cgroup autodetection only has to initialise.
# Skipped (77) without slurm-wlm and munge, or when not root.
set -uo pipefail
bin=$(cd "$1" && pwd) src=$(cd "$2" && pwd) tmp=$3
for c in slurmctld slurmd munged munge sbatch srun scontrol squeue mpirun; do
    command -v "$c" > /dev/null || { echo "SKIP: no $c (apt-get install slurm-wlm munge)"; exit 77; }
done
[ "$(id -u)" = 0 ] || { echo "SKIP: the local Slurm runs its daemons as root"; exit 77; }
rm -rf "$tmp" && mkdir -p "$tmp"
tmp=$(cd "$tmp" && pwd)
d="$bin/service/moetraind"
ck="$bin/ckpt/moetrain-ckpt"
STEPS=30
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
fails=0
now() { date +%s.%N; }
since() { printf '%.1f' "$(echo "$(now) - $1" | bc)"; }

# ---- the cluster -------------------------------------------------------------------------
host=$(hostname -s)
ncpu=$(getconf _NPROCESSORS_ONLN) # (nproc obeys OMP_NUM_THREADS)
mkdir -p "$tmp/munge" "$tmp/state" "$tmp/spool" "$tmp/log" "$tmp/submit"
chmod 700 "$tmp/munge"
head -c 1024 /dev/urandom > "$tmp/munge/munge.key"
chmod 400 "$tmp/munge/munge.key"
sock="$tmp/munge/sock"
. "$src/tests/ports_lib.sh" # free_ports
export SLURM_CONF="$tmp/slurm.conf"
write_conf() {
cat > "$SLURM_CONF" << EOF
ClusterName=moetrain-test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
SlurmctldPort=$port
SlurmdPort=$((port + 1))
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=30
MinJobAge=600
NodeName=$host CPUs=$ncpu State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}
daemons=()
stop_all() {
    [ -n "${job_id:-}" ] && scancel "$job_id" 2> /dev/null
    # the job's processes end before the daemons that would reap them
    for _ in $(seq 100); do
        [ -z "${job_id:-}" ] && break
        squeue -h -j "$job_id" 2> /dev/null | grep -q . || break
        sleep 0.1
    done
    for p in "${daemons[@]}"; do kill -TERM "$p" 2> /dev/null; done
    for p in "${daemons[@]}"; do
        for _ in $(seq 100); do kill -0 "$p" 2> /dev/null || break; sleep 0.1; done
        kill -9 "$p" 2> /dev/null
    done
    [ -n "${mp:-}" ] && kill -9 "$mp" 2> /dev/null
}
trap stop_all EXIT
munged -F --force --socket="$sock" --key-file="$tmp/munge/munge.key" --log-file="$tmp/log/munged.log" \
    --pid-file="$tmp/munge/pid" --seed-file="$tmp/munge/seed" 2> "$tmp/log/munged.err" &
daemons+=($!)
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
munge -S "$sock" -n | unmunge -S "$sock" > /dev/null 2>&1 ||
    { echo "FAIL: munged does not answer: $(cat "$tmp/log/munged.log" "$tmp/log/munged.err")"; exit 1; }
# The controller and the node daemon; started again on other ports (at
# most 3 times) if one of them found its port taken after all.
for attempt in 1 2 3; do
    port=$(free_ports 2)
    [ -n "$port" ] || { echo "FAIL: no two free ports below the ephemeral range"; exit 1; }
    write_conf
    rm -rf "$tmp/state"/* "$tmp/spool"/*
    slurmctld -D -i > "$tmp/log/slurmctld.out" 2>&1 &
    ctld=$!
    slurmd -D > "$tmp/log/slurmd.out" 2>&1 &
    sd=$!
    daemons+=("$ctld" "$sd")
    for _ in $(seq 300); do [ "$(sinfo -h -n "$host" -o %t 2> /dev/null)" = idle ] && break; sleep 0.1; done
    [ "$(sinfo -h -n "$host" -o %t 2> /dev/null)" = idle ] && break
    if [ "$attempt" -lt 3 ] && grep -q "Address already in use" "$tmp/log/slurmctld.out" "$tmp/log/slurmd.out"; then
        echo "attempt $attempt: port $port or $((port + 1)) was taken; again"
        for p in "$ctld" "$sd"; do kill -TERM "$p" 2> /dev/null; done
        for p in "$ctld" "$sd"; do
            for _ in $(seq 100); do kill -0 "$p" 2> /dev/null || break; sleep 0.1; done
            kill -9 "$p" 2> /dev/null
        done
        continue
    fi
    echo "FAIL: the node is not idle: $(sinfo 2>&1)"
    tail -n 5 "$tmp/log/slurmctld.log" "$tmp/log/slurmd.log" "$tmp/log/slurmctld.out" "$tmp/log/slurmd.out"
    exit 1
done
srun --mpi=list 2>&1 | grep -qw pmix || { echo "FAIL: srun has no pmix plugin: $(srun --mpi=list 2>&1)"; exit 1; }
echo "ok: a local Slurm ($(slurmctld -V)) on $host with $ncpu CPUs, munge auth, no cgroups"

# ---- the tiny job ---------------------------------------------------------------------------
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 200000 --seed 8 > /dev/null
/usr/bin/python3 - "$src/deploy/examples/tiny-cpu.json" "$tmp/job.json" "$tmp/syn" "$STEPS" << 'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j["data"]["path"] = sys.argv[3]
j["data"]["valid_interval"] = 0
j["batch"] = {"micro_batch_size": 2, "global_batch_size": 4, "seq_len": 32}
j["lr_schedule"]["warmup_steps"] = 2
j["train"]["steps"] = int(sys.argv[4])
j["train"]["log_interval"] = 1000
j["checkpoint"] = {"dir": "checkpoints/tiny-cpu", "interval": 2, "keep_last": 0}
json.dump(j, open(sys.argv[2], "w"))
PY
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/token"
chmod 600 "$tmp/token"

# the uninterrupted two-rank run
export OMPI_MCA_orte_tmpdir_base="$tmp/ompi"
mkdir -p "$OMPI_MCA_orte_tmpdir_base"
t=$(now)
mpirun --allow-run-as-root --oversubscribe -np 2 "$d" --job "$tmp/job.json" --threads 1 \
    --set checkpoint.dir="$tmp/ref" --metrics-jsonl "$tmp/ref.jsonl" > "$tmp/ref.log" 2>&1 ||
    { echo "FAIL: the uninterrupted run: $(tail -n 5 "$tmp/ref.log")"; exit 1; }
[ "$(wc -l < "$tmp/ref.jsonl")" = "$STEPS" ] || { echo "FAIL: the uninterrupted run logged $(wc -l < "$tmp/ref.jsonl") steps"; exit 1; }
echo "ok: the uninterrupted run under mpirun -np 2: $STEPS steps in $(since "$t") s"

# moetraind as the launcher runs it, plus a metrics file per rank and start,
# and its pid (the rank to kill)
cat > "$tmp/moetraind" << EOF
#!/bin/bash
echo \$\$ > "$tmp/pid.\$MOETRAIN_RANK.\${SLURM_RESTART_COUNT:-0}"
exec "$d" "\$@" --metrics-jsonl "$tmp/m.\$MOETRAIN_RANK.\${SLURM_RESTART_COUNT:-0}.jsonl"
EOF
chmod +x "$tmp/moetraind"

# ---- sbatch, a kill, the requeue, the resume ---------------------------------------------------
# The script's #SBATCH defaults are for GPU nodes; this node may have fewer
# CPUs than ranks (--overcommit) and has no GPUs: the command line
# overrides them, as the script says to.
t0=$(now)
job_id=$(cd "$tmp/submit" && env MOETRAIN_DEPLOY="$src/deploy" MOETRAIN_JOB="$tmp/job.json" \
    MOETRAIN_WORKDIR="$tmp/wd" MOETRAIN_TOKEN_FILE="$tmp/token" MOETRAIND="$tmp/moetraind" \
    MOETRAIN_THREADS=1 MOETRAIN_GRPC_PORT=$((port + 2)) MOETRAIN_HTTP_PORT=$((port + 3)) \
    sbatch --parsable --ntasks=2 --ntasks-per-node=2 --cpus-per-task=1 --overcommit --gpus-per-task=0 \
    "$src/deploy/slurm/moetrain.sbatch") || { echo "FAIL: sbatch refused the script"; exit 1; }
out="$tmp/submit/moetrain-$job_id.out"
state() { scontrol show job "$job_id" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
restarts() { scontrol show job "$job_id" 2> /dev/null | sed -n 's/.*Restarts=\([0-9]*\).*/\1/p'; }
ckpts() { "$ck" list "$tmp/wd/checkpoints/tiny-cpu" 2> /dev/null | wc -l; }
# the first start: let it save twice, then kill rank 1
for _ in $(seq 1200); do
    [ "$(ckpts)" -ge 2 ] && [ -s "$tmp/pid.1.0" ] && break
    case "$(state)" in COMPLETED | FAILED | CANCELLED) break ;; esac
    [ "$(state)" = PENDING ] && [ "$(since "$t0" | cut -d. -f1)" -gt 30 ] && break
    sleep 0.1
done
if [ "$(ckpts)" -lt 2 ] || [ ! -s "$tmp/pid.1.0" ]; then
    echo "FAIL: the first start did not save twice (state $(state)): $(tail -n 8 "$out" 2> /dev/null)"
    tail -n 5 "$tmp/log/slurmd.log"; exit 1
fi
echo "ok: job $job_id running: 2 ranks, $(ckpts) checkpoints after $(since "$t0") s"
kill -9 "$(cat "$tmp/pid.1.0")"
tk=$(now)
killed_at=$(wc -l < "$tmp/m.0.0.jsonl")
echo "ok: rank 1 (pid $(cat "$tmp/pid.1.0")) killed with SIGKILL after rank 0 logged $killed_at steps"
# Slurm requeues it (the batch script's scontrol requeue on 75 or 128+signal) ...
for _ in $(seq 600); do [ "$(restarts)" -ge 1 ] && break; sleep 0.1; done
if [ "$(restarts)" -lt 1 ]; then
    fail "not requeued after the kill (state $(state)):"; tail -n 12 "$out"; exit 1
fi
echo "ok: requeued $(since "$tk") s after the kill: $(grep 'moetrain.sbatch: the ranks exited\|requeueing' "$out" | paste -sd' ')"
# ... and holds it (BeginTime: now + about 121 s in Slurm 22.05), the time
# the node needs to end the old start: started at once (scontrol update
# StartTime=now) it fails with "Job credential revoked" or PMIx's socket of
# the old step still bound, so the test waits as an operator would
for _ in $(seq 4000); do
    [ "$(state)" = RUNNING ] && [ -z "${tr:-}" ] && tr=$(now) && echo "ok: the requeued start began $(since "$tk") s after the kill"
    case "$(state)" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
    grep -q "r0 I .*job tiny-cpu completed $STEPS steps" "$out" 2> /dev/null && break
    sleep 0.1
done
grep -q "r0 I .*job tiny-cpu completed $STEPS steps" "$out" ||
    { fail "the requeued start did not complete $STEPS steps (state $(state)):"; tail -n 15 "$out"; }
echo "ok: the requeued start completed $STEPS steps $(since "$tk") s after the kill, $(since "$t0") s after sbatch"
# the launcher runs moetraind --exit-when-done: the ranks exit 0 once the
# job has completed, and so does the Slurm job
for _ in $(seq 300); do case "$(state)" in RUNNING | COMPLETING) sleep 0.1 ;; *) break ;; esac; done
st=$(state)
[ "$st" = COMPLETED ] || fail "the Slurm job is $st after its training completed, not COMPLETED"
echo "ok: Slurm job state $st"
grep -q "^moetrain.sbatch: job $job_id (start 2)" "$out" || fail "no second start in $out"
from=$(sed -n "s|.*resume auto: continuing from $tmp/wd/checkpoints/tiny-cpu/step_0*\([0-9]*\) (step .*|\1|p" "$out" | tail -n 1)
[ -n "$from" ] || fail "the second start did not resume: $(grep -i 'resume auto' "$out")"
echo "ok: the second start resumed from step ${from:-?}"

# ---- the losses ------------------------------------------------------------------------------
/usr/bin/python3 - "$tmp/ref.jsonl" "$tmp/m.0.0.jsonl" "$tmp/m.0.1.jsonl" "${from:-0}" "$STEPS" << 'PY' ||
import json, sys
def steps(path):
    out = {}
    for line in open(path):
        try:
            m = json.loads(line)
        except ValueError:
            continue  # the line a kill cut short
        out[m["step"]] = (m["loss"], m["grad_norm"])
    return out
ref, first, second = (steps(p) for p in sys.argv[1:4])
frm, n = int(sys.argv[4]), int(sys.argv[5])
bad = False
for name, got in (("first start", first), ("requeued start", second)):
    diff = [s for s in sorted(got) if got[s] != ref.get(s)]
    if diff:
        print("FAIL: %s: steps %s differ: %s vs %s" % (name, diff, [got[s] for s in diff], [ref.get(s) for s in diff]))
        bad = True
if sorted(second) != list(range(frm + 1, n + 1)):
    print("FAIL: the requeued start logged steps %s, want %d..%d" % (sorted(second), frm + 1, n))
    bad = True
if bad:
    sys.exit(1)
s = sorted(second)
print("ok: losses: the first start's %d steps and the requeued start's steps %d..%d (%d) equal the "
      "uninterrupted run's bit for bit; e.g. step %d loss %.6f grad_norm %.6f, step %d loss %.6f"
      % (len(first), s[0], s[-1], len(s), s[0], second[s[0]][0], second[s[0]][1], s[-1], second[s[-1]][0]))
PY
    fail "losses differ from the uninterrupted run's"
last=$(printf 'step_%08d' "$STEPS")
"$ck" diff --meta "$tmp/ref/$last" "$tmp/wd/checkpoints/tiny-cpu/$last" > /dev/null ||
    fail "the final checkpoint differs from the uninterrupted run's"
# Known gap (reported, not yet fixed): the script removes the session
# folders in its EXIT trap with srun, which cannot run when Slurm itself
# ends the job (requeue, scancel): noted, not failed, until the script or an
# Epilog removes them
if [ -e "/tmp/moetrain-$job_id" ]; then
    echo "NOTE: /tmp/moetrain-$job_id (session folders) left behind after requeue/scancel: removed by the test"
    rm -rf "/tmp/moetrain-$job_id"
fi
echo "--- the job's output ($out):"
grep '^moetrain.sbatch:\|resume auto\|FAILED\|watchdog\|srun: error' "$out"
echo "$fails failure(s)"
[ $fails = 0 ] && { [ -n "${KEEP:-}" ] || { stop_all; trap - EXIT; rm -rf "$tmp"; }; }
[ $fails = 0 ]
