#!/bin/bash
# ckpt_mpi.sh BIN_DIR SOURCE_DIR TMP
#
# Property: under two MPI ranks (dp = 2, one micro-batch each) each rank
# writes its own shard file (the pieces the sharding map gives it for dp = 2:
# the ZeRO-1 halves of the optimizer state), rank 0 gathers the shard maps,
# writes the index and commits, in the background; the checkpoint verifies
# and holds exactly the tensors of the single-rank run of the same job.
set -euo pipefail
bin=$1 src=$2 tmp=$3
command -v mpirun > /dev/null || { echo "SKIP: no mpirun"; exit 77; }
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 9 > /dev/null
job=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1 --set data.path="$tmp/syn"
     --set batch.seq_len=32 --set batch.micro_batch_size=1 --set batch.global_batch_size=2
     --set train.steps=4 --set lr_schedule.warmup_steps=1 --set data.valid_interval=0
     --set train.log_interval=1000 --set checkpoint.interval=2 --set checkpoint.async=true)
"$bin/tests/ckpt_run" "${job[@]}" --set checkpoint.dir="$tmp/one" 2> "$tmp/one.log" || { cat "$tmp/one.log"; exit 1; }
mpirun --allow-run-as-root --oversubscribe -np 2 "$bin/tests/ckpt_run" "${job[@]}" \
    --set checkpoint.dir="$tmp/two" 2> "$tmp/two.log" || { cat "$tmp/two.log"; exit 1; }
for s in 2 4; do
    d=$(printf '%s/two/step_%08d' "$tmp" $s)
    [ -f "$d/shard_00000.h5" ] && [ -f "$d/shard_00001.h5" ] || { echo "FAIL: $d lacks a rank's shard"; exit 1; }
    "$ck" verify --quiet "$d" > /dev/null
    # same tensors (names, types, shapes), step and samples as one rank; the
    # values differ by the rounding of the summation order (the trainer's
    # data-parallel test bounds them)
    for run in one two; do
        "$ck" inspect --json "$(printf '%s/%s/step_%08d' "$tmp" $run $s)" | python3 -c '
import json, sys
d = json.load(sys.stdin)
print(d["step"], d["consumed_samples"])
for t in d["tensors"]: print(t["name"], t["dtype"], t["shape"])' > "$tmp/$run.$s.txt"
    done
    cmp -s "$tmp/one.$s.txt" "$tmp/two.$s.txt" || {
        echo "FAIL: the 2-rank checkpoint of step $s holds other tensors than the single-rank one"
        diff "$tmp/one.$s.txt" "$tmp/two.$s.txt" | head; exit 1; }
done
j=$("$ck" inspect --json "$tmp/two")
grep -q '"dp": 2' <<< "$j" || { echo "FAIL: layout dp=2 not recorded"; exit 1; }
echo "2 MPI ranks: own shards, rank 0 index and commit; same tensors as one rank"
rm -rf "$tmp"
