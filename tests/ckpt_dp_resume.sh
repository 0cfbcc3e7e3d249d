#!/bin/bash
# ckpt_dp_resume.sh BIN_DIR SOURCE_DIR TMP
#
# Property: a checkpoint saved by 2 data-parallel ranks continues on any
# number of ranks. Saved at dp = 2 after step 3 of 6 (fp32 recipe):
#   - resumed at dp = 2: steps 4-6 log the same losses, bit for bit, as the
#     dp = 2 run that never stopped;
#   - resumed at dp = 1 and at dp = 4: steps 4-6 are within 1e-5 (relative)
#     of the uninterrupted dp = 1 run: the only difference is the order in
#     which the ranks' gradients are summed.
set -euo pipefail
bin=$1 src=$2 tmp=$3
. "$src/tests/ckpt_resume_lib.sh"
run 1 one                                     # dp = 1, uninterrupted
run 2 two --set checkpoint.dir="$tmp/ck" --set checkpoint.interval=3
ck=$tmp/ck/step_00000003
[ -d "$ck" ] || { echo "FAIL: dp = 2 saved no checkpoint at step 3"; exit 1; }
meta=$("$bin/ckpt/moetrain-ckpt" inspect --json "$ck")
grep -q '"dp": 2' <<< "$meta" || { echo "FAIL: layout dp=2 not recorded"; exit 1; }
resume=(--set init.kind=checkpoint --set init.path="$ck")
run 2 two_again "${resume[@]}"
[ "$(losses "$tmp/two.jsonl" 4)" = "$(losses "$tmp/two_again.jsonl")" ] || {
    echo "FAIL: resuming at dp = 2 is not bit-identical"
    diff <(losses "$tmp/two.jsonl" 4) <(losses "$tmp/two_again.jsonl"); exit 1; }
echo "dp=2 -> dp=2: bit-identical"
for np in 1 4; do
    run $np "from2_on$np" "${resume[@]}"
    echo "dp=2 -> dp=$np, against the uninterrupted dp=1 run:"
    close "$tmp/one.jsonl" "$tmp/from2_on$np.jsonl" 1e-5 || {
        echo "FAIL: resuming at dp=$np strays from one rank"
        paste <(losses "$tmp/one.jsonl" 4) <(losses "$tmp/from2_on$np.jsonl"); exit 1; }
done
echo "step loss grad_norm: dp=1 | dp=2 | dp=2->1 | dp=2->4 (steps 4-6)"
paste -d'|' <(losses "$tmp/one.jsonl" 4) <(losses "$tmp/two.jsonl" 4) \
    <(losses "$tmp/from2_on1.jsonl") <(losses "$tmp/from2_on4.jsonl")
rm -rf "$tmp"
