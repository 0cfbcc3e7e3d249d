#!/usr/bin/env bash
# deploy/bundle.sh - a relocatable bundle of moetrain's binaries for a machine
# that has the NVIDIA driver and CUDA libraries but not our other
# dependencies (gRPC, HDF5, OpenMPI, jansson, ...).
#
#   deploy/bundle.sh [--build DIR] [--out DIR] [--with-mpi] [--tests] [--add EXE ...]
#
# Layout of the bundle:
#   bin/NAME        wrapper: sets LD_LIBRARY_PATH to lib/ and runs libexec/NAME
#   libexec/        the real executables (moetraind, moetrain, moetrain-data,
#                   moetrain-ckpt, benchmarks; every test with --tests, or
#                   the ones named with --add)
#   lib/            every shared library they need that is not part of the
#                   C runtime, the NVIDIA driver or the CUDA toolkit
#   mpi/            with --with-mpi: Debian's OpenMPI and PMIx trees, which
#                   OpenMPI finds only at their absolute paths; mpi/install.sh
#                   copies them there (root) on the target
#   deploy/examples, deploy/{launch,slurm,k8s,systemd} (README "Operations"),
#   BUNDLE.txt (versions, commit, how to run)
# CUDA libraries (cudart, cuBLAS(Lt), cuDNN, NCCL) are left to the target:
# they must match its driver.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build"
out="$root/bundle"
with_mpi=0
tests=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --with-mpi) with_mpi=1; shift ;;
    --tests) tests=1; shift ;;
    --add) extra+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "bundle: unknown option $1" >&2; exit 1 ;;
  esac
done
[ -d "$build" ] || { echo "bundle: no build directory $build (run deploy/setup.sh)" >&2; exit 2; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/libexec" "$out/lib"

exes=()
for name in service/moetraind service/moetrain engine/moetrain-data ckpt/moetrain-ckpt; do
  [ -x "$build/$name" ] && exes+=("$build/$name")
done
while IFS= read -r f; do exes+=("$f"); done < <(find "$build/tests/bench" -maxdepth 1 -type f -executable -name 'bench_*' 2>/dev/null)
if [ "$tests" = 1 ]; then
  while IFS= read -r f; do exes+=("$f"); done < <(find "$build/tests" -maxdepth 1 -type f -executable -name 'test_*' 2>/dev/null)
fi
for f in "${extra[@]}"; do
  [ -x "$f" ] || f="$build/$f"
  [ -x "$f" ] || { echo "bundle: no executable $f" >&2; exit 2; }
  exes+=("$f")
done
[ ${#exes[@]} -gt 0 ] || { echo "bundle: nothing built in $build" >&2; exit 2; }

# Libraries the target provides: C runtime, driver, CUDA toolkit.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libgcc_s|libstdc\+\+|libcuda\.so|libcudart|libcublas|libcublasLt|libcudnn|libnccl|libnvrtc|libnvJitLink)'
for exe in "${exes[@]}"; do
  name="$(basename "$exe")"
  cp "$exe" "$out/libexec/$name"
  strip --strip-debug "$out/libexec/$name" 2>/dev/null || true
  cat > "$out/bin/$name" <<'WRAP'
#!/bin/sh
here="$(cd "$(dirname "$0")/.." && pwd)"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/$(basename "$0")" "$@"
WRAP
  chmod +x "$out/bin/$name"
  ldd "$exe" | awk '/=> \// {print $1, $3}' | while read -r soname path; do
    if ! [[ "$soname" =~ $skip ]] && [ ! -e "$out/lib/$soname" ]; then
      cp -L "$path" "$out/lib/$soname"
      strip --strip-unneeded "$out/lib/$soname" 2>/dev/null || true
    fi
  done
done

if [ "$with_mpi" = 1 ]; then
  mkdir -p "$out/mpi"
  for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/share/openmpi /etc/openmpi; do
    [ -e "$d" ] && mkdir -p "$out/mpi$(dirname "$d")" && cp -a "$d" "$out/mpi$(dirname "$d")/"
  done
  # MPI components load libraries of their own (hwloc, event, pmix): bring them too.
  find "$out/mpi" -name '*.so*' -type f | while read -r so; do
    ldd "$so" 2>/dev/null | awk '/=> \// {print $1, $3}' | while read -r soname path; do
      if ! [[ "$soname" =~ $skip ]] && [ ! -e "$out/lib/$soname" ]; then cp -L "$path" "$out/lib/$soname"; fi
    done
  done
  for tool in mpirun mpiexec orterun orted; do
    p="$(command -v "$tool" || true)"
    if [ -n "$p" ]; then cp -L "$p" "$out/libexec/$tool"; fi
  done
  cat > "$out/mpi/install.sh" <<'INST'
#!/bin/sh
# Places OpenMPI's and PMIx's trees at the absolute paths OpenMPI expects.
set -e
here="$(cd "$(dirname "$0")" && pwd)"
cp -a "$here/usr" "$here/etc" / 2>/dev/null || cp -a "$here/usr" /
INST
  chmod +x "$out/mpi/install.sh"
  cat > "$out/bin/mpirun" <<'WRAP'
#!/bin/sh
here="$(cd "$(dirname "$0")/.." && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$here/libexec:$PATH"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
exec "$here/libexec/mpirun" "$@"
WRAP
  chmod +x "$out/bin/mpirun"
fi

mkdir -p "$out/deploy"
cp -a "$root/deploy/examples" "$out/deploy/"
# the launchers (README "Operations"): they expect the bundle in /opt/moetrain
for d in launch slurm k8s systemd; do cp -a "$root/deploy/$d" "$out/deploy/"; done
{
  echo "moetrain bundle"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "cuda: $(grep -o 'CMAKE_CUDA_COMPILER_VERSION:[^=]*=.*' "$build/CMakeCache.txt" 2>/dev/null | cut -d= -f2 || echo none)"
  echo "run:  bin/moetraind --job deploy/examples/... (with --with-mpi: mpi/install.sh once, then bin/mpirun)"
} > "$out/BUNDLE.txt"
du -sh "$out" | awk '{print "bundle: " $1 " in '"$out"'"}'
