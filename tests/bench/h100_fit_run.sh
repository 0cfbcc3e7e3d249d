#!/usr/bin/env bash
# tests/bench/h100_fit_run.sh - one lease: the GPU tests, then the DSV3 proxy
# under the memory settings of issue 18 (tests/bench/proxy_settings.sh).
#
#   h100_fit_run.sh DIR STAGE...
#
# DIR holds bundle.tar.xz (deploy/bundle.sh --with-mpi --add
# tests/test_ops_cuda --add tests/test_model_cuda, tarred) and
# proxy_settings.sh. Stages: info, ops, model, fit (the settings that
# fit an 80 GB H100 and the fp32-gradient baseline of a 3-layer proxy that
# fits too), nofit (the settings expected not to fit), prof (per-op
# profiles of the 3-layer proxy, fp32 against bf16 gradients), full (the
# 4-layer proxy with fp32 and bf16 gradients, main copy fp32 and none: for
# a 141 GB H200). Logs go to
# $OUT (one tarball; the tables are printed).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
b=/tmp/mtb
rm -rf "$b" && mkdir -p "$b" && tar -xJf "$here/bundle.tar.xz" -C "$b" || exit 3
out="${OUT:-/tmp/out}"
logs=/tmp/mt-logs
mkdir -p "$out" "$logs"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -x "$b/mpi/install.sh" ] && "$b/mpi/install.sh"
export LD_LIBRARY_PATH="$b/lib" PATH="$b/libexec:$PATH"
export MT_BIN_DIR=/tmp/mtbin MT_TEST_TMPDIR=/tmp/mt-tests
mkdir -p $MT_BIN_DIR/engine $MT_BIN_DIR/service $MT_TEST_TMPDIR
ln -sf "$b/libexec/moetrain-data" $MT_BIN_DIR/engine/moetrain-data
ln -sf "$b/libexec/moetraind" $MT_BIN_DIR/service/moetraind
grep -i commit "$b/BUNDLE.txt" | head -2
P3="--set model.num_hidden_layers=3 --set precision.main_params=none"
P4="--set precision.main_params=none --set precision.grads=bf16"
RC="--set precision.recompute_mla_up=true --set precision.recompute_moe_act=true"
for st in "$@"; do
  t0=$SECONDS
  case $st in
    info) nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv ;;
    ops) timeout 200 "$b/libexec/test_ops_cuda" > $logs/ops.log 2>&1
         echo "== ops rc=$? ($((SECONDS - t0)) s)"
         grep -E "bf16|FAIL" $logs/ops.log | head -40; tail -2 $logs/ops.log ;;
    model) timeout 300 "$b/libexec/test_model_cuda" "$b/deploy/examples" > $logs/model.log 2>&1
         echo "== model rc=$? ($((SECONDS - t0)) s)"
         grep -E "^FAIL|INFO .*gradients|bf16-grads.*loss" $logs/model.log | head -40
         tail -2 $logs/model.log ;;
    fit) bash "$here/proxy_settings.sh" "$b" $logs/fit "${STEPS:-10}" \
           "p4-bf16g-none=$P4" "p4-bf16g-none-rc=$P4 $RC" \
           "p3-fp32g-none=$P3" "p3-bf16g-none=$P3 --set precision.grads=bf16" ;;
    full) bash "$here/proxy_settings.sh" "$b" $logs/full "${STEPS:-10}" \
           "p4-fp32g-fp32main=" "p4-bf16g-fp32main=--set precision.grads=bf16" \
           "p4-fp32g-none=--set precision.main_params=none" "p4-bf16g-none=$P4" ;;
    nofit) PROXY_TIMEOUT=150 bash "$here/proxy_settings.sh" "$b" $logs/nofit 3 \
           "p4-fp32g-none=--set precision.main_params=none --set lr_schedule.warmup_steps=1" ;;
    prof) bash "$here/proxy_settings.sh" "$b" $logs/prof 6 \
           "p3-fp32g-prof=MOETRAIN_OP_PROFILE=3 $P3 --set lr_schedule.warmup_steps=2" \
           "p3-bf16g-prof=MOETRAIN_OP_PROFILE=3 $P3 --set lr_schedule.warmup_steps=2 --set precision.grads=bf16"
         for f in $logs/prof/*.log; do
           echo "== $f"
           grep -E "op profile: step|by phase|by op: +(gemm|adamw|sumsq|zero|quant|xent|attn)" "$f" | cut -c 30- | head -30
           grep -E "top: .*gemm_fp8 .*wgrad G=" "$f" | cut -c 30-
         done ;;
  esac
  tar -czf "$out/logs.tgz" -C $logs .
done
