#!/bin/bash
# ckpt_reshard.sh BIN_DIR SOURCE_DIR TMP
#
# Property: a checkpoint resharded through three different parallel layouts
# and back to its own is byte-identical per tensor (weights, FP8 scales,
# optimizer state) and in its metadata; every intermediate verifies and is
# identical too; a trainer continues from a resharded checkpoint exactly as
# from the original; a layout that would cut FP8 blocks is refused naming
# the tensor, and leaves nothing behind; a damaged source is not resharded.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 96 --tokens 60000 --seed 2 > /dev/null
# A model whose TP / ETP splits keep whole 128x128 FP8 blocks at tp = etp = 2.
job=(--job "$src/deploy/examples/tiny-cpu.json" --threads 2
     --set data.path="$tmp/syn" --set model.vocab_size=96 --set model.hidden_size=256
     --set model.intermediate_size=512 --set model.moe_intermediate_size=256
     --set model.q_lora_rank=128 --set model.kv_lora_rank=128 --set model.qk_nope_head_dim=64
     --set model.qk_rope_head_dim=64 --set model.v_head_dim=64
     --set batch.seq_len=32 --set batch.micro_batch_size=2 --set batch.global_batch_size=2
     --set lr_schedule.warmup_steps=1 --set data.valid_interval=0 --set train.log_interval=100)
"$bin/tests/ckpt_run" "${job[@]}" --set train.steps=2 --set checkpoint.dir="$tmp/a" \
    --set checkpoint.interval=2 2> "$tmp/run.log" || { cat "$tmp/run.log"; exit 1; }

"$ck" reshard --quiet --input "$tmp/a" --output "$tmp/l1" --layout tp=2,pp=2,ep=2
"$ck" reshard --quiet --input "$tmp/l1" --output "$tmp/l2" --layout pp=2,ep=4,dp=4
"$ck" reshard --quiet --input "$tmp/l2" --output "$tmp/l3" --layout tp=2,vpp=2,ep=2,etp=2,dp=2
"$ck" reshard --quiet --input "$tmp/l3" --output "$tmp/back" --layout tp=1,pp=1,ep=1,dp=1
for d in l1 l2 l3 back; do
    "$ck" verify --quiet "$tmp/$d" > /dev/null
    "$ck" diff --meta "$tmp/a" "$tmp/$d" > /dev/null || { echo "FAIL: $d differs from the original"; exit 1; }
done
# the layouts are what was asked, with one shard file per writing rank
n=$(ls "$tmp/l2/step_00000002"/shard_*.h5 | wc -l)
[ "$n" -eq 8 ] || { echo "FAIL: layout pp=2,ep=4,dp=4 wrote $n shard files, want 8"; exit 1; }
j3=$("$ck" inspect --json "$tmp/l3")
jb=$("$ck" inspect --json "$tmp/back")
grep -q '"etp": 2' <<< "$j3" || { echo "FAIL: l3 layout not recorded"; exit 1; }
grep -q '"tp": 1' <<< "$jb" || { echo "FAIL: back layout not recorded"; exit 1; }

# a trainer loads a checkpoint of another layout (tp=2, pp=2, ep=2) exactly
# as the original: both continue with the same losses
for src_ck in a l1; do
    "$bin/tests/ckpt_run" "${job[@]}" --set train.steps=3 --set init.kind=checkpoint \
        --set init.path="$tmp/$src_ck" --metrics-jsonl "$tmp/cont_$src_ck.jsonl" 2> "$tmp/cont.log" || {
        cat "$tmp/cont.log"; exit 1; }
done
numbers() { grep -o '"loss":[^,]*\|"mtp_loss":[^,]*\|"grad_norm":[^,]*' "$1"; }
[ -s "$tmp/cont_a.jsonl" ] && [ "$(numbers "$tmp/cont_a.jsonl")" = "$(numbers "$tmp/cont_l1.jsonl")" ] || {
    echo "FAIL: continuing from the resharded checkpoint differs"; exit 1; }

# a layout that cuts FP8 blocks is refused, naming the tensor
if "$ck" reshard --quiet --input "$tmp/a" --output "$tmp/bad" --layout tp=4 2> "$tmp/bad.log"; then
    echo "FAIL: tp=4 accepted"; exit 1
fi
grep -q "o_proj.weight" "$tmp/bad.log" || { echo "FAIL: no tensor named:"; cat "$tmp/bad.log"; exit 1; }
[ ! -e "$tmp/bad/step_00000002" ] || { echo "FAIL: a refused reshard left a checkpoint"; exit 1; }

# a damaged source is not resharded silently
cp -r "$tmp/a" "$tmp/damaged"
f="$tmp/damaged/step_00000002/shard_00000.h5"
truncate -s $(( $(stat -c %s "$f") - 1000 )) "$f"
if "$ck" reshard --quiet --input "$tmp/damaged" --output "$tmp/from_damaged" --layout tp=2 2> "$tmp/dmg.log"; then
    echo "FAIL: reshard of a truncated checkpoint succeeded"; exit 1
fi
grep -q "shard_00000.h5" "$tmp/dmg.log" || { echo "FAIL: no file named:"; cat "$tmp/dmg.log"; exit 1; }
echo "reshard round trip through 3 layouts: byte-identical"
rm -rf "$tmp"
