#!/bin/bash
# ckpt_load_share.sh BIN_DIR SOURCE_DIR TMP
#
# Property (issue 23, "a rank reads only what it owns"): a multi-rank
# restore reads each replicated weight on one replica of its group and
# sends it to the others, and the result is the restore where every rank
# reads everything itself (MT_CKPT_NO_SHARED_LOAD=1), bit for bit. From a
# checkpoint saved at dp = 2, resumed at dp = 4 (the readers' groups differ
# from the writer's):
#   - the 4 ranks split the replicated weights: each logs how many it read,
#     they add up to all of them, and no rank read them all;
#   - shared and unshared restores continue with the same losses and save
#     the same checkpoint at step 6, byte for byte (moetrain-ckpt diff);
#   - a damaged weight (one flipped byte) fails the load on every rank, with
#     the tensor named, and hangs no rank.
set -euo pipefail
bin=$1 src=$2 tmp=$3
. "$src/tests/ckpt_resume_lib.sh"
ck="$bin/ckpt/moetrain-ckpt"
run 2 two --set checkpoint.dir="$tmp/ck" --set checkpoint.interval=3
src_ck=$tmp/ck/step_00000003
[ -d "$src_ck" ] || { echo "FAIL: dp = 2 saved no checkpoint at step 3"; exit 1; }
resume=(--set init.kind=checkpoint --set init.path="$src_ck" --set checkpoint.interval=3)
run 4 shared "${resume[@]}" --set checkpoint.dir="$tmp/shared"
MT_CKPT_NO_SHARED_LOAD=1 run 4 alone "${resume[@]}" --set checkpoint.dir="$tmp/alone"

# the split: "restore: K of N replicated weights read here" on each rank
grep -o 'restore: [0-9]* of [0-9]* replicated weights' "$tmp/shared.log" | awk '
    { k += $2; n = $4; if ($2 > mx) mx = $2; r++ }
    END { printf "4 ranks read %d of %d replicated weights (at most %d on one)\n", k, n, mx
          exit !(r == 4 && n > 0 && k == n && mx < n) }' ||
    { echo "FAIL: the replicated weights were not split among the 4 ranks"; cat "$tmp/shared.log"; exit 1; }
if grep -q 'replicated weights read here' "$tmp/alone.log"; then
    echo "FAIL: MT_CKPT_NO_SHARED_LOAD=1 still shared the reads"; exit 1
fi

# the same bits: losses and the next checkpoint
[ "$(losses "$tmp/shared.jsonl")" = "$(losses "$tmp/alone.jsonl")" ] || {
    echo "FAIL: the shared restore continues with other losses than the unshared one"
    paste <(losses "$tmp/shared.jsonl") <(losses "$tmp/alone.jsonl"); exit 1; }
"$ck" diff "$tmp/shared/step_00000006" "$tmp/alone/step_00000006" > "$tmp/diff.txt" || {
    echo "FAIL: the step-6 checkpoints of the shared and unshared restores differ"
    head "$tmp/diff.txt"; exit 1; }
echo "shared restore at dp = 4: same losses and same step-6 checkpoint as every rank reading all"

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
set +e
timeout 300 mpirun --allow-run-as-root --oversubscribe -np 4 "$bin/tests/ckpt_run" "${common[@]}" \
    --set init.kind=checkpoint --set init.path="$tmp/bad" 2> "$tmp/bad.log"
rc=$?
set -e
[ $rc -ne 124 ] || { echo "FAIL: the damaged load hung"; tail "$tmp/bad.log"; exit 1; }
[ $rc -ne 0 ] || { echo "FAIL: a load with $hit damaged succeeded"; exit 1; }
grep -q "$hit" "$tmp/bad.log" || { echo "FAIL: the damaged $hit is not named:"; tail "$tmp/bad.log"; exit 1; }
if grep -q 'restored step' "$tmp/bad.log"; then
    echo "FAIL: some rank restored from a damaged checkpoint"; grep 'restored step' "$tmp/bad.log"; exit 1
fi
echo "damaged $hit: every rank failed, the tensor named"
[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"
