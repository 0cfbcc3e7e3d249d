#!/usr/bin/env bash
# moetrain-rank.sh - starts one moetraind rank the way every launcher needs it.
#
# Run once per rank: by srun (deploy/slurm/moetrain.sbatch), as the
# container command of a Kubernetes pod (deploy/k8s/), by hand. It
#   - reads the rank from the launcher's environment: Slurm (SLURM_PROCID,
#     SLURM_NTASKS, SLURM_LOCALID), Open MPI (OMPI_COMM_WORLD_RANK, ..._SIZE,
#     ..._LOCAL_RANK), a Kubernetes indexed Job (JOB_COMPLETION_INDEX with
#     MOETRAIN_WORLD_SIZE), or none (one rank), and exports it as
#     MOETRAIN_RANK, MOETRAIN_WORLD_SIZE, MOETRAIN_LOCAL_RANK;
#   - gives the rank its GPU (CUDA_VISIBLE_DEVICES = local rank) unless the
#     launcher bound one already (Slurm --gpus-per-task, a pod's GPU limit);
#   - puts Open MPI's session folder under MOETRAIN_TMPDIR (the launcher
#     removes it when the job ends, whatever killed it);
#   - execs moetraind (signals reach it directly) as the daemon with
#     --resume auto: a restarted job continues from its newest checkpoint.
#
# Environment (defaults in brackets):
#   MOETRAIN_JOB         job spec JSON (required)
#   MOETRAIN_WORKDIR     workdir on shared storage: checkpoints (required)
#   MOETRAIN_TOKEN_FILE  bearer token for mutating RPCs (required when
#                        MOETRAIN_LISTEN is not a loopback address)
#   MOETRAIN_LISTEN      gRPC address [0.0.0.0:50051]
#   MOETRAIN_HTTP        HTTP /metrics and /healthz address [0.0.0.0:9400]
#   MOETRAIN_READY_FILE  rank 0 writes its addresses here once serving []
#   MOETRAIN_TMPDIR      node-local scratch [/tmp/moetrain-$USER]
#   MOETRAIN_THREADS     CPU backend threads per rank [all cores]
#   MOETRAIND            the binary [moetraind on PATH]
# Arguments after the script's name are passed on to moetraind (--set ...).
#
# Exit status: moetraind's (0 done, 1 usage, 2 failed, 75 restart with
# --resume auto: README "Operations"); 1 when this script refuses to start.
set -euo pipefail

die() { echo "moetrain-rank: $*" >&2; exit 1; }

# ---- the rank -----------------------------------------------------------------
if [ -n "${SLURM_PROCID:-}" ]; then
    rank=$SLURM_PROCID world=${SLURM_NTASKS:-${SLURM_NPROCS:-1}} local=${SLURM_LOCALID:-0}
    via="Slurm"
elif [ -n "${OMPI_COMM_WORLD_RANK:-}" ]; then
    rank=$OMPI_COMM_WORLD_RANK world=${OMPI_COMM_WORLD_SIZE:-1}
    local=${OMPI_COMM_WORLD_LOCAL_RANK:-0} via="mpirun"
elif [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
    rank=$JOB_COMPLETION_INDEX world=${MOETRAIN_WORLD_SIZE:-1} local=0 via="Kubernetes"
    # moetraind's ranks find each other through MPI (srun's PMI, mpirun).
    # Pods started by an indexed Job have no MPI launcher: they need the
    # comm layer's environment bootstrap (rank, world size, rank 0's
    # address), which this build does not have yet. Refuse rather than run
    # N independent one-rank jobs into one checkpoint folder.
    if [ "$world" -gt 1 ] && [ -z "${MOETRAIN_BOOTSTRAP:-}" ]; then
        die "MOETRAIN_WORLD_SIZE=$world pods need the comm layer's environment bootstrap" \
            "(MOETRAIN_BOOTSTRAP); this build runs one pod per job: set parallelism and" \
            "completions to 1, or launch the ranks with srun or mpirun"
    fi
else
    rank=0 world=1 local=0 via="none"
fi
for v in "$rank" "$world" "$local"; do
    [[ "$v" =~ ^[0-9]+$ ]] || die "bad rank variables from $via: rank '$rank' world '$world' local '$local'"
done
[ "$rank" -lt "$world" ] || die "rank $rank is not below the world size $world ($via)"
export MOETRAIN_RANK=$rank MOETRAIN_WORLD_SIZE=$world MOETRAIN_LOCAL_RANK=$local

# ---- its GPU, its scratch ----------------------------------------------------------
if [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && [ -z "${SLURM_STEP_GPUS:-}" ] && [ -n "${MOETRAIN_GPUS_PER_NODE:-}" ]; then
    [ "$local" -lt "$MOETRAIN_GPUS_PER_NODE" ] ||
        die "local rank $local but MOETRAIN_GPUS_PER_NODE=$MOETRAIN_GPUS_PER_NODE"
    export CUDA_VISIBLE_DEVICES=$local
fi
tmpbase=${MOETRAIN_TMPDIR:-/tmp/moetrain-${USER:-$(id -u)}}
mkdir -p "$tmpbase"
export OMPI_MCA_orte_tmpdir_base="$tmpbase" # Open MPI's session folders
export TMPDIR="$tmpbase"

# ---- the command --------------------------------------------------------------------
: "${MOETRAIN_JOB:?set MOETRAIN_JOB to the job spec (JSON)}"
: "${MOETRAIN_WORKDIR:?set MOETRAIN_WORKDIR to the workdir (shared storage: checkpoints)}"
[ -r "$MOETRAIN_JOB" ] || die "MOETRAIN_JOB $MOETRAIN_JOB is not readable"
mkdir -p "$MOETRAIN_WORKDIR" || die "cannot create MOETRAIN_WORKDIR $MOETRAIN_WORKDIR"
listen=${MOETRAIN_LISTEN:-0.0.0.0:50051}
cmd=("${MOETRAIND:-moetraind}" --listen "$listen" --workdir "$MOETRAIN_WORKDIR"
     --job "$MOETRAIN_JOB" --resume auto --exit-when-done)
http=${MOETRAIN_HTTP-0.0.0.0:9400}
[ -n "$http" ] && cmd+=(--http "$http")
if [ -n "${MOETRAIN_TOKEN_FILE:-}" ]; then
    [ -r "$MOETRAIN_TOKEN_FILE" ] || die "MOETRAIN_TOKEN_FILE $MOETRAIN_TOKEN_FILE is not readable"
    cmd+=(--token-file "$MOETRAIN_TOKEN_FILE")
fi
[ -n "${MOETRAIN_READY_FILE:-}" ] && cmd+=(--ready-file "$MOETRAIN_READY_FILE")
[ -n "${MOETRAIN_THREADS:-}" ] && cmd+=(--threads "$MOETRAIN_THREADS")
cmd+=("$@")
echo "moetrain-rank: rank $rank of $world (local $local, via $via) on $(hostname):" \
     "${cmd[*]}" >&2
exec "${cmd[@]}"
