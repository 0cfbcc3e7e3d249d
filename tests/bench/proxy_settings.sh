#!/usr/bin/env bash
# tests/bench/proxy_settings.sh - the DSV3 proxy (deploy/examples/dsv3-proxy.json)
# under several memory settings, one process each, on one GPU.
#
#   proxy_settings.sh BUNDLE OUT STEPS 'NAME=[VAR=value ...] --set a=b --set c=d' ...
#
# (leading VAR=value words of a setting go to its environment, e.g.
# MOETRAIN_OP_PROFILE=4 for the per-op profile, which lands in its log;
# PROXY_TIMEOUT, default 240 s, bounds each run)
# BUNDLE is a deploy/bundle.sh bundle (with tests/bench/device_run.sh's
# layout); each setting runs moetraind for STEPS steps over a 2 M-token
# synthetic corpus (made once, vocab 2048, seed 1, as RESULTS.md's proxy
# runs) with its metrics in OUT/NAME.jsonl and its log in OUT/NAME.log. The
# table printed last gives per setting: the median step time of steps
# 2..STEPS, tokens/s and model TFLOPS/GPU at that median, the peak of the
# backend's memory arena (bytes the model, optimizer, activations and
# workspace held at most; the CUDA context and libraries come on top), and
# the losses of the first steps. A setting that does not fit ends with the
# arena's out-of-memory error: its row says so.
set -uo pipefail
bundle="$(cd "$1" && pwd)"
out="$2"
steps="$3"
shift 3
mkdir -p "$out"
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -x "$bundle/mpi/install.sh" ] && "$bundle/mpi/install.sh"
export PATH="$bundle/libexec:$PATH"
data=/tmp/synth-dsv3
[ -e "$data.bin" ] || "$bundle/bin/moetrain-data" synth --output "$data" --vocab 2048 \
  --tokens 2000000 --seed 1 > /dev/null || exit 3
summary() { # the table of the given settings, from their jsonl files
  python3 - "$out" "$@" <<'EOF'
import json, os, statistics, sys
out = sys.argv[1]
print("| setting | steps | step (median) | tokens/s | model TFLOPS/GPU | peak arena | losses of steps 1..5 | grad norm 1, 2 |")
print("|---|---|---|---|---|---|---|---|")
for spec in sys.argv[2:]:
    name = spec.split("=", 1)[0]
    path = os.path.join(out, name + ".jsonl")
    rows = []
    if os.path.exists(path):
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "step_ms" in r and "loss" in r:
                rows.append(r)
    if not rows:
        print(f"| {name} | 0 | did not run (see {name}.log) | | | | | |")
        continue
    later = rows[1:] or rows
    ms = statistics.median(r["step_ms"] for r in later)
    mid = min(later, key=lambda r: abs(r["step_ms"] - ms))
    peak = max(r.get("mem_peak", 0) for r in rows) / 1e9
    losses = " ".join(f"{r['loss']:.4f}" for r in rows[:5])
    gn = " ".join(f"{r['grad_norm']:.4f}" for r in rows[:2])
    print(f"| {name} | {len(rows)} | {ms:.1f} ms | {mid['tokens_per_s']:.0f} | "
          f"{mid['tflops']:.1f} | {peak:.1f} GB | {losses} | {gn} |")
EOF
}
for spec in "$@"; do
  name="${spec%%=*}"
  envs=()
  sets=()
  for w in ${spec#*=}; do
    if [ ${#sets[@]} -eq 0 ] && [[ "$w" != --* ]] && [[ "$w" == *=* ]]; then envs+=("$w"); else sets+=("$w"); fi
  done
  t0=$SECONDS
  env "${envs[@]}" timeout "${PROXY_TIMEOUT:-240}" "$bundle/bin/moetraind" \
    --job "$bundle/deploy/examples/dsv3-proxy.json" --set data.path="$data" \
    --set train.steps="$steps" "${sets[@]}" --metrics-jsonl "$out/$name.jsonl" > "$out/$name.log" 2>&1
  echo "== $name rc=$? ($((SECONDS - t0)) s): ${spec#*=}"
  grep -E "job dsv3|out of memory|ENOMEM| E " "$out/$name.log" | head -3
  summary "$spec" | tail -1
done
echo "== proxy settings, $steps steps each"
summary "$@"
