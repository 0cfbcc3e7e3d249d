#!/usr/bin/env bash
# tests/bench/multi_gpu_run.sh - one lease of a machine with several GPUs
# (issue 17): the comm interface over NCCL, collective bandwidth, every
# parallel layout of the tiny job against one GPU, and the DSV3 proxy's
# throughput per GPU under expert parallelism against one GPU.
#
#   multi_gpu_run.sh BUNDLE OUT [STAGES]
#
# BUNDLE: a deploy/bundle.sh bundle made with --with-mpi and the tests
# (test_comm_gpu, bench_comm_gpu; the corpora data/synth-tiny and
# data/synth-dsv3 are generated when missing);
# OUT collects logs and metrics. STAGES (default info,comm,bench,eq,proxy,ckpt):
#   info   nvidia-smi and the GPU topology
#   comm   test_comm_gpu over NCCL on every GPU
#   bench  bench_comm_gpu: all-reduce / reduce-scatter / all-gather /
#          all-to-all bandwidth over NCCL (the ceilings)
#   eq     tiny-cpu on CUDA (fp8), EQ_STEPS steps (default 20), once on one
#          GPU and once per layout in EQ_LAYOUTS (default for 2 GPUs:
#          "dp=2 ep=2 pp=2 tp=2"; for 4: those plus "ep=4 dp=4,ep=2
#          tp=2,dp=2 tp=2,pp=2 pp=2,ep=2"; EQ_SETS: more settings for every
#          run, e.g. "--set precision.recipe=bf16"); prints the largest
#          relative loss difference per layout. A layout the program refuses
#          is reported as refused. Every layout runs over NCCL (pp too:
#          pipeline messages over NCCL links); EQ_PP_COMM=staged runs the
#          layouts with pp over staged MPI (host memory) instead, and
#          EQ_PP_COMM=both runs them both ways (the staged run labelled
#          "+staged"), for comparing the two.
#   proxy  deploy/examples/dsv3-proxy.json, PROXY_STEPS (default 20) steps:
#          one GPU, then ep=N over N GPUs (dp=N for the dense part), each
#          GPU with the one-GPU run's micro-batches (global batch PROXY_GBS,
#          default 4, times N); PROXY_SETS: settings for every proxy run
#          (e.g. fewer layers to fit an 80 GB GPU);
#          median step time, tokens/s, model TFLOPS per GPU and the
#          busiest expert's load (max / mean over the MoE layers) of steps
#          PROXY_FROM (default 3)..N from the metrics stream. The untrained
#          proxy routes most tokens to few experts (load max near 4 = E/k:
#          one expert takes every token) from about step 8 on, so under ep
#          the GPU holding the busy experts does most of the expert work
#          (a faster bias update, loss.bias_update_rate=0.05, did not hold
#          the balance: tests/bench/RESULTS.md).
#   ckpt   the proxy at CKPT_LAYOUT (default ep=R) on R = CKPT_RANKS ranks
#          (default N; more ranks than GPUs share them and exchange through
#          host memory, parallel.comm=mpi, as NCCL takes one rank per GPU)
#          saves at steps 2
#          and 4 into CKPT_DIR (default /tmp/mg-ckpt; async, every rank its
#          own shard file); dd writes and reads a file of the checkpoint's
#          size on the same disk (page cache dropped for the read when
#          allowed); then the checkpoint continues for 2 steps on one GPU
#          (PROXY1_SETS: settings that make the proxy fit one GPU) and on 2
#          GPUs at CKPT_LAYOUT2 (default ep=2 when saved at ep=4, else dp=2).
# Environment: NGPU (default: every GPU), NCCL_NVLS_ENABLE=0 always.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
stages="${3:-info,comm,bench,eq,proxy,ckpt}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -x "$bundle/mpi/install.sh" ] && "$bundle/mpi/install.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH="$bundle/libexec:$PATH"
ngpu="${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
ex="$bundle/deploy/examples"
bin="$bundle/bin"
mpi() { # NP COMMAND...
  local np="$1"; shift
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$np" \
    -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x PATH "$@"
}
want() { case ",$stages," in *",$1,"*) return 0 ;; esac; return 1; }

# "step loss" lines of a metrics stream (one JSON object per line).
losses() { sed -n 's/^{"step":\([0-9]*\),.*"loss":\([-0-9.e+]*\),"mtp_loss".*/\1 \2/p' "$1"; }
# Largest |a - b| / |a| over the steps both streams hold.
max_rel() {
  join <(losses "$1") <(losses "$2") |
    awk '{d = $2 - $3; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) { m = r; s = $1 } }
         END { if (NR == 0) print "no common steps"; else if (m == 0) printf "0 (all %d steps equal to the printed digits)\n", NR;
               else printf "%.2e (step %d of %d)\n", m, s, NR }'
}
# Median of steps FROM.. (default 3) of a field ("step_ms", "tokens_per_s",
# "tflops"; "load_max": the largest expert load of the step over its layers).
median() {
  { if [ "$2" = load_max ]; then
      sed -n 's/^{"step":\([0-9]*\),.*"expert_load":\(.*\)/\1 \2/p' "$1" |
        awk '{ m = 0; n = split($2, a, "\"max\":"); for (i = 2; i <= n; i++) if (a[i] + 0 > m) m = a[i] + 0; print $1, m }'
    else sed -n "s/^{\"step\":\([0-9]*\),.*\"$2\":\([-0-9.e+]*\),.*/\1 \2/p" "$1"; fi; } |
    awk -v f="${FROM:-3}" '$1 >= f { print $2 }' |
    sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2); else print "-" }'
}

echo "multi_gpu_run: $ngpu GPUs, stages $stages"
# the corpora, made here when the bundle does not carry them (seconds)
mkdir -p "$bundle/data"
[ -e "$bundle/data/synth-tiny.idx" ] ||
  "$bin/moetrain-data" synth --vocab 64 --tokens 2000000 --seed 1 --output "$bundle/data/synth-tiny" > /dev/null
[ -e "$bundle/data/synth-dsv3.idx" ] ||
  "$bin/moetrain-data" synth --vocab 2048 --tokens 2000000 --seed 1 --output "$bundle/data/synth-dsv3" > /dev/null
if want info; then
  nvidia-smi > "$out/info.log" 2>&1; nvidia-smi topo -m >> "$out/info.log" 2>&1
  head -n 20 "$out/info.log"
fi
if want comm; then
  echo "== comm: test_comm_gpu nccl on $ngpu ranks"
  mpi "$ngpu" "$bin/test_comm_gpu" --backend nccl --mem device > "$out/comm.log" 2>&1
  echo "rc=$?"; grep -E "checks passed|FAIL" "$out/comm.log" | head -n 12
fi
if want bench; then
  echo "== bench: bench_comm_gpu nccl on $ngpu ranks"
  mpi "$ngpu" "$bin/bench_comm_gpu" --backend nccl --max-mb "${BENCH_MAX_MB:-1024}" > "$out/bench.log" 2>&1
  echo "rc=$?"; cat "$out/bench.log"
fi
if want eq; then
  steps="${EQ_STEPS:-20}"
  layouts="${EQ_LAYOUTS:-}"
  if [ -z "$layouts" ]; then
    layouts="dp=2 ep=2 pp=2 tp=2"
    [ "$ngpu" -ge 4 ] && layouts="$layouts ep=4 dp=4,ep=2 tp=2,dp=2 tp=2,pp=2 pp=2,ep=2"
  fi
  tiny=(--job "$ex/tiny-cpu.json" --set backend=cuda --set data.path="$bundle/data/synth-tiny"
        --set train.steps="$steps" --set data.valid_interval=0 --set checkpoint.dir= ${EQ_SETS:-})
  echo "== eq: tiny-cpu on CUDA, $steps steps, one GPU"
  CUDA_VISIBLE_DEVICES=0 "$bin/moetraind" "${tiny[@]}" --metrics-jsonl "$out/eq-1.jsonl" > "$out/eq-1.log" 2>&1
  echo "one GPU rc=$?: $(losses "$out/eq-1.jsonl" | tail -n 1)"
  # layouts with pp: over nccl (default), staged, or both (EQ_PP_COMM)
  runs=""
  for l in $layouts; do
    case ",$l," in
      *,pp=*) case "${EQ_PP_COMM:-nccl}" in
                staged) runs="$runs $l+staged" ;;
                both) runs="$runs $l $l+staged" ;;
                *) runs="$runs $l" ;;
              esac ;;
      *) runs="$runs $l" ;;
    esac
  done
  for run in $runs; do
    l="${run%+staged}"
    # world = tp * pp * dp with dp derived: the product of tp and pp, times
    # dp when given, else times what ep needs (ep folds into tp * dp)
    np=1; sets=()
    for kv in ${l//,/ }; do sets+=(--set "parallel.$kv"); done
    # +staged: pipeline messages (and every collective) through host memory
    [ "$run" != "$l" ] && sets+=(--set parallel.comm=staged)
    np=$(echo "$l" | awk -F, '{ tp = 1; pp = 1; dp = 0; ep = 1
      for (i = 1; i <= NF; i++) { split($i, a, "="); if (a[1] == "tp") tp = a[2]; if (a[1] == "pp") pp = a[2];
        if (a[1] == "dp") dp = a[2]; if (a[1] == "ep") ep = a[2] }
      if (dp == 0) { dp = 1; while (tp * dp % ep) dp++ }
      print tp * pp * dp }')
    [ "$np" -gt "$ngpu" ] && { echo "$run: needs $np GPUs, skipped"; continue; }
    f="$out/eq-${run//[=,+]/_}"
    mpi "$np" "$bin/moetraind" "${tiny[@]}" "${sets[@]}" --set parallel.dp=0 \
      --metrics-jsonl "$f.jsonl" > "$f.log" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "$run ($np GPUs): rc=$rc: $(grep -m1 -E ' E |error|refuse' "$f.log" | cut -c1-200)"
    else
      echo "$run ($np GPUs): largest relative loss difference to one GPU $(max_rel "$out/eq-1.jsonl" "$f.jsonl")"
    fi
  done
fi
if want proxy; then
  steps="${PROXY_STEPS:-20}"
  FROM="${PROXY_FROM:-3}"
  proxy=(--job "$ex/dsv3-proxy.json" --set data.path="$bundle/data/synth-dsv3" --set train.steps="$steps"
         --set checkpoint.dir=)
  report() { # NAME GPUS FILE (tokens_per_s counts every rank's tokens; tflops is per rank)
    local tps; tps=$(median "$3" tokens_per_s)
    echo "$1: step $(median "$3" step_ms) ms, tokens/s $tps ($(awk -v t="$tps" -v n="$2" 'BEGIN { if (t == "-") print "-"; else printf "%.0f", t / n }') per GPU), model TFLOPS/GPU $(median "$3" tflops), expert load max $(median "$3" load_max) (medians of steps $FROM..$steps)"
  }
  echo "== proxy: one GPU"
  CUDA_VISIBLE_DEVICES=0 "$bin/moetraind" "${proxy[@]}" ${PROXY_SETS:-} --metrics-jsonl "$out/proxy-1.jsonl" \
    > "$out/proxy-1.log" 2>&1 || echo "one GPU rc=$?: $(tail -n 2 "$out/proxy-1.log")"
  report "1 GPU" 1 "$out/proxy-1.jsonl"
  for ep in 2 4 8; do
    [ "$ep" -gt "$ngpu" ] && break
    echo "== proxy: ep=$ep on $ep GPUs"
    # weak scaling: every GPU runs the one-GPU run's micro-batches
    mpi "$ep" "$bin/moetraind" "${proxy[@]}" ${PROXY_SETS:-} --set parallel.ep="$ep" --set parallel.dp=0 \
      --set batch.global_batch_size=$((ep * ${PROXY_GBS:-4})) \
      --metrics-jsonl "$out/proxy-ep$ep.jsonl" > "$out/proxy-ep$ep.log" 2>&1 ||
      echo "ep=$ep rc=$?: $(grep -m1 -E ' E ' "$out/proxy-ep$ep.log" | cut -c1-200)"
    report "ep=$ep" "$ep" "$out/proxy-ep$ep.jsonl"
  done
fi
if want ckpt; then
  ranks="${CKPT_RANKS:-$ngpu}"
  layout="${CKPT_LAYOUT:-ep=$ranks}"
  shared=(); [ "$ranks" -gt "$ngpu" ] && shared=(--set parallel.comm=mpi)
  dir="${CKPT_DIR:-/tmp/mg-ckpt}"
  rm -rf "$dir"; mkdir -p "$dir"
  sets=(); for kv in ${layout//,/ }; do sets+=(--set "parallel.$kv"); done
  ck=(--job "$ex/dsv3-proxy.json" --set data.path="$bundle/data/synth-dsv3" --set data.valid_interval=0
      --set checkpoint.dir="$dir" --set checkpoint.async=true --set lr_schedule.warmup_steps=2 ${PROXY_SETS:-})
  echo "== ckpt: the proxy at $layout, $ranks ranks on $ngpu GPUs ${shared[*]}, saves at steps 2 and 4 into $dir"
  mpi "$ranks" "$bin/moetraind" "${ck[@]}" "${sets[@]}" "${shared[@]}" --set parallel.dp=0 --set train.steps=4 \
    --set checkpoint.interval=2 --metrics-jsonl "$out/ckpt-save.jsonl" > "$out/ckpt-save.log" 2>&1
  echo "rc=$?"; grep -E "committed|failed| E " "$out/ckpt-save.log" | cut -c1-240
  grep -o '"step_ms":[0-9.]*' "$out/ckpt-save.jsonl" | tr '\n' ' '; echo "(step times: saves after steps 2 and 4)"
  bytes=$(du -sb "$dir/step_00000004" 2>/dev/null | cut -f1)
  if [ -n "$bytes" ]; then
    ls -la "$dir/step_00000004" | head -n 12
    mb=$(( bytes / 1048576 ))
    t0=$(date +%s.%N); dd if=/dev/zero of="$dir/dd.bin" bs=1M count="$mb" conv=fsync status=none; t1=$(date +%s.%N)
    echo "dd write $mb MiB: $(awk -v b="$bytes" -v a="$t0" -v c="$t1" 'BEGIN { printf "%.2f GB/s", b / (c - a) / 1e9 }')"
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && dropped="page cache dropped" || dropped="page cache NOT dropped"
    t0=$(date +%s.%N); dd if="$dir/dd.bin" of=/dev/null bs=1M status=none; t1=$(date +%s.%N)
    echo "dd read: $(awk -v b="$bytes" -v a="$t0" -v c="$t1" 'BEGIN { printf "%.2f GB/s", b / (c - a) / 1e9 }') ($dropped)"
    rm -f "$dir/dd.bin"
  fi
  echo "== ckpt: continue on one GPU ${PROXY1_SETS:-}"
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  CUDA_VISIBLE_DEVICES=0 "$bin/moetraind" "${ck[@]}" ${PROXY1_SETS:-} --set train.steps=6 --resume auto \
    --metrics-jsonl "$out/ckpt-1.jsonl" > "$out/ckpt-1.log" 2>&1
  echo "rc=$?"; grep -E "restored|verified|continuing| E |step +[56]/" "$out/ckpt-1.log" | cut -c1-240
  l2="${CKPT_LAYOUT2:-}"; [ -z "$l2" ] && { [ "$layout" = "ep=4" ] && l2="ep=2" || l2="dp=2"; }
  sets=(); for kv in ${l2//,/ }; do sets+=(--set "parallel.$kv"); done
  echo "== ckpt: continue on 2 GPUs at $l2"
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  mpi 2 "$bin/moetraind" "${ck[@]}" "${sets[@]}" --set parallel.dp=0 --set train.steps=6 --resume auto \
    --metrics-jsonl "$out/ckpt-2.jsonl" > "$out/ckpt-2.log" 2>&1
  echo "rc=$?"; grep -E "restored|verified|continuing| E |step +[56]/" "$out/ckpt-2.log" | cut -c1-240
  echo "losses after the resume (step loss): one GPU: $(losses "$out/ckpt-1.jsonl" | tr '\n' ' ') 2 GPUs: $(losses "$out/ckpt-2.jsonl" | tr '\n' ' ')"
fi
