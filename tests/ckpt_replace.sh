#!/bin/bash
# ckpt_replace.sh BIN_DIR SOURCE_DIR TMP
#
# Properties (issue 21, defect 4):
#  - resharding or importing into a folder that already holds the same step
#    is refused unless --overwrite is given, and the committed checkpoint
#    is left exactly as it was (nothing written beside it either);
#  - with --overwrite, the process killed (SIGKILL) at each step of the
#    replacement (MT_CKPT_TEST_CRASH=POINT) always leaves one committed
#    copy of the step that verifies: the old one before the exchange, the
#    new one from the exchange on; the next write into the root removes
#    the leftovers;
#  - on a file system without RENAME_EXCHANGE (MT_CKPT_TEST_NO_EXCHANGE)
#    the replacement warns, and a kill between its two renames leaves the
#    old copy set aside, which the next write into the root commits again.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 20000 --seed 5 > /dev/null
"$bin/tests/ckpt_run" --job "$src/deploy/examples/tiny-cpu.json" --threads 2 \
    --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2 \
    --set batch.global_batch_size=2 --set train.steps=2 --set lr_schedule.warmup_steps=1 \
    --set data.valid_interval=0 --set checkpoint.dir="$tmp/a" --set checkpoint.interval=2 \
    --set train.log_interval=100 2> "$tmp/run.log" || { cat "$tmp/run.log"; exit 1; }

out="$tmp/b"
"$ck" reshard --quiet --input "$tmp/a" --output "$out" --layout pp=2
layout_of() { "$ck" inspect --json "$out" | grep -o '"pp": [0-9]*'; }
[ "$(layout_of)" = '"pp": 2' ] || { echo "FAIL: first reshard not pp=2"; exit 1; }

# 1. refused without --overwrite: the committed step stays as it was
before=$(cd "$out" && find . -type f -printf '%p %s %T@\n' | sort)
if "$ck" reshard --quiet --input "$tmp/a" --output "$out" --layout ep=2,dp=2 2> "$tmp/refused.log"; then
    echo "FAIL: reshard replaced a committed step without --overwrite"; exit 1
fi
grep -q "step_00000002 exists" "$tmp/refused.log" || { echo "FAIL: refusal not explained:"; cat "$tmp/refused.log"; exit 1; }
after=$(cd "$out" && find . -type f -printf '%p %s %T@\n' | sort)
[ "$before" = "$after" ] || { echo "FAIL: a refused reshard changed the root"; diff <(echo "$before") <(echo "$after"); exit 1; }
# ... the same for a step directory named as output, and for import-hf
if "$ck" reshard --quiet --input "$tmp/a" --output "$out/step_00000002" --layout ep=2,dp=2 2> /dev/null; then
    echo "FAIL: reshard into an existing step directory accepted"; exit 1
fi
"$ck" export-hf --quiet --input "$tmp/a" --output "$tmp/hf"
"$ck" import-hf --quiet --input "$tmp/hf" --output "$tmp/imp"
if "$ck" import-hf --quiet --input "$tmp/hf" --output "$tmp/imp" 2> "$tmp/refused.log"; then
    echo "FAIL: import-hf replaced a committed step without --overwrite"; exit 1
fi
grep -q "step_00000000 exists" "$tmp/refused.log" || { echo "FAIL: import refusal not explained"; exit 1; }
"$ck" import-hf --quiet --overwrite --input "$tmp/hf" --output "$tmp/imp" --layout pp=2
"$ck" verify --quiet "$tmp/imp" > /dev/null
grep -q '"pp": 2' <<< "$("$ck" inspect --json "$tmp/imp")" || { echo "FAIL: import --overwrite did not replace"; exit 1; }

# 2. killed at each step of the replacement: one committed copy that verifies
# (the layout tells which copy: the old pp=2 / ep=2 until the exchange, then the new)
check_after_kill() { # POINT WANT_LAYOUT
    local n
    n=$("$ck" list "$out" | grep -c '^step_00000002$' || true)
    [ "$n" -eq 1 ] || { echo "FAIL at $1: no committed step_00000002 after the kill"; ls -la "$out"; exit 1; }
    "$ck" verify --quiet "$out" > "$tmp/verify.log" 2>&1 || {
        echo "FAIL at $1: the committed copy does not verify"; cat "$tmp/verify.log"; exit 1; }
    [ "$(layout_of)" = "$2" ] || { echo "FAIL at $1: layout $(layout_of), want $2"; exit 1; }
    "$ck" diff --meta "$tmp/a" "$out" > /dev/null || { echo "FAIL at $1: contents changed"; exit 1; }
}
cur=2
for point in replace-start replace-exchanged replace-synced replace-removing replace-removed; do
    new=$((cur == 2 ? 1 : 2))
    lay=$([ $new -eq 2 ] && echo pp=2 || echo ep=2,dp=2)
    set +e
    MT_CKPT_TEST_CRASH=$point "$ck" reshard --quiet --overwrite --input "$tmp/a" --output "$out" \
        --layout "$lay" 2> "$tmp/kill.log"
    st=$?
    set -e
    [ $st -eq 137 ] || { echo "FAIL: the hook at $point did not kill (status $st)"; cat "$tmp/kill.log"; exit 1; }
    case $point in
        replace-start) want=$cur ;;
        *) want=$new; cur=$new ;;
    esac
    check_after_kill $point "\"pp\": $want"
done
# leftovers of the kills (the old copy under the .partial name) go with the next write
"$ck" reshard --quiet --overwrite --input "$tmp/a" --output "$out" --layout pp=2
check_after_kill clean '"pp": 2'
left=$(ls "$out" | grep -v '^step_00000002$\|^latest$' || true)
[ -z "$left" ] || { echo "FAIL: leftovers after a complete replacement: $left"; exit 1; }

# 3. no RENAME_EXCHANGE: warned; a kill between the two renames leaves the
# old copy aside (step_00000002.replaced), committed again by the next write
set +e
MT_CKPT_TEST_NO_EXCHANGE=1 MT_CKPT_TEST_CRASH=replace-aside "$ck" reshard --quiet --overwrite \
    --input "$tmp/a" --output "$out" --layout ep=2,dp=2 2> "$tmp/fallback.log"
st=$?
set -e
[ $st -eq 137 ] || { echo "FAIL: fallback hook did not kill (status $st)"; cat "$tmp/fallback.log"; exit 1; }
grep -q "cannot exchange directories atomically" "$tmp/fallback.log" || {
    echo "FAIL: the fallback was not announced"; cat "$tmp/fallback.log"; exit 1; }
[ -d "$out/step_00000002.replaced" ] || { echo "FAIL: the old copy was not set aside"; ls -la "$out"; exit 1; }
MT_CKPT_TEST_NO_EXCHANGE=1 "$ck" reshard --quiet --overwrite --input "$tmp/a" --output "$out" \
    --layout ep=2,dp=2 2> "$tmp/fallback2.log"
grep -q "committing it again" "$tmp/fallback2.log" || { echo "FAIL: the set-aside copy was not recovered"; cat "$tmp/fallback2.log"; exit 1; }
check_after_kill fallback '"pp": 1'
left=$(ls "$out" | grep -v '^step_00000002$\|^latest$' || true)
[ -z "$left" ] || { echo "FAIL: leftovers after the fallback replacement: $left"; exit 1; }
echo "replacing a committed step: refused unless asked; killed at 6 points, one committed copy every time"
rm -rf "$tmp"
