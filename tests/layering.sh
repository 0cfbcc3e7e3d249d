#!/bin/bash
# layering.sh SOURCE_DIR | --selftest SOURCE_DIR
#
# Property: every file includes only from the floors and rooms below it, and
# only the comm layer talks to MPI and NCCL.
#
#   service/   the gRPC/HTTP surface, the control state machine, the CLI
#   runtime/   a job from admission to its last step (world, groups, checkpoints)
#   ckpt/      the checkpoint format and tools
#   engine/    model/, data/, train/, parallel/ (layout, sharding, comm)
#   kernels/   the op API and its CPU and CUDA backends
#   base/      status, log, files, RNG, JSON helpers
#
# A floor may include its own floor and those below it; inside engine/ the
# rooms have rules of their own (below). A program's main file (it defines
# main) sits on top of everything but the service, whatever folder hosts it
# (moetrain-ckpt in ckpt/, moetrain-data in engine/data/). MPI and NCCL calls, and their
# headers, appear only in engine/parallel/comm*.c, except MPI_Init* and
# MPI_Finalize in a program's main. --selftest copies the tree, adds a
# forbidden include and an MPI call outside the comm layer, and checks that
# both are caught.
set -uo pipefail

check() {
    local root=$1 bad=0
    # allowed include prefixes of each folder (first match wins)
    local rules=(
        "base:base/"
        "kernels:base/ kernels/"
        "engine/data:base/ engine/data/"
        "engine/model:base/ kernels/ engine/model/"
        "engine/parallel:base/ kernels/ engine/model/ engine/parallel/"
        "engine/train:base/ kernels/ engine/"
        "ckpt:base/ kernels/ engine/model/ engine/parallel/ ckpt/"
        "runtime:base/ kernels/ engine/ ckpt/ runtime/"
        "service:base/ kernels/ engine/ ckpt/ runtime/ service/ api/"
    )
    local ours='^(base|kernels|engine|ckpt|runtime|service|api)/'
    for rule in "${rules[@]}"; do
        local dir=${rule%%:*} allowed=${rule#*:}
        [ -d "$root/$dir" ] || { echo "layering: $dir/ is missing"; bad=1; continue; }
        while IFS= read -r hit; do
            local file=${hit%%:*} rest=${hit#*:}
            local line=${rest%%:*}
            local inc
            inc=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<< "${rest#*:}")
            [[ $inc =~ $ours ]] || continue   # generated or local headers
            local ok=0 also=""
            grep -q '^int main(' "$file" && also="base/ kernels/ engine/ ckpt/ runtime/"
            for a in $allowed $also; do [[ $inc == "$a"* ]] && ok=1; done
            if [ $ok = 0 ]; then
                echo "layering: ${file#"$root"/}:$line includes \"$inc\"; $dir/ may include only: $allowed"
                bad=1
            fi
        done < <(grep -rnE '^\s*#\s*include "' "$root/$dir" --include='*.c' --include='*.h' \
                     --include='*.cu' --include='*.cuh')
    done
    # MPI and NCCL only in the comm layer (and MPI_Init / Finalize in mains)
    while IFS= read -r hit; do
        local file=${hit%%:*}
        case ${file#"$root"/} in engine/parallel/comm*.c) continue ;; esac
        if grep -qE 'MPI_(Init|Init_thread|Finalize)\(' <<< "$hit" && grep -q 'int main(' "$file"; then
            continue
        fi
        echo "layering: ${hit#"$root"/}: MPI/NCCL outside the comm layer (engine/parallel/comm*.c)"
        bad=1
    done < <(grep -rnE '\bMPI_[A-Z][a-z_]*\(|\bnccl[A-Z][A-Za-z]*\(|#\s*include <(mpi|nccl)\.h>' \
                 "$root/base" "$root/kernels" "$root/engine" "$root/ckpt" "$root/runtime" "$root/service" \
                 --include='*.c' --include='*.h' --include='*.cu' --include='*.cuh' \
             | grep -v '#include <mpi.h>' | grep -vE ':[0-9]+:\s*(/?\*|//)')
    # <mpi.h> itself: the comm layer, and programs that call MPI_Init
    while IFS= read -r file; do
        case ${file#"$root"/} in engine/parallel/comm*.c) continue ;; esac
        grep -q 'int main(' "$file" && continue
        echo "layering: ${file#"$root"/} includes <mpi.h> outside the comm layer"
        bad=1
    done < <(grep -rlE '#\s*include <(mpi|nccl)\.h>' "$root/base" "$root/kernels" "$root/engine" \
                 "$root/ckpt" "$root/runtime" "$root/service" --include='*.c' --include='*.h' \
                 --include='*.cu' --include='*.cuh')
    return $bad
}

if [ "${1:-}" = --selftest ]; then
    src=$2
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    for d in base kernels engine ckpt runtime service api; do cp -r "$src/$d" "$tmp/$d"; done
    check "$tmp" > "$tmp/clean.log" || { echo "FAIL: the clean copy does not pass:"; cat "$tmp/clean.log"; exit 1; }
    # a kernel that includes the service
    f=$(ls "$tmp"/kernels/cpu/*.c | head -1)
    sed -i '1i #include "service/control.h"' "$f"
    if check "$tmp" > "$tmp/inc.log"; then echo "FAIL: a forbidden include was not caught"; exit 1; fi
    grep -q 'includes "service/control.h"' "$tmp/inc.log" || { echo "FAIL: wrong report:"; cat "$tmp/inc.log"; exit 1; }
    sed -i '1d' "$f"
    # an engine room that reaches up into ckpt/
    f=$tmp/engine/model/model.c
    sed -i '1i #include "ckpt/ckpt.h"' "$f"
    if check "$tmp" > "$tmp/room.log"; then echo "FAIL: engine/model including ckpt/ was not caught"; exit 1; fi
    sed -i '1d' "$f"
    # an MPI call in the service
    echo 'static void stray(void) { MPI_Barrier(MPI_COMM_WORLD); }' >> "$tmp/service/control.c"
    if check "$tmp" > "$tmp/mpi.log"; then echo "FAIL: an MPI call in service/ was not caught"; exit 1; fi
    grep -q 'MPI/NCCL outside the comm layer' "$tmp/mpi.log" || { echo "FAIL: wrong report:"; cat "$tmp/mpi.log"; exit 1; }
    echo "layering selftest: a forbidden include, a room reaching up and a stray MPI call are caught:"
    cat "$tmp/inc.log" "$tmp/room.log" "$tmp/mpi.log"
    exit 0
fi

check "${1:?usage: layering.sh SOURCE_DIR}" || exit 1
echo "layering: every include follows the floors; MPI and NCCL only in the comm layer"
