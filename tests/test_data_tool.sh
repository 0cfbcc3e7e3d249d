#!/usr/bin/env bash
# test_data_tool.sh - end-to-end checks of the moetrain-data tool.
# usage: test_data_tool.sh PATH/TO/moetrain-data SCRATCH_DIR
set -euo pipefail

tool=${1:?usage: test_data_tool.sh MOETRAIN_DATA SCRATCH_DIR}
dir=${2:?usage: test_data_tool.sh MOETRAIN_DATA SCRATCH_DIR}
rm -rf "$dir"
mkdir -p "$dir"

fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }

# field FILE KEY: the value after "KEY:" on the first line starting with KEY
field() { awk -v k="$2:" 'index($0, k) == 1 { sub(/^[^:]*:[ \t]*/, ""); print; exit }' "$1"; }
# meta FILE KEY: a metadata line "  KEY: value" of inspect
meta() { awk -v k="  $2:" 'index($0, k) == 1 { sub(/^[^:]*:[ \t]*/, ""); print; exit }' "$1"; }

check_eq() { # NAME GOT WANT
    if [[ "$2" == "$3" ]]; then pass "$1 = $3"; else fail "$1: got '$2', want '$3'"; fi
}

# expect_fail NAME CODE NEEDLE -- command...: exits CODE, stderr holds NEEDLE
expect_fail() {
    local name=$1 code=$2 needle=$3
    shift 4
    local rc=0
    "$@" >"$dir/out.txt" 2>"$dir/err.txt" || rc=$?
    if [[ $rc -ne $code ]]; then
        fail "$name: exit $rc, want $code ($(head -c 300 "$dir/err.txt"))"
    elif ! grep -qF -- "$needle" "$dir/err.txt"; then
        fail "$name: stderr lacks '$needle': $(head -c 300 "$dir/err.txt")"
    else
        pass "$name (exit $code, '$needle')"
    fi
}

# tokens PREFIX: the .bin as unsigned 16-bit little-endian numbers, one line
tokens() { od -An -v -tu2 --endian=little "$1.bin" | tr -s ' \n' ' ' | sed 's/^ //; s/ $//'; }

# ---- synth: counts, dtype, entropy in (0, ln V), agreement with the sample --------
"$tool" synth --output "$dir/syn" --vocab 64 --tokens 50000 --seed 11 --branching 4 \
    --mean-doc-len 24 >"$dir/synth.out"
"$tool" inspect "$dir/syn" --scan >"$dir/syn.txt"
cat "$dir/syn.txt"
check_eq "synth dtype" "$(field "$dir/syn.txt" dtype)" uint16
docs=$(field "$dir/syn.txt" documents)
toks=$(field "$dir/syn.txt" tokens)
check_eq "synth sequences = documents" "$(field "$dir/syn.txt" sequences)" "$docs"
check_eq "synth metadata documents" "$(meta "$dir/syn.txt" documents)" "$docs"
check_eq "synth metadata tokens" "$(meta "$dir/syn.txt" tokens)" "$toks"
check_eq "synth empty documents" "$(field "$dir/syn.txt" 'empty documents')" 0
ids=$(field "$dir/syn.txt" 'token ids')
if [[ "$ids" =~ ^min\ [0-9]+\ \ max\ 63$ ]]; then pass "synth token ids $ids"; else fail "synth token ids '$ids'"; fi
check_eq "synth eod_token" "$(meta "$dir/syn.txt" eod_token)" 63
check_eq "synth order" "$(meta "$dir/syn.txt" order)" 2
# at least N tokens; the last document runs to its EOD (mean length 24)
if (( toks >= 50000 && toks < 50000 + 1000 )); then pass "synth tokens $toks"; else fail "synth tokens $toks"; fi
# documents: about N / L
if (( docs > 50000 / 24 * 8 / 10 && docs < 50000 / 24 * 12 / 10 )); then pass "synth documents $docs"
else fail "synth documents $docs, expected about $((50000 / 24))"; fi
H=$(meta "$dir/syn.txt" conditional_entropy_nats)
nll=$(meta "$dir/syn.txt" sample_nll_nats)
emp=$(meta "$dir/syn.txt" empirical_conditional_entropy_nats)
if [[ -n "$H" ]] && awk -v h="$H" 'BEGIN { exit !(h > 0 && h < log(64)) }'; then
    pass "entropy $H in (0, ln 64)"
else
    fail "entropy '$H' not in (0, ln 64)"
fi
# The exact rate (from the stationary distribution) and the sample's mean NLL
# (which does not use it) must agree to Monte Carlo precision.
if awk -v h="$H" -v n="$nll" 'BEGIN { d = h - n; if (d < 0) d = -d; exit !(d < 0.03 * h) }'; then
    pass "sample NLL $nll agrees with entropy $H"
else
    fail "sample NLL $nll vs entropy $H"
fi
# the plug-in estimate is biased low, never far above the truth
if awk -v h="$H" -v e="$emp" 'BEGIN { exit !(e > 0 && e < h * 1.02) }'; then
    pass "plug-in estimate $emp"
else
    fail "plug-in estimate $emp vs $H"
fi
# A small source whose stationary distribution is far from uniform (most of
# its 36 contexts unreachable) and a long sample: the exact rate must match the
# sample NLL to 0.3% (its Monte Carlo error here is under 0.1%; stopping the
# power iteration early gives 1.5%).
"$tool" synth --output "$dir/small" --vocab 6 --tokens 3000000 --seed 3 --branching 2 \
    --mean-doc-len 6 >/dev/null 2>&1
"$tool" inspect "$dir/small" >"$dir/small.txt"
H=$(meta "$dir/small.txt" conditional_entropy_nats)
nll=$(meta "$dir/small.txt" sample_nll_nats)
if awk -v h="$H" -v n="$nll" 'BEGIN { d = h - n; if (d < 0) d = -d; exit !(h > 0 && d < 0.003 * h) }'; then
    pass "stationary entropy $H matches a long sample ($nll)"
else
    fail "stationary entropy $H vs long-sample NLL $nll"
fi
for f in syn.bin syn.idx syn.json; do [[ -s "$dir/$f" ]] || fail "missing $f"; done
ls "$dir"/*.tmp >/dev/null 2>&1 && fail "temporary files left: $(ls "$dir"/*.tmp)"

# same seed, same corpus; another seed, another corpus
"$tool" synth --output "$dir/syn2" --vocab 64 --tokens 50000 --seed 11 --branching 4 \
    --mean-doc-len 24 >/dev/null
"$tool" synth --output "$dir/syn3" --vocab 64 --tokens 50000 --seed 12 --branching 4 \
    --mean-doc-len 24 >/dev/null
if cmp -s "$dir/syn.bin" "$dir/syn2.bin" && cmp -s "$dir/syn.idx" "$dir/syn2.idx"; then
    pass "synth deterministic"
else
    fail "synth with the same seed differs"
fi
cmp -s "$dir/syn.bin" "$dir/syn3.bin" && fail "synth with another seed gives the same corpus"

# ---- encode .txt: blank-line separated documents, byte tokens + EOD 256 -----------
printf 'hello\nworld\n\n\n  \t\nsecond doc\n\n' >"$dir/in.txt"
"$tool" encode --input "$dir/in.txt" --output "$dir/txt" >/dev/null
"$tool" inspect "$dir/txt" >"$dir/txt.txt"
cat "$dir/txt.txt"
check_eq "txt documents" "$(field "$dir/txt.txt" documents)" 2
check_eq "txt sequences" "$(field "$dir/txt.txt" sequences)" 2
check_eq "txt tokens" "$(field "$dir/txt.txt" tokens)" 23
check_eq "txt dtype" "$(field "$dir/txt.txt" dtype)" uint16
check_eq "txt lengths" "$(field "$dir/txt.txt" 'document length')" \
    "min 11  mean 11.50  median 11  max 12"
check_eq "txt first tokens" "$(field "$dir/txt.txt" 'first tokens')" \
    "(document 0, 12 tokens) 104 101 108 108 111 10 119 111 114 108 100 256"
check_eq "txt .bin" "$(tokens "$dir/txt")" \
    "104 101 108 108 111 10 119 111 114 108 100 256 115 101 99 111 110 100 32 100 111 99 256"
check_eq "txt metadata vocab" "$(meta "$dir/txt.txt" vocab)" 257
check_eq "txt metadata eod" "$(meta "$dir/txt.txt" eod_token)" 256

# ---- encode .jsonl: "text" key, UTF-8 bytes, an empty text is an empty document ---
printf '%s\n' '{"text": "h\u00e9llo"}' '{"text": ""}' '' '{"id": 3, "text": "a\nb"}' >"$dir/in.jsonl"
"$tool" encode --input "$dir/in.jsonl" --output "$dir/js" >/dev/null
"$tool" inspect "$dir/js" >"$dir/js.txt"
cat "$dir/js.txt"
check_eq "jsonl documents" "$(field "$dir/js.txt" documents)" 3
check_eq "jsonl sequences" "$(field "$dir/js.txt" sequences)" 2
check_eq "jsonl tokens" "$(field "$dir/js.txt" tokens)" 11
check_eq "jsonl empty documents" "$(field "$dir/js.txt" 'empty documents')" 1
check_eq "jsonl .bin" "$(tokens "$dir/js")" "104 195 169 108 108 111 256 97 10 98 256"

# ---- bad invocations: usage errors exit 1, failures exit 2, both say why ------------
expect_fail "no command" 1 "usage: moetrain-data" -- "$tool"
expect_fail "unknown command" 1 "unknown command 'frobnicate'" -- "$tool" frobnicate
expect_fail "unknown option" 1 "unknown option '--bogus'" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed 1 --bogus 3
expect_fail "missing value" 1 "option --seed needs a value" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed
expect_fail "missing --seed" 1 "missing --seed" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10
expect_fail "vocab too small" 2 "--vocab: 2 is outside [3" -- \
    "$tool" synth --output "$dir/x" --vocab 2 --tokens 10 --seed 1
expect_fail "vocab not a number" 2 "--vocab: 'many' is not an integer" -- \
    "$tool" synth --output "$dir/x" --vocab many --tokens 10 --seed 1
expect_fail "branching > V-1" 2 "--branching: 8 is outside [1, 7]" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed 1 --branching 8
expect_fail "branching 0" 2 "--branching: 0 is outside [1, 7]" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed 1 --branching 0
expect_fail "tokens 0" 2 "--tokens: 0 is outside" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 0 --seed 1
expect_fail "mean doc len 1" 2 "--mean-doc-len: 1 must be > 1" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed 1 --mean-doc-len 1
expect_fail "negative seed" 2 "--seed: '-1' is not an unsigned" -- \
    "$tool" synth --output "$dir/x" --vocab 8 --tokens 10 --seed -1
expect_fail "source too large" 2 "V*V*K" -- \
    "$tool" synth --output "$dir/x" --vocab 4096 --tokens 10 --seed 1 --branching 8
# missing parent directories are created; a file in the way is an error
"$tool" synth --output "$dir/new/sub/dir/x" --vocab 8 --tokens 10 --seed 1 >/dev/null 2>&1 \
    && [ -f "$dir/new/sub/dir/x.idx" ] || fail "synth did not create parent dirs"
: > "$dir/afile"
expect_fail "synth unwritable output" 2 "not a directory" -- \
    "$tool" synth --output "$dir/afile/x" --vocab 8 --tokens 10 --seed 1
expect_fail "encode missing --output" 1 "missing --output" -- \
    "$tool" encode --input "$dir/in.txt"
expect_fail "encode missing input" 2 "cannot open" -- \
    "$tool" encode --input "$dir/nope.txt" --output "$dir/x"
expect_fail "encode unknown format" 2 "--format" -- \
    "$tool" encode --input "$dir/in.csv" --output "$dir/x"
expect_fail "encode bad --format" 2 "neither txt nor jsonl" -- \
    "$tool" encode --input "$dir/in.txt" --output "$dir/x" --format csv
printf '%s\n' '{"text": "ok"}' '{"text": broken}' >"$dir/bad.jsonl"
expect_fail "encode invalid JSON" 2 "bad.jsonl:2: invalid JSON" -- \
    "$tool" encode --input "$dir/bad.jsonl" --output "$dir/bad"
[[ -e "$dir/bad.bin" || -e "$dir/bad.idx" || -e "$dir/bad.bin.tmp" ]] &&
    fail "failed encode left files behind: $(ls "$dir"/bad.*)"
printf '%s\n' '{"body": "x"}' >"$dir/nokey.jsonl"
expect_fail "encode missing key" 2 'nokey.jsonl:1: no "text" key' -- \
    "$tool" encode --input "$dir/nokey.jsonl" --output "$dir/nokey"
printf '%s\n' '{"text": 5}' >"$dir/nonstr.jsonl"
expect_fail "encode non-string text" 2 '"text" is not a string' -- \
    "$tool" encode --input "$dir/nonstr.jsonl" --output "$dir/nonstr"
expect_fail "inspect no prefix" 1 "missing PREFIX" -- "$tool" inspect
expect_fail "inspect missing dataset" 2 "nothing.idx: cannot open" -- "$tool" inspect "$dir/nothing"
cp "$dir/txt.idx" "$dir/cut.idx"
head -c 20 "$dir/txt.bin" >"$dir/cut.bin"
expect_fail "inspect truncated .bin" 2 "truncated .bin" -- "$tool" inspect "$dir/cut"
printf 'XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX' >"$dir/junk.idx"
: >"$dir/junk.bin"
expect_fail "inspect wrong magic" 2 "wrong magic" -- "$tool" inspect "$dir/junk"

# ---- --help: usage on stdout, exit 0 ---------------------------------------------------
for cmd in "" encode synth inspect; do
    out=$("$tool" $cmd --help) || fail "'$cmd --help' exited non-zero"
    if [[ "$out" == *"usage: moetrain-data ${cmd}"* ]]; then pass "'$cmd --help'"
    else fail "'$cmd --help' prints no usage"; fi
done

if (( fails > 0 )); then
    echo "$fails check(s) failed" >&2
    exit 1
fi
echo "all checks passed"
