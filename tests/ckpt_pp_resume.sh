#!/bin/bash
# ckpt_pp_resume.sh BIN_DIR SOURCE_DIR TMP
#
# Property: a checkpoint continues across pipeline layouts. A 4-layer model
# with MTP (fp32 recipe), 6 steps, checkpoints after step 3:
#   - saved at pp = 2 (1F1B), resumed at pp = 1, and at pp = 2 vpp = 2
#     (interleaved: other chunks per stage);
#   - saved at pp = 1, resumed at pp = 2 (DualPipeV), and at pp = 2 with
#     parallel.pp_layers 3,1;
#   - saved at pp = 2 with parallel.pp_layers 1,3, resumed at pp = 1;
#   - saved at pp = 2 x dp = 2 (4 ranks), resumed at pp = 1;
#   - saved at tp = 2 x pp = 2 (4 ranks: each stage's layers in tp parts),
#     resumed at pp = 1 (one rank), and saved at pp = 1 resumed there;
#   - saved at pp = 2 x ep = 2 (4 ranks: each stage's experts split over its
#     two ranks), resumed at pp = 1 (one rank) and at ep = 2 (2 ranks);
# steps 4-6 log losses and gradient norms within 1e-5 (relative) of the
# uninterrupted run that saved the checkpoint: the stages hold the layers
# the sharding map places (the embedding replica of the last stage written
# once), so only the summation order of the norm and of the embedding
# gradient differ. (The uninterrupted pp = 2 and pp = 1 runs themselves
# drift apart by such roundings, ~3e-5 in the norm by step 5: the
# comparison is with the run whose state was saved.)
set -euo pipefail
bin=$1 src=$2 tmp=$3
shape=(--set model.num_hidden_layers=4 --set model.hidden_size=64
       --set model.intermediate_size=128 --set batch.seq_len=16)
. "$src/tests/ckpt_resume_lib.sh"
check() { # check SAVER NAME WHAT
    echo "$3, against the uninterrupted run that saved it ($1):"
    close "$tmp/$1.jsonl" "$tmp/$2.jsonl" 1e-5 || {
        echo "FAIL: $3 strays from the run that saved it"
        paste <(losses "$tmp/$1.jsonl" 4) <(losses "$tmp/$2.jsonl"); exit 1; }
}
run 1 one --set checkpoint.dir="$tmp/ck1" --set checkpoint.interval=3
run 2 pp2 --set parallel.pp=2 --set checkpoint.dir="$tmp/ck2" --set checkpoint.interval=3
for d in ck1 ck2; do
    [ -d "$tmp/$d/step_00000003" ] || { echo "FAIL: $d has no checkpoint at step 3"; exit 1; }
done
meta=$("$bin/ckpt/moetrain-ckpt" inspect --json "$tmp/ck2/step_00000003")
grep -q '"pp": 2' <<< "$meta" || { echo "FAIL: layout pp=2 not recorded"; exit 1; }
from2=(--set init.kind=checkpoint --set init.path="$tmp/ck2/step_00000003")
from1=(--set init.kind=checkpoint --set init.path="$tmp/ck1/step_00000003")
run 1 pp2_on1 "${from2[@]}"
check pp2 pp2_on1 "pp=2 -> pp=1"
run 2 pp2_on_vpp2 "${from2[@]}" --set parallel.pp=2 --set parallel.vpp=2 \
    --set parallel.schedule=interleaved
check pp2 pp2_on_vpp2 "pp=2 -> pp=2 vpp=2 interleaved"
run 2 pp1_on2 "${from1[@]}" --set parallel.pp=2 --set parallel.vpp=2 \
    --set parallel.schedule=dualpipev
check one pp1_on2 "pp=1 -> pp=2 DualPipeV"
# an explicit stage layout (1 + 3 layers) saves and resumes like any other
run 2 pp2l --set parallel.pp=2 --set parallel.pp_layers=1,3 --set checkpoint.dir="$tmp/ck2l" \
    --set checkpoint.interval=3
run 1 pp2l_on1 --set init.kind=checkpoint --set init.path="$tmp/ck2l/step_00000003"
check pp2l pp2l_on1 "pp=2 with pp_layers 1,3 -> pp=1"
run 2 pp1_on2l "${from1[@]}" --set parallel.pp=2 --set parallel.pp_layers=3,1
check one pp1_on2l "pp=1 -> pp=2 with pp_layers 3,1"
# pp x dp: the ZeRO-1 pieces of both stages (the replica's state too)
run 4 ppdp --set parallel.pp=2 --set checkpoint.dir="$tmp/ckpd" --set checkpoint.interval=3
run 1 ppdp_on1 --set init.kind=checkpoint --set init.path="$tmp/ckpd/step_00000003"
check ppdp ppdp_on1 "pp=2 x dp=2 -> pp=1"
# tp x pp: each stage's tp slabs, written by the stage's ranks
run 4 tppp --set parallel.pp=2 --set parallel.tp=2 --set checkpoint.dir="$tmp/cktp" \
    --set checkpoint.interval=3
run 1 tppp_on1 --set init.kind=checkpoint --set init.path="$tmp/cktp/step_00000003"
meta=$("$bin/ckpt/moetrain-ckpt" inspect --json "$tmp/cktp/step_00000003")
grep -q '"tp": 2' <<< "$meta" && grep -q '"pp": 2' <<< "$meta" ||
    { echo "FAIL: layout tp=2 x pp=2 not recorded"; exit 1; }
check tppp tppp_on1 "tp=2 x pp=2 -> pp=1"
run 4 pp1_on_tppp "${from1[@]}" --set parallel.pp=2 --set parallel.tp=2
check one pp1_on_tppp "pp=1 -> tp=2 x pp=2"
# pp x ep: each stage's experts, written by their ep ranks (dp 2 refolded as
# ep 2 on each stage); continued on one rank and at ep = 2 without a pipeline
run 4 ppep --set parallel.pp=2 --set parallel.ep=2 --set checkpoint.dir="$tmp/ckpe" \
    --set checkpoint.interval=3
meta=$("$bin/ckpt/moetrain-ckpt" inspect --json "$tmp/ckpe/step_00000003")
grep -q '"ep": 2' <<< "$meta" && grep -q '"pp": 2' <<< "$meta" ||
    { echo "FAIL: layout pp=2 x ep=2 not recorded"; exit 1; }
fromep=(--set init.kind=checkpoint --set init.path="$tmp/ckpe/step_00000003")
run 1 ppep_on1 "${fromep[@]}"
check ppep ppep_on1 "pp=2 x ep=2 -> pp=1"
run 2 ppep_on_ep2 "${fromep[@]}" --set parallel.ep=2
check ppep ppep_on_ep2 "pp=2 x ep=2 -> ep=2"
echo "step loss grad_norm: pp=1 | pp=2 | pp=2->1 | pp=2->vpp2 | pp=1->DualPipeV (steps 4-6)"
paste -d'|' <(losses "$tmp/one.jsonl" 4) <(losses "$tmp/pp2.jsonl" 4) \
    <(losses "$tmp/pp2_on1.jsonl") <(losses "$tmp/pp2_on_vpp2.jsonl") <(losses "$tmp/pp1_on2.jsonl")
rm -rf "$tmp"
