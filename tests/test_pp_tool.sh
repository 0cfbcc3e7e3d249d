#!/bin/bash
# test_pp_tool.sh MOETRAIN_PP EXAMPLES_DIR TMPDIR
#
# Property: moetrain-pp prints a checked schedule's timeline with the bubble
# the formulas give (1F1B (pp-1)/(n+pp-1), interleaved (pp-1)/(vpp n+pp-1)),
# takes the sizes from a job spec, simulates stages of unequal cost
# (--stage-scale), and refuses sizes a schedule cannot run
# (exit 1, the numbers named) and bad usage (exit 2).
set -uo pipefail
tool=$1 examples=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
fail() { echo "FAIL: $*"; exit 1; }

out=$("$tool" --pp 4 --mb 8) || fail "1f1b pp 4 mb 8 exited $?"
grep -q 'bubble 27.3%' <<< "$out" || fail "1f1b bubble is not 3/11: $out"
[ "$(grep -c '^stage ' <<< "$out")" = 4 ] || fail "1f1b: not 4 stage rows: $out"
grep -q '^stage 3  |......F0B0B0F1B1B1' <<< "$out" || fail "1f1b stage 3 row: $out"

out=$("$tool" --pp 4 --vpp 2 --schedule interleaved --mb 8) || fail "interleaved exited $?"
grep -q 'bubble 15.8%' <<< "$out" || fail "interleaved bubble is not 3/19: $out"
grep -q '^stage 0  |F0F1F2F3f0f1f2f3' <<< "$out" || fail "interleaved warm-up row: $out"

out=$("$tool" --pp 4 --schedule dualpipev --mb 8 --actions) || fail "dualpipev exited $?"
grep -q 'W' <<< "$out" || fail "dualpipev has no weight-gradient cells: $out"
grep -q '^stage 3, .*actions: recv_act mb=0 chunk=3 peer=2; F mb=0 chunk=3; F mb=0 chunk=4' \
    <<< "$out" || fail "dualpipev: stage 3 does not turn the V locally: $out"

# unequal stages: a last stage twice as slow makes 1F1B's step
# F0 + B0 + n (F1 + B1) = 3 + 8 x 6 = 51, stage 0 idle 1 - 24/51, stage 1 3/51
out=$("$tool" --pp 2 --mb 8 --stage-scale 1,2) || fail "stage-scale exited $?"
grep -q '^step 51, bubble 29.4%' <<< "$out" || fail "stage-scale step and bubble: $out"
grep -q '^stage 0 .* idle  52.9%' <<< "$out" || fail "stage-scale stage 0 idle: $out"
grep -q '^stage 1 .* idle   5.9%' <<< "$out" || fail "stage-scale stage 1 idle: $out"
grep -q 'costs of each chunk (F B Bi W): 0: 1 2 1 1; 1: 2 4 2 2' <<< "$out" \
    || fail "stage-scale header: $out"
err=$("$tool" --pp 2 --stage-scale 1 2>&1 >/dev/null); rc=$?
[ $rc = 1 ] || fail "stage-scale with 1 factor for 2 stages exited $rc, not 1"
grep -q 'gives 1 factors, the table has 2 stages' <<< "$err" || fail "stage-scale refusal: $err"
"$tool" --pp 2 --stage-scale 1,0 > /dev/null 2>&1; rc=$?
[ $rc = 2 ] || fail "--stage-scale 1,0 exited $rc, not 2"

# sizes from a job spec: tiny-cpu runs micro-batch 4 of a global batch 8,
# so 2 micro-batches per step with dp 1 (the data files only need to exist)
touch "$tmp/d.bin" "$tmp/d.idx"
out=$("$tool" --job "$examples/tiny-cpu.json" --set "data.path=$tmp/d" --set parallel.pp=2) \
    || fail "job spec exited $?"
grep -q '^schedule 1f1b: pp 2, vpp 1, 2 micro-batches' <<< "$out" || fail "job spec sizes: $out"
grep -q 'bubble 33.3%' <<< "$out" || fail "job spec bubble is not 1/3: $out"

err=$("$tool" --pp 4 --vpp 2 --schedule interleaved --mb 6 2>&1 >/dev/null); rc=$?
[ $rc = 1 ] || fail "interleaved mb 6 on pp 4 exited $rc, not 1"
grep -q 'micro-batches (6) to be a multiple of pp 4' <<< "$err" || fail "refusal: $err"
"$tool" --pp 0 > /dev/null 2>&1; rc=$?
[ $rc = 2 ] || fail "--pp 0 exited $rc, not 2"
"$tool" --bogus 1 > /dev/null 2>&1; rc=$?
[ $rc = 2 ] || fail "--bogus exited $rc, not 2"
echo "moetrain-pp: timelines, bubbles, job spec and refusals as specified"
