#!/usr/bin/env bash
# tests/bench/bench_ckpt.sh - checkpoint save / load / verify against dd on
# the same disk (issue 23): one rank, then N ranks under mpirun (aggregate).
#
#   bench_ckpt.sh [--build DIR | --bundle DIR] [--dir DIR] [--scale K]
#                 [--ranks N] [--rank-scale K] [--repeat R] [--threads T]
#
#   --build DIR    a build tree (default: build/ beside this checkout)
#   --bundle DIR   a deploy/bundle.sh bundle instead (made with --with-mpi for
#                  the multi-rank case; needs nothing else installed)
#   --dir DIR      where the checkpoints and dd's files go: the disk measured
#                  (default /tmp/bench_ckpt)
#   --scale K      single-rank checkpoint of about 2.3 GB x K (default 1)
#   --ranks N      also N ranks under mpirun, dp = N (default 4; 1: skip)
#   --rank-scale K each rank's model in the multi-rank case (default scale/N)
#   --repeat R     each figure the best of R runs (default 3)
#   --threads T    CPU backend threads per rank (default: cores / ranks)
#   --io LIST      single-rank passes: default (the code's defaults: shard
#                  chunks written with O_DIRECT where the file system takes
#                  it), buffered (MT_CKPT_DIRECT=0: through the page cache);
#                  default "default,buffered". The N-rank case runs with the
#                  defaults. MT_CKPT_* variables in the environment (e.g.
#                  MT_CKPT_THREADS, MT_CKPT_DIRECT_READ) reach every run.
#
# verify is `moetrain-ckpt verify` run as its own process over every rank's
# file (under mpirun: the aggregate, against the ranks' dd reads at once).
# Prints each run's table (GB/s, % of dd, peak memory) and the rows for
# tests/bench/RESULTS.md with date, machine and commit. Memory: the job
# holds about 4.8 x the checkpoint (weights, gradients, optimizer state)
# plus the async saves' snapshot (1 x); keep scale x 11 GB below the RAM.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "$here/../.." && pwd)"
build="$src/build" bundle="" dir=/tmp/bench_ckpt scale=1 ranks=4 rank_scale="" repeat=3 threads="" io="default,buffered"
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --bundle) bundle="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --scale) scale="$2"; shift 2 ;;
    --ranks) ranks="$2"; shift 2 ;;
    --rank-scale) rank_scale="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --io) io="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "bench_ckpt.sh: unknown option $1" >&2; exit 1 ;;
  esac
done
if [ -n "$bundle" ]; then
  bundle="$(cd "$bundle" && pwd)"
  bench="$bundle/bin/bench_ckpt" synth="$bundle/bin/moetrain-data" examples="$bundle/deploy/examples"
  ckpt_tool="$bundle/bin/moetrain-ckpt"
  mpirun="$bundle/bin/mpirun"
  # always: a host's own Open MPI (Ubuntu's on the lent hosts) at the same
  # paths has other PMIx plugins, which the bundle's orted cannot load
  if [ -x "$bundle/mpi/install.sh" ]; then "$bundle/mpi/install.sh"; fi
  export PATH="$bundle/libexec:$PATH" # a singleton MPI_Init starts orted
  commit="$(sed -n 's/^commit: //p' "$bundle/BUNDLE.txt" 2>/dev/null || echo unknown)"
else
  bench="$build/tests/bench/bench_ckpt" synth="$build/engine/moetrain-data" examples="$src/deploy/examples"
  ckpt_tool="$build/ckpt/moetrain-ckpt"
  mpirun="$(command -v mpirun || true)"
  commit="$(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  [ -z "$(git -C "$src" status --porcelain --untracked-files=no 2>/dev/null)" ] || commit="$commit+changes"
fi
[ -x "$bench" ] || { echo "bench_ckpt.sh: no $bench (build it: make bench_ckpt)" >&2; exit 2; }
[ -x "$ckpt_tool" ] || { echo "bench_ckpt.sh: no $ckpt_tool (verify runs it; build it: make moetrain-ckpt)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The CPU backend's OpenMP threads would spin between its parallel loops
# and take the cores the checkpoint's I/O threads need (a fifth of a
# restore's CPU time on the 2-core VM).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
cores=$(getconf _NPROCESSORS_ONLN) # not nproc: it follows OMP_NUM_THREADS
mkdir -p "$dir"
fs=$(df -T "$dir" | awk 'NR == 2 {print $2 " on " $1}')
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
machine="$cores cores ($cpu), $(free -g | awk '/Mem:/ {print $2}') GB, $fs, load average $(cut -d' ' -f1 /proc/loadavg) at the start"
echo "machine: $machine"
echo "commit:  $commit"
rows=()

# one rank, with the page cache and past it
t1=${threads:-$cores}
for mode in ${io//,/ }; do
  out="$dir/one.$mode.log"
  echo "== one rank, $mode writes"
  case "$mode" in
    default) direct="${MT_CKPT_DIRECT-}" ;;
    buffered) direct=0 ;;
    direct) direct=1 ;;
    *) echo "bench_ckpt.sh: --io: unknown pass $mode" >&2; exit 1 ;;
  esac
  MT_CKPT_DIRECT="$direct" \
    "$bench" --dir "$dir/run" --examples "$examples" --synth "$synth" --ckpt-tool "$ckpt_tool" \
    --scale "$scale" --repeat "$repeat" --threads "$t1" 2>&1 | grep -v '^\[moetrain' | tee "$out"
  rows+=("$(grep '^| 1 |' "$out" | sed "s/^| 1 |/| 1 ($mode) |/")")
done

# N ranks, each writing its own shard at the same time
if [ "$ranks" -gt 1 ]; then
  if [ -z "$mpirun" ]; then
    echo "bench_ckpt.sh: no mpirun: the $ranks-rank case is skipped"
  else
    rs=${rank_scale:-$(awk -v s="$scale" -v n="$ranks" 'BEGIN {print s / n}')}
    tn=${threads:-$(( cores / ranks > 0 ? cores / ranks : 1 ))}
    out="$dir/ranks.log"
    echo "== $ranks ranks, default writes"
    fwd=()
    for v in $(env | sed -n 's/^\(MT_CKPT_[A-Z_]*\)=.*/\1/p'); do fwd+=(-x "$v"); done
    "$mpirun" --oversubscribe "${fwd[@]}" -np "$ranks" "$bench" --dir "$dir/run" --examples "$examples" \
      --synth "$synth" --ckpt-tool "$ckpt_tool" --scale "$rs" --repeat "$repeat" --threads "$tn" 2>&1 | grep -v '^\[moetrain' | tee "$out"
    rows+=("$(grep "^| $ranks |" "$out" | sed "s/^| $ranks |/| $ranks (default) |/")")
  fi
fi

echo
echo "RESULTS.md rows (date | machine | commit | ranks | checkpoint | save | async write | dd write |"
echo "  load | verify | dd read | async stall / host copy | MB peak save / load / verify):"
for r in "${rows[@]}"; do
  echo "| $(date +%F) | $machine | $commit |${r#|}"
done
rm -rf "$dir/run"
