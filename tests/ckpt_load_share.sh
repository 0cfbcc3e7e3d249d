#!/bin/bash
# ckpt_load_share.sh BIN_DIR SOURCE_DIR TMP
#
# Property (issue 23, "a rank reads only what it owns"): a multi-rank
# restore reads each replicated weight on one replica of its group (dp, or
# edp for routed experts) and sends it to the others, and the result is
# the restore where every rank reads everything itself
# (MT_CKPT_SHARED_LOAD=0), bit for bit. Sharing is the default where the
# ranks span hosts; on one host (this test) the default reads everything on
# every rank, and MT_CKPT_SHARED_LOAD=1 shares. From checkpoints saved at
# dp = 2, resumed on 4 ranks (the readers' groups differ from the writer's):
#   - on one host the default restore shares nothing;
#   - at dp = 4 the ranks split the replicated weights: each logs how many
#     it read, they add up to all of them, and no rank read them all;
#   - shared and unshared restores continue with the same losses and save
#     the same checkpoint at step 6, byte for byte (moetrain-ckpt diff), at
#     dp = 4, ep = 2 x dp = 4 (experts shared over edp = 2), tp = 2 x dp = 2
#     (tp slabs shared over dp), and at dp = 4 under fp8-blockwise (E4M3
#     bytes and block scales sent);
#   - a damaged weight (one flipped byte) fails the load on every rank, with
#     the tensor named, and hangs no rank, shared and unshared.
set -euo pipefail
bin=$1 src=$2 tmp=$3
. "$src/tests/ckpt_resume_lib.sh"
ck="$bin/ckpt/moetrain-ckpt"
fp8=(--set precision.recipe=fp8-blockwise)
run 2 two --set checkpoint.dir="$tmp/ck" --set checkpoint.interval=3
run 2 two8 "${fp8[@]}" --set checkpoint.dir="$tmp/ck8" --set checkpoint.interval=3
src_ck=$tmp/ck/step_00000003
for d in "$src_ck" "$tmp/ck8/step_00000003"; do
    [ -d "$d" ] || { echo "FAIL: dp = 2 saved no checkpoint $d"; exit 1; }
done

# same NAME CKPT [SETTINGS...]: resumed on 4 ranks from CKPT shared and
# unshared, the same losses and the same step-6 checkpoint
same() {
    local name=$1 from=$2; shift 2
    local resume=(--set init.kind=checkpoint --set init.path="$from" --set checkpoint.interval=3 "$@")
    MT_CKPT_SHARED_LOAD=1 run 4 "$name" "${resume[@]}" --set checkpoint.dir="$tmp/$name"
    MT_CKPT_SHARED_LOAD=0 run 4 "$name.alone" "${resume[@]}" --set checkpoint.dir="$tmp/$name.alone"
    grep -q 'replicated weights read here' "$tmp/$name.log" ||
        { echo "FAIL: $name: the restore shared nothing"; cat "$tmp/$name.log"; exit 1; }
    if grep -q 'replicated weights read here' "$tmp/$name.alone.log"; then
        echo "FAIL: $name: MT_CKPT_SHARED_LOAD=0 still shared the reads"; exit 1
    fi
    [ "$(losses "$tmp/$name.jsonl")" = "$(losses "$tmp/$name.alone.jsonl")" ] || {
        echo "FAIL: $name: the shared restore continues with other losses than the unshared one"
        paste <(losses "$tmp/$name.jsonl") <(losses "$tmp/$name.alone.jsonl"); exit 1; }
    "$ck" diff "$tmp/$name/step_00000006" "$tmp/$name.alone/step_00000006" > "$tmp/$name.diff" || {
        echo "FAIL: $name: the step-6 checkpoints of the shared and unshared restores differ"
        head "$tmp/$name.diff"; exit 1; }
    echo "$name: shared restore on 4 ranks: same losses and step-6 checkpoint as every rank reading all"
}
same dp4 "$src_ck"
run 4 dp4.default --set init.kind=checkpoint --set init.path="$src_ck" --set checkpoint.interval=3 \
    --set checkpoint.dir="$tmp/dp4.default"
if grep -q 'replicated weights read here' "$tmp/dp4.default.log"; then
    echo "FAIL: on one host the default restore shared the reads"; exit 1
fi
[ "$(losses "$tmp/dp4.default.jsonl")" = "$(losses "$tmp/dp4.jsonl")" ] ||
    { echo "FAIL: the default restore continues with other losses than the shared one"; exit 1; }
echo "dp4: on one host the default restore reads every weight on every rank (same losses)"
# the split: "restore: K of N replicated weights read here" on each rank
grep -o 'restore: [0-9]* of [0-9]* replicated weights' "$tmp/dp4.log" | awk '
    { k += $2; n = $4; if ($2 > mx) mx = $2; r++ }
    END { printf "dp4: 4 ranks read %d of %d replicated weights (at most %d on one)\n", k, n, mx
          exit !(r == 4 && n > 0 && k == n && mx < n) }' ||
    { echo "FAIL: the replicated weights were not split among the 4 ranks"; cat "$tmp/dp4.log"; exit 1; }
same ep2_dp4 "$src_ck" --set parallel.ep=2
same tp2_dp2 "$src_ck" --set parallel.tp=2
same fp8_dp4 "$tmp/ck8/step_00000003" "${fp8[@]}"

# a flipped byte in a weight written by rank 0 (one whose bytes occur once in
# its shard, so that no optimizer copy of it is hit instead)
cp -r "$src_ck" "$tmp/bad"
f=$tmp/bad/shard_00000.h5 hit=
for t in $(h5ls -r "$f" | awk '$2 == "Dataset" && $1 ~ /weight$/ && $1 !~ /norm/ { print substr($1, 2) }'); do
    h5dump -d "/$t" -b LE -o "$tmp/raw.bin" "$f" > /dev/null
    if python3 - "$tmp/raw.bin" "$f" << 'EOF'
import sys
raw, path = open(sys.argv[1], 'rb').read(), sys.argv[2]
b = bytearray(open(path, 'rb').read())
m = len(raw) // 2
if len(raw) < 4096 or b.count(raw[m:m + 64]) != 1: sys.exit(1)
at = b.find(raw[m:m + 64]) + 10
b[at] ^= 0x20
open(path, 'wb').write(b)
EOF
    then hit=$t; break; fi
done
[ -n "$hit" ] || { echo "FAIL: found no weight to damage in $f"; exit 1; }
for share in 1 0; do
    set +e
    MT_CKPT_SHARED_LOAD=$share timeout 300 mpirun --allow-run-as-root --oversubscribe -np 4 \
        "$bin/tests/ckpt_run" "${common[@]}" --set init.kind=checkpoint --set init.path="$tmp/bad" \
        2> "$tmp/bad.log"
    rc=$?
    set -e
    [ $rc -ne 124 ] || { echo "FAIL: the damaged load (shared $share) hung"; tail "$tmp/bad.log"; exit 1; }
    [ $rc -ne 0 ] || { echo "FAIL: a load with $hit damaged succeeded (shared $share)"; exit 1; }
    grep -q "$hit" "$tmp/bad.log" ||
        { echo "FAIL: the damaged $hit is not named (shared $share):"; tail "$tmp/bad.log"; exit 1; }
    if grep -q 'restored step' "$tmp/bad.log"; then
        echo "FAIL: some rank restored from a damaged checkpoint (shared $share)"
        grep 'restored step' "$tmp/bad.log"; exit 1
    fi
    echo "damaged $hit, shared $share: every rank failed, the tensor named"
done
[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
