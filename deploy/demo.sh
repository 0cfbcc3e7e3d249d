#!/usr/bin/env bash
# deploy/demo.sh - the main job: prepare the embedded default dataset (a
# synthetic order-2 Markov corpus with a known entropy floor), start the
# moetraind daemon, and drive it with the moetrain CLI: start the embedded
# tiny DeepSeek-V3 job (deploy/examples/tiny-cpu.json), watch it, pause and
# resume it, save a checkpoint, and follow it to the end. On the CPU unless
# a GPU is present. The web dashboard shows the run live at the http://
# address it prints. Run deploy/setup.sh first.
#
#   MOETRAIN_BUILD_DIR   build directory (default: build)
#   DEMO_STEPS           train.steps of the demo job (default: the file's 300)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MOETRAIN_BUILD_DIR:-$root/build}"
work="$build/demo"
mkdir -p "$work"

if [ ! -f "$work/synth.idx" ]; then
  echo "demo: generating the default corpus in $work/synth.{bin,idx}"
  "$build/engine/moetrain-data" synth --output "$work/synth" --vocab 64 --tokens 4000000 \
    --seed 1 --branching 4
fi
"$build/engine/moetrain-data" inspect "$work/synth"

# The daemon: gRPC and HTTP on loopback (free ports, written to the ready
# file), checkpoints under $work/wd (a fresh one each demo).
rm -rf "$work/wd" "$work/ready"
"$build/service/moetraind" --listen 127.0.0.1:0 --http 127.0.0.1:0 --workdir "$work/wd" \
  --ready-file "$work/ready" 2> "$work/moetraind.log" &
daemon=$!
watcher=""
cleanup() {
  [ -n "$watcher" ] && kill "$watcher" 2> /dev/null || true
  kill -TERM "$daemon" 2> /dev/null && wait "$daemon" 2> /dev/null || true
}
trap cleanup EXIT
for _ in $(seq 100); do [ -f "$work/ready" ] && break; sleep 0.1; done
MOETRAIN_SERVER=$(sed -n 's/^grpc=//p' "$work/ready")
http=$(sed -n 's/^http=//p' "$work/ready")
export MOETRAIN_SERVER
moetrain="$build/service/moetrain"
echo "demo: moetraind serves gRPC on $MOETRAIN_SERVER, /metrics on http://$http (log: $work/moetraind.log)"
echo "demo: watch the run live in a browser: http://$http/"

# the GPU when this build has the CUDA backend and a GPU is there, else the CPU
backend=cpu
if grep -q '^MT_HAVE_CUDA_BUILT:INTERNAL=ON' "$build/CMakeCache.txt" 2> /dev/null &&
  nvidia-smi -L > /dev/null 2>&1; then
  backend=cuda
fi

set -x
"$moetrain" health
"$moetrain" start "$root/deploy/examples/tiny-cpu.json" --set "data.path=$work/synth" \
  --set "backend=$backend" ${DEMO_STEPS:+--set train.steps=$DEMO_STEPS}
{ set +x; } 2> /dev/null

# watch: one line per step with a progress bar, until the job ends
"$moetrain" watch &
watcher=$!
step() { "$moetrain" status --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["step"])'; }
until [ "$(step)" -ge 20 ]; do sleep 0.5; done

set -x
"$moetrain" pause
"$moetrain" status
{ set +x; } 2> /dev/null
sleep 2
set -x
"$moetrain" resume
"$moetrain" save
"$moetrain" checkpoints
{ set +x; } 2> /dev/null
echo "demo: a few lines of /metrics:"
/usr/bin/python3 -c 'import sys,urllib.request
page = urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=10).read().decode()
print("\n".join(l for l in page.splitlines() if l.startswith(("moetrain_loss ", "moetrain_steps_total", "moetrain_expert_load_max_ratio"))))' "$http"

wait "$watcher"
watcher=""
"$moetrain" status
echo "demo: done; the checkpoints are in $work/wd/checkpoints/tiny-cpu"
