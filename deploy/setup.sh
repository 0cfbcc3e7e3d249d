#!/usr/bin/env bash
# deploy/setup.sh - install what moetrain needs from Debian and build it into
# build/. Idempotent: packages already present are not reinstalled, an
# existing build directory is reused, so a second run only rebuilds what
# changed.
#
#   MOETRAIN_BUILD_DIR   build directory (default: build)
#   MOETRAIN_CMAKE_ARGS  extra CMake arguments, e.g. -DMOETRAIN_CUDA=OFF
#
# No npm here: the dashboard's one library (uPlot) is vendored in
# service/web/vendor/, pinned by service/web/package-lock.json; the build
# embeds it from there, so building and testing need neither npm nor the
# registry (service/web/README.md; vendor.sh updates it).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${MOETRAIN_BUILD_DIR:-$root/build}"

packages=(
  build-essential cmake pkg-config git
  libopenmpi-dev openmpi-bin                  # MPI (ranks, CPU collectives)
  libhdf5-openmpi-dev hdf5-tools              # parallel HDF5 checkpoints, h5dump
  libjansson-dev                              # JSON job specs and configs
  libcmocka-dev                               # unit tests
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
  libmicrohttpd-dev                           # /metrics, /healthz and the web dashboard
  protobuf-compiler-grpc python3 python3-grpcio python3-grpc-tools python3-protobuf
  grpc-proto                                  # grpc health + reflection .proto files
  openssl                                     # the TLS test's self-signed certificate
  python3-numpy python3-h5py                  # the foreign gRPC client test, h5 checks
  python3-yaml                                # test_monitoring_files reads the Prometheus files
  chromium chromium-driver                    # test_dashboard_browser (headless, via chromedriver)
  clang libclang-rt-14-dev                    # libFuzzer targets
  python3-yaml shellcheck                     # ops tests: manifests, deploy scripts
  slurm-wlm munge                             # ops_slurm: a local single-node Slurm
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

if [ ! -f "$build/CMakeCache.txt" ]; then
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${MOETRAIN_CMAKE_ARGS:-}
fi
cmake --build "$build" -j"$(nproc)"
echo "setup: built into $build"
