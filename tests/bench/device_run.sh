#!/usr/bin/env bash
# tests/bench/device_run.sh - one lease of a GPU machine: check, then time.
#
#   device_run.sh BUNDLE OUT [STAGES]
#
# BUNDLE is a deploy/bundle.sh bundle made with --with-mpi --tests (and
# data/ with the proxy corpus); OUT collects logs. STAGES (default all) is a
# comma list of: info, ops, attn, model, bench, proxy, profile, tiny, ckpt. Each
# stage's log is OUT/<stage>.log; a summary table is printed last. ckpt (not
# in the default list: it needs no GPU and about 40 GB of memory and disk)
# is tests/bench/bench_ckpt.sh on the bundle: checkpoint save / load /
# verify against dd, one rank and 4 ranks (CKPT_DIR: the disk, default
# /tmp/bench_ckpt; CKPT_SCALE: default 1).
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
stages="${3:-info,ops,attn,model,bench,proxy}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MT_BIN_DIR="$bundle/libexec-tree"
export MT_TEST_TMPDIR="/tmp/mt-tests"
mkdir -p "$MT_TEST_TMPDIR"
# moetraind is an MPI program: OpenMPI needs its trees at their absolute paths.
[ -x "$bundle/mpi/install.sh" ] && "$bundle/mpi/install.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# a singleton MPI_Init starts orted, which must be on PATH
export PATH="$bundle/libexec:$PATH"
# The tests look for tools as $MT_BIN_DIR/engine/moetrain-data etc.
mkdir -p "$MT_BIN_DIR/engine" "$MT_BIN_DIR/service" "$MT_BIN_DIR/ckpt"
ln -sf "$bundle/bin/moetrain-data" "$MT_BIN_DIR/engine/moetrain-data"
ln -sf "$bundle/bin/moetraind" "$MT_BIN_DIR/service/moetraind"
[ -e "$bundle/bin/moetrain-ckpt" ] && ln -sf "$bundle/bin/moetrain-ckpt" "$MT_BIN_DIR/ckpt/moetrain-ckpt"

summary=()
stage() { # NAME TIMEOUT COMMAND...
  local name="$1" t="$2"; shift 2
  case ",$stages," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$t" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-6s rc=%-3d %4ds  %s' "$name" "$rc" $((SECONDS - t0)) "$(grep -cE 'FAIL' "$out/$name.log") FAIL lines")")
  echo "== $name rc=$rc ($((SECONDS - t0)) s)"
  tail -n 25 "$out/$name.log"
}

ex="$bundle/deploy/examples"
stage info 60 sh -c 'nvidia-smi; nvcc --version 2>/dev/null | tail -1; ls /usr/lib/x86_64-linux-gnu | grep -E "cudnn|cublasLt|nccl" | head'
stage ops 120 "$bundle/bin/test_ops_cuda"
stage attn 180 env MOETRAIN_CUDA_SCRATCH_MB=4608 "$bundle/bin/test_attn_cuda"
stage model 120 "$bundle/bin/test_model_cuda" "$ex"
stage bench 120 "$bundle/bin/bench_ops_cuda"
stage proxy 240 env MOETRAIN_PROFILE=1 "$bundle/bin/moetraind" --job "$ex/dsv3-proxy.json" \
  --set data.path="$bundle/data/synth-dsv3" --set train.steps="${PROXY_STEPS:-50}" \
  --metrics-jsonl "$out/proxy.jsonl"
# The per-op profile of the proxy step (kernels/op_profile.h): steps 4..N
# timed op by op; the table goes to the log, the full one to OUT/profile.tsv.
stage profile 300 env MOETRAIN_OP_PROFILE=4 MOETRAIN_OP_PROFILE_OUT="$out/profile.tsv" \
  "$bundle/bin/moetraind" --job "$ex/dsv3-proxy.json" --set data.path="$bundle/data/synth-dsv3" \
  --set train.steps="${PROFILE_STEPS:-12}"
stage tiny 300 "$bundle/bin/moetraind" --job "$ex/tiny-cpu.json" --set backend=cuda \
  --set data.path="$bundle/data/synth-tiny" --metrics-jsonl "$out/tiny.jsonl"
stage ckpt 1800 "$(dirname "${BASH_SOURCE[0]}")/bench_ckpt.sh" --bundle "$bundle" \
  --dir "${CKPT_DIR:-/tmp/bench_ckpt}" --scale "${CKPT_SCALE:-1}"

echo "== summary"
printf '%s\n' "${summary[@]}"
