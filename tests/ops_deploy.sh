#!/bin/bash
# ops_deploy.sh BIN_DIR SOURCE_DIR TMP
#
# Property: the deploy files start moetraind correctly where operators run
# it, as far as this machine can show without Slurm or a cluster:
#   - launcher (deploy/launch/moetrain-rank.sh): under fake Slurm, mpirun
#     and Kubernetes environments each rank gets its rank, world size, local
#     rank, GPU and session folder, and moetraind gets --resume auto, the
#     token, the ready file and the extra arguments; a bad environment
#     (rank >= world, several pods without the comm layer, no job) refuses;
#   - Slurm (deploy/slurm/moetrain.sbatch) under a fake srun/scontrol: srun
#     with --kill-on-bad-exit, the address file beside the job while rank 0
#     serves, requeue on exit 75 or 137 (up to MOETRAIN_MAX_REQUEUES), none on 0 or
#     2, session folders removed; and once with the real moetraind: gRPC
#     health at the written address, SIGTERM saves and exits 0, the next
#     start says "resume auto: continuing from";
#   - Kubernetes (deploy/k8s/moetrain.yaml): the offline schema and
#     cross-reference check (tests/ops_k8s_check.py, which must fail on a
#     typo and on a wrong exit code), then the container's command, args and
#     env run for real (paths mapped into TMP): health of the readiness
#     probe's service, SIGTERM saves;
#   - systemd (deploy/systemd/moetraind.service): systemd-analyze verify
#     says nothing, restarts skip 1 and 2, the stop timeout exceeds the
#     grace period, and its ExecStart runs for real;
#   - shellcheck passes on every deploy script.
set -uo pipefail
bin=$(cd "$1" && pwd) src=$(cd "$2" && pwd) tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
d="$bin/service/moetraind"
cli="$bin/service/moetrain"
launcher="$src/deploy/launch/moetrain-rank.sh"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok: $*"; }
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null; done' EXIT

# ---- the tiny job and its data -----------------------------------------------------
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 100000 --seed 5 > /dev/null
/usr/bin/python3 - "$src/deploy/examples/tiny-cpu.json" "$tmp/job.json" "$tmp/syn" << 'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j["data"]["path"] = sys.argv[3]
j["data"]["valid_interval"] = 0
j["batch"] = {"micro_batch_size": 2, "global_batch_size": 4, "seq_len": 32}
j["train"]["steps"] = 100000
j["checkpoint"] = {"dir": "checkpoints/tiny-cpu", "interval": 5, "keep_last": 2}
json.dump(j, open(sys.argv[2], "w"))
PY
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$tmp/token"
chmod 600 "$tmp/token"
. "$src/tests/ports_lib.sh" # free_ports
port_base=$(free_ports 6)
[ -n "$port_base" ] || { echo "FAIL: no six free ports below the ephemeral range"; exit 1; }

# ---- a stub moetraind: records what it got ----------------------------------------------
cat > "$tmp/stub-moetraind" << 'STUB'
#!/bin/bash
out="$STUB_DIR/rank$MOETRAIN_RANK"
{ printf 'ARGV'; printf ' %s' "$@"; echo
  for v in MOETRAIN_RANK MOETRAIN_WORLD_SIZE MOETRAIN_LOCAL_RANK CUDA_VISIBLE_DEVICES \
           OMPI_MCA_orte_tmpdir_base; do echo "$v=${!v-<unset>}"; done; } > "$out"
mkdir -p "$OMPI_MCA_orte_tmpdir_base/ompi.stub.$MOETRAIN_RANK"
while [ $# -gt 0 ]; do
    [ "$1" = --ready-file ] && [ "$MOETRAIN_RANK" = 0 ] && echo "grpc=0.0.0.0:1" > "$2"
    shift
done
if [ "$MOETRAIN_RANK" = 0 ] && [ -n "${MOETRAIN_ADDR_FILE:-}" ]; then
    for _ in $(seq 100); do [ -f "$MOETRAIN_ADDR_FILE" ] && break; sleep 0.1; done
    cp "$MOETRAIN_ADDR_FILE" "$STUB_DIR/seen.addr" 2> /dev/null
fi
exit "${STUB_EXIT:-0}"
STUB
chmod +x "$tmp/stub-moetraind"
stub_env=(MOETRAIND="$tmp/stub-moetraind" MOETRAIN_JOB="$tmp/job.json" MOETRAIN_WORKDIR="$tmp/wd"
          MOETRAIN_TOKEN_FILE="$tmp/token")
# launch ENV... -- ARGS: the launcher under `env -i` plus ENV, output in $out, status in $rc
launch() {
    local e=()
    while [ "$1" != -- ]; do e+=("$1"); shift; done
    shift
    rm -rf "$tmp/stub" && mkdir -p "$tmp/stub"
    out=$(env -i PATH="$PATH" HOME="$HOME" STUB_DIR="$tmp/stub" MOETRAIN_TMPDIR="$tmp/scratch" \
          "${stub_env[@]}" "${e[@]}" "$launcher" "$@" 2>&1)
    rc=$?
}
has() { grep -qxF -- "$1" "$tmp/stub/rank$2" || fail "$3: rank $2 lacks '$1': $(cat "$tmp/stub/rank$2" 2> /dev/null)"; }

# ---- 1. the launcher's environments ---------------------------------------------------------
launch SLURM_PROCID=3 SLURM_NTASKS=8 SLURM_LOCALID=3 MOETRAIN_GPUS_PER_NODE=4 \
    MOETRAIN_READY_FILE="$tmp/ready" -- --set train.steps=7
[ $rc = 0 ] || fail "slurm: rc $rc: $out"
has MOETRAIN_RANK=3 3 slurm; has MOETRAIN_WORLD_SIZE=8 3 slurm; has MOETRAIN_LOCAL_RANK=3 3 slurm
has CUDA_VISIBLE_DEVICES=3 3 slurm; has "OMPI_MCA_orte_tmpdir_base=$tmp/scratch" 3 slurm
has "ARGV --listen 0.0.0.0:50051 --workdir $tmp/wd --job $tmp/job.json --resume auto --exit-when-done --http 0.0.0.0:9400 --token-file $tmp/token --ready-file $tmp/ready --set train.steps=7" 3 slurm
grep -q "rank 3 of 8 (local 3, via Slurm)" <<< "$out" || fail "slurm: no start line: $out"
# flags the launcher passes are flags moetraind knows
for f in $(grep -o -- ' --[a-z-]*' "$tmp/stub/rank3" | sort -u); do
    "$d" --help | grep -q -- "$f " || fail "the launcher passes $f, which moetraind --help does not list"
done
launch SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=1 SLURM_STEP_GPUS=5 MOETRAIN_GPUS_PER_NODE=8 --
has "CUDA_VISIBLE_DEVICES=<unset>" 1 "slurm with --gpus-per-task"
launch OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=1 --
[ $rc = 0 ] || fail "mpirun: rc $rc: $out"
has MOETRAIN_RANK=1 1 mpirun; has MOETRAIN_WORLD_SIZE=2 1 mpirun
launch JOB_COMPLETION_INDEX=0 MOETRAIN_WORLD_SIZE=1 --
[ $rc = 0 ] || fail "k8s one pod: rc $rc: $out"
has MOETRAIN_RANK=0 0 k8s
launch --
[ $rc = 0 ] && has MOETRAIN_WORLD_SIZE=1 0 "no launcher" || fail "no launcher: rc $rc: $out"
launch JOB_COMPLETION_INDEX=1 MOETRAIN_WORLD_SIZE=2 --
[ $rc = 1 ] && grep -q "need the comm layer's environment bootstrap" <<< "$out" ||
    fail "two pods must be refused: rc $rc: $out"
launch SLURM_PROCID=8 SLURM_NTASKS=8 --
[ $rc = 1 ] && grep -q "rank 8 is not below the world size 8" <<< "$out" || fail "rank 8 of 8: rc $rc: $out"
launch SLURM_PROCID=x SLURM_NTASKS=8 --
[ $rc = 1 ] || fail "a non-numeric rank: rc $rc"
stub_env=(MOETRAIND="$tmp/stub-moetraind" MOETRAIN_WORKDIR="$tmp/wd")
launch --
[ $rc = 1 ] && grep -q "set MOETRAIN_JOB" <<< "$out" || fail "no MOETRAIN_JOB: rc $rc: $out"
stub_env=(MOETRAIND="$tmp/stub-moetraind" MOETRAIN_JOB="$tmp/job.json" MOETRAIN_WORKDIR="$tmp/wd"
          MOETRAIN_TOKEN_FILE="$tmp/token")
ok "launcher: Slurm, mpirun, Kubernetes and bare environments; refusals"

# ---- 2. Slurm with a fake srun and scontrol ------------------------------------------------
mkdir -p "$tmp/fakebin"
cat > "$tmp/fakebin/srun" << 'SRUN'
#!/bin/bash
# fake srun: SLURM_NTASKS tasks of the command on this node, in parallel,
# signals forwarded; records its options
echo "srun $*" >> "$FAKE_LOG"
while [[ "$1" == --* ]]; do shift; done
if [ "$1" = rm ]; then "$@"; exit; fi
kids=()
for ((i = 0; i < ${SLURM_NTASKS:-1}; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    kids+=($!)
done
trap 'kill -TERM "${kids[@]}" 2> /dev/null' TERM
st=0
for k in "${kids[@]}"; do
    while :; do
        wait "$k"; r=$?
        kill -0 "$k" 2> /dev/null || break
    done
    [ $r -gt $st ] && st=$r
done
exit $st
SRUN
printf '#!/bin/bash\necho "scontrol $*" >> "$FAKE_LOG"\n' > "$tmp/fakebin/scontrol"
chmod +x "$tmp/fakebin/srun" "$tmp/fakebin/scontrol"
# sbatch_run NAME ENV...: the batch script as slurmd runs it; status in $rc
sbatch_run() {
    local name=$1; shift
    rm -rf "$tmp/stub" "$tmp/submit" && mkdir -p "$tmp/stub" "$tmp/submit"
    : > "$tmp/fake.log"
    env PATH="$tmp/fakebin:$PATH" FAKE_LOG="$tmp/fake.log" STUB_DIR="$tmp/stub" \
        SLURM_JOB_ID=4242 SLURM_NTASKS=2 SLURM_JOB_NUM_NODES=1 SLURM_SUBMIT_DIR="$tmp/submit" \
        MOETRAIN_DEPLOY="$src/deploy" MOETRAIN_JOB="$tmp/job.json" MOETRAIN_WORKDIR="$tmp/swd" \
        MOETRAIN_TOKEN_FILE="$tmp/token" MOETRAIN_ADDR_FILE="$tmp/submit/moetrain-4242.addr" \
        MOETRAIND="$tmp/stub-moetraind" "$@" bash "$src/deploy/slurm/moetrain.sbatch" \
        > "$tmp/sbatch.$name.out" 2>&1
    rc=$?
}
sbatch_run ok STUB_EXIT=0
[ $rc = 0 ] || fail "sbatch (ranks exit 0): rc $rc: $(tail -n 3 "$tmp/sbatch.ok.out")"
grep -q "^srun --kill-on-bad-exit=1 --mpi=pmix --cpu-bind=cores $src/deploy/launch/moetrain-rank.sh" \
    "$tmp/fake.log" || fail "sbatch: srun line: $(cat "$tmp/fake.log")"
grep -q "^grpc=$(hostname -f 2> /dev/null || hostname):50051$" "$tmp/stub/seen.addr" 2> /dev/null ||
    fail "sbatch: no address file while rank 0 served: $(cat "$tmp/stub/seen.addr" 2> /dev/null)"
grep -q "^job=4242$" "$tmp/stub/seen.addr" 2> /dev/null || fail "sbatch: the address file lacks job="
[ -f "$tmp/stub/rank0" ] && [ -f "$tmp/stub/rank1" ] || fail "sbatch: not two ranks"
grep -q "ARGV .*--listen 0.0.0.0:50051 .*--resume auto .*--ready-file $tmp/swd/.ready-4242" "$tmp/stub/rank1" ||
    fail "sbatch: rank arguments: $(cat "$tmp/stub/rank1")"
grep -q requeue "$tmp/fake.log" && fail "sbatch: requeued a job that ended with 0"
[ ! -e /tmp/moetrain-4242 ] || fail "sbatch: /tmp/moetrain-4242 (session folders) left behind"
[ ! -e "$tmp/submit/moetrain-4242.addr" ] || fail "sbatch: the address file outlived the job"
sbatch_run restart STUB_EXIT=75
[ $rc = 75 ] || fail "sbatch (75): rc $rc"
grep -q "^scontrol requeue 4242$" "$tmp/fake.log" || fail "sbatch: no requeue on 75: $(cat "$tmp/fake.log")"
# real srun reports a rank killed by a signal as 128 + signal (137), not 75
sbatch_run killed STUB_EXIT=137
[ $rc = 137 ] && grep -q "^scontrol requeue 4242$" "$tmp/fake.log" ||
    fail "sbatch: no requeue on 137 (a rank killed): rc $rc: $(cat "$tmp/fake.log")"
sbatch_run giveup STUB_EXIT=75 SLURM_RESTART_COUNT=3
grep -q requeue "$tmp/fake.log" && fail "sbatch: requeued beyond MOETRAIN_MAX_REQUEUES"
grep -q "giving up" "$tmp/sbatch.giveup.out" || fail "sbatch: did not say it gives up"
sbatch_run failed STUB_EXIT=2
[ $rc = 2 ] || fail "sbatch (2): rc $rc"
grep -q requeue "$tmp/fake.log" && fail "sbatch: requeued a failed job (2)"
sbatch_run notoken MOETRAIN_TOKEN_FILE=
[ $rc = 1 ] && grep -q "set MOETRAIN_TOKEN_FILE" "$tmp/sbatch.notoken.out" || fail "sbatch without a token: rc $rc"
ok "Slurm (fake srun): srun options, address file, requeue on 75 and 137 only, cleanup"

# wait_ready FILE PID: until FILE exists (60 s)
wait_ready() {
    for _ in $(seq 600); do
        [ -s "$1" ] && return 0
        kill -0 "$2" 2> /dev/null || return 1
        sleep 0.1
    done
    return 1
}
# steps_of ADDR: the job's step from moetrain status
steps_of() { "$cli" --server "$1" status --json 2> /dev/null | /usr/bin/python3 -c \
    'import json,sys; print(json.load(sys.stdin).get("step", 0))' 2> /dev/null || echo 0; }
# wait_steps ADDR N: until the job has done N steps (60 s)
wait_steps() {
    for _ in $(seq 600); do [ "$(steps_of "$1")" -ge "$2" ] && return 0; sleep 0.1; done
    return 1
}

# the real daemon under the sbatch script (one task)
gp=$port_base hp=$((port_base + 1))
rm -rf "$tmp/submit" && mkdir -p "$tmp/submit"
env PATH="$tmp/fakebin:$PATH" FAKE_LOG="$tmp/fake.log" SLURM_JOB_ID=4343 SLURM_NTASKS=1 \
    SLURM_JOB_NUM_NODES=1 SLURM_SUBMIT_DIR="$tmp/submit" MOETRAIN_DEPLOY="$src/deploy" \
    MOETRAIN_JOB="$tmp/job.json" MOETRAIN_WORKDIR="$tmp/real" MOETRAIN_TOKEN_FILE="$tmp/token" \
    MOETRAIN_GRPC_PORT=$gp MOETRAIN_HTTP_PORT=$hp MOETRAIND="$d" MOETRAIN_THREADS=1 \
    bash "$src/deploy/slurm/moetrain.sbatch" > "$tmp/sbatch.real.out" 2>&1 &
sb=$!
pids+=("$sb")
addr="$tmp/submit/moetrain-4343.addr"
if ! wait_ready "$addr" "$sb"; then
    fail "sbatch + moetraind: no address file: $(tail -n 5 "$tmp/sbatch.real.out")"
else
    port=$(sed -n 's/^grpc=.*:\([0-9]*\)$/\1/p' "$addr")
    [ "$port" = "$gp" ] || fail "sbatch + moetraind: address file port $port"
    "$cli" --server "127.0.0.1:$port" health > /dev/null || fail "sbatch + moetraind: not serving"
    wait_steps "127.0.0.1:$port" 2 || fail "sbatch + moetraind: the job does not run"
    kill -TERM "$sb"
    rc=0; wait "$sb" || rc=$?
    [ $rc = 0 ] || fail "sbatch + moetraind: SIGTERM: rc $rc: $(tail -n 5 "$tmp/sbatch.real.out")"
    grep -q "SIGTERM: stopping at this step boundary: .*saving" "$tmp/sbatch.real.out" ||
        fail "sbatch + moetraind: no save on SIGTERM"
    [ -n "$("$bin/ckpt/moetrain-ckpt" list "$tmp/real/checkpoints/tiny-cpu" 2> /dev/null)" ] ||
        fail "sbatch + moetraind: no checkpoint after SIGTERM"
    # the requeued start resumes
    env PATH="$tmp/fakebin:$PATH" FAKE_LOG="$tmp/fake.log" SLURM_JOB_ID=4343 SLURM_NTASKS=1 \
        SLURM_RESTART_COUNT=1 SLURM_JOB_NUM_NODES=1 SLURM_SUBMIT_DIR="$tmp/submit" \
        MOETRAIN_DEPLOY="$src/deploy" MOETRAIN_JOB="$tmp/job.json" MOETRAIN_WORKDIR="$tmp/real" \
        MOETRAIN_TOKEN_FILE="$tmp/token" MOETRAIN_GRPC_PORT=$gp MOETRAIN_HTTP_PORT=$hp \
        MOETRAIND="$d" MOETRAIN_THREADS=1 bash "$src/deploy/slurm/moetrain.sbatch" \
        > "$tmp/sbatch.real2.out" 2>&1 &
    sb=$!
    pids+=("$sb")
    if wait_ready "$addr" "$sb"; then
        for _ in $(seq 300); do grep -q "resume auto:" "$tmp/sbatch.real2.out" && break; sleep 0.1; done
        grep -q "resume auto: continuing from $tmp/real/checkpoints/tiny-cpu/step_" "$tmp/sbatch.real2.out" ||
            fail "sbatch + moetraind: the requeued start did not resume: $(grep -i resume "$tmp/sbatch.real2.out")"
        kill -TERM "$sb"; wait "$sb"
    else
        fail "sbatch + moetraind: the requeued start did not serve: $(tail -n 5 "$tmp/sbatch.real2.out")"
    fi
    ok "Slurm (fake srun) + moetraind: served at the written address, SIGTERM saved, requeue resumed"
fi

# ---- 3. Kubernetes ------------------------------------------------------------------------
k8s="$src/deploy/k8s/moetrain.yaml"
out=$(/usr/bin/python3 "$src/tests/ops_k8s_check.py" "$k8s" "$src/service/exit_status.h" "$tmp/k8s" 2>&1) ||
    fail "k8s check: $out"
sed 's/readinessProbe:/readinesProbe:/' "$k8s" > "$tmp/typo.yaml"
/usr/bin/python3 "$src/tests/ops_k8s_check.py" "$tmp/typo.yaml" "$src/service/exit_status.h" "$tmp/k8s.x" \
    > "$tmp/typo.out" 2>&1 && fail "k8s check accepted a misspelt field"
grep -q "unknown field 'readinesProbe'" "$tmp/typo.out" || fail "k8s check: $(cat "$tmp/typo.out")"
sed 's/values: \[1, 2\]/values: [1, 2, 75]/' "$k8s" > "$tmp/codes.yaml"
/usr/bin/python3 "$src/tests/ops_k8s_check.py" "$tmp/codes.yaml" "$src/service/exit_status.h" "$tmp/k8s.x" \
    > /dev/null 2>&1 && fail "k8s check accepted FailJob on 75"
if kubectl version --request-timeout=3s > /dev/null 2>&1; then
    kubectl apply --dry-run=server -f "$k8s" > /dev/null || fail "kubectl apply --dry-run=server"
fi
# the container for real: paths mapped into TMP, loopback ports
kr="$tmp/k8sroot"
mkdir -p "$kr/work" "$kr/job" "$kr/token" "$kr/models/tiny"
cp "$tmp/k8s/job.json" "$kr/job/job.json"
cp "$tmp/token" "$kr/token/token"
mkdir -p "$kr/work/models/tiny" "$kr/work/data"
/usr/bin/python3 -c 'import json,sys; json.dump(json.load(open(sys.argv[1]))["model"], open(sys.argv[2], "w"))' \
    "$src/deploy/examples/tiny-cpu.json" "$kr/work/models/tiny/config.json"
cp "$tmp/syn.bin" "$kr/work/data/synth.bin"; cp "$tmp/syn.idx" "$kr/work/data/synth.idx"
map() { sed -e "s|^/work|$kr/work|; s|/etc/moetrain/job|$kr/job|; s|/etc/moetrain/token|$kr/token|" \
            -e "s|/opt/moetrain/deploy|$src/deploy|; s|/opt/moetrain/bin/moetraind|$d|" \
            -e "s|/tmp/moetrain|$kr/scratch|; s|0\.0\.0\.0:50051|127.0.0.1:$((port_base + 2))|" \
            -e "s|0\.0\.0\.0:9400|127.0.0.1:$((port_base + 3))|"; }
mapfile -t kcmd < <(map < "$tmp/k8s/command")
mapfile -t kenv < <(sed 's/=/\n/' "$tmp/k8s/env" | paste - - -d= | while IFS= read -r l; do
    echo "${l%%=*}=$(map <<< "${l#*=}")"; done)
# the data and model paths of the ConfigMap's job live under /work in the pod
sed -i "s|\"/work/|\"$kr/work/|g" "$kr/job/job.json"
env -i PATH="$PATH" HOME="$HOME" JOB_COMPLETION_INDEX=0 "${kenv[@]}" \
    MOETRAIN_READY_FILE="$kr/ready" "${kcmd[@]}" --set train.steps=100000 --set checkpoint.interval=5 \
    --set batch.seq_len=32 --set batch.micro_batch_size=2 --set batch.global_batch_size=4 \
    --set data.valid_interval=0 > "$tmp/k8s.out" 2>&1 &
kp=$!
pids+=("$kp")
ka="127.0.0.1:$((port_base + 2))"
if wait_ready "$kr/ready" "$kp"; then
    "$cli" --server "$ka" health > /dev/null || fail "k8s pod: liveness (health) fails"
    "$cli" --server "$ka" health moetrain.v1.Trainer > /dev/null || fail "k8s pod: readiness service fails"
    wait_steps "$ka" 1 || fail "k8s pod: the job does not run: $(tail -n 3 "$tmp/k8s.out")"
    kill -TERM "$kp"
    rc=0; wait "$kp" || rc=$?
    [ $rc = 0 ] || fail "k8s pod: SIGTERM: rc $rc: $(tail -n 5 "$tmp/k8s.out")"
    [ -n "$("$bin/ckpt/moetrain-ckpt" list "$kr/work/checkpoints/tiny-cpu" 2> /dev/null)" ] ||
        fail "k8s pod: no checkpoint after SIGTERM (checkpoint.dir checkpoints/tiny-cpu in the workdir)"
    ok "Kubernetes: schema and cross-references; the container ran: probes answer, SIGTERM saved"
else
    fail "k8s pod: did not serve: $(tail -n 5 "$tmp/k8s.out")"
fi

# ---- 4. systemd -------------------------------------------------------------------------------
unit="$src/deploy/systemd/moetraind.service"
if command -v systemd-analyze > /dev/null; then
    sed "s|/opt/moetrain/bin/moetraind|$d|" "$unit" > "$tmp/moetraind.service"
    out=$(cd "$tmp" && systemd-analyze verify ./moetraind.service 2>&1) ||
        fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify says: $out"
    sed 's/^RestartSec=/RestartSex=/' "$tmp/moetraind.service" > "$tmp/bad.service"
    out=$(cd "$tmp" && systemd-analyze verify ./bad.service 2>&1)
    [ -n "$out" ] || fail "systemd-analyze verify is silent on an unknown key: the check proves nothing"
else
    echo "note: no systemd-analyze: the unit's verify is skipped"
fi
grep -qx "RestartPreventExitStatus=1 2" "$unit" || fail "systemd: restarts must skip 1 and 2"
grep -qx "Restart=on-failure" "$unit" || fail "systemd: Restart=on-failure"
stop=$(sed -n 's/^TimeoutStopSec=\([0-9]*\)s*$/\1/p' "$unit")
[ -n "$stop" ] && [ "$stop" -gt 25 ] || fail "systemd: TimeoutStopSec $stop must exceed train.term_grace_s 25"
# ExecStart for real
mapfile -t ucmd < <(sed -n '/^ExecStart=/,/[^\\]$/p' "$unit" | sed 's/^ExecStart=//; s/\\$//' | tr -s ' ' '\n' | sed '/^$/d')
ur="$tmp/unitroot"
mkdir -p "$ur/state" "$ur/cred"
cp "$tmp/token" "$ur/cred/token"
cp "$tmp/job.json" "$ur/job.json"
for i in "${!ucmd[@]}"; do
    ucmd[i]=$(sed -e "s|/opt/moetrain/bin/moetraind|$d|; s|/var/lib/moetrain|$ur/state|" \
                  -e "s|%d/|$ur/cred/|; s|/etc/moetrain/job.json|$ur/job.json|" \
                  -e "s|127.0.0.1:50051|127.0.0.1:$((port_base + 4))|; s|127.0.0.1:9400|127.0.0.1:$((port_base + 5))|" <<< "${ucmd[i]}")
done
"${ucmd[@]}" --threads 1 --ready-file "$ur/ready" > "$tmp/unit.out" 2>&1 &
up=$!
pids+=("$up")
if wait_ready "$ur/ready" "$up"; then
    ua="127.0.0.1:$((port_base + 4))"
    "$cli" --server "$ua" health > /dev/null || fail "systemd ExecStart: not serving"
    wait_steps "$ua" 1 || fail "systemd ExecStart: the job does not run"
    kill -TERM "$up"
    rc=0; wait "$up" || rc=$?
    [ $rc = 0 ] || fail "systemd ExecStart: SIGTERM: rc $rc"
    ok "systemd: verify clean, restart policy, stop timeout; ExecStart ran and stopped with 0"
else
    fail "systemd ExecStart: did not serve: $(tail -n 5 "$tmp/unit.out")"
fi

# ---- 5. shellcheck ------------------------------------------------------------------------------
if command -v shellcheck > /dev/null; then
    out=$(shellcheck "$src/deploy/launch/moetrain-rank.sh" "$src/deploy/slurm/moetrain.sbatch" 2>&1) ||
        fail "shellcheck: $out"
    ok "shellcheck: deploy scripts clean"
fi

echo "$fails failure(s)"
[ $fails = 0 ] && { [ -n "${KEEP:-}" ] || rm -rf "$tmp"; }
[ $fails = 0 ]
