#!/bin/bash
# ckpt_eval.sh BIN_DIR SOURCE_DIR TMP
#
# Properties of `moetrain-ckpt eval` (scoring tokens with a checkpoint):
#  - its mean loss on the job's valid split equals the valid loss the trainer
#    logged for the same weights (the same forward);
#  - a token file (.npy or text) of the same sequences gives the same
#    per-token losses bit for bit, whatever the sequences per forward;
#  - numpy reads every output without our code; the logits' log-softmax at
#    the next token is the per-token loss;
#  - --fp32 scores the same weights in fp32: close, not equal;
#  - a Hugging Face directory exported from the checkpoint scores the same,
#    and so does its config.json rewritten as transformers 5 writes it
#    (rope_parameters), also with a rope_theta that is not the default;
#  - bad input fails with a message naming the file, sequence and position,
#    and leaves no output file behind.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"
py=/usr/bin/python3
export OMP_NUM_THREADS=1
fail() { echo "FAIL: $*"; exit 1; }

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 4 > /dev/null
sets=(--set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2
      --set batch.global_batch_size=2 --set train.steps=2 --set lr_schedule.warmup_steps=1
      --set data.valid_interval=2 --set data.valid_batches=3 --set checkpoint.dir="$tmp/a"
      --set checkpoint.interval=2 --set train.log_interval=100)
"$bin/tests/ckpt_run" --job "$src/deploy/examples/tiny-cpu.json" --threads 1 "${sets[@]}" \
    --metrics-jsonl "$tmp/m.jsonl" 2> "$tmp/run.log" || { cat "$tmp/run.log"; exit 1; }
valid=$("$py" -c 'import json,sys; print(repr([json.loads(l) for l in open(sys.argv[1])][-1]["valid_loss"]))' "$tmp/m.jsonl")

# 1. the default input is the valid split of the job saved with the checkpoint
"$ck" eval "$tmp/a" --threads 1 --out "$tmp/o1/loss.npy" --logits --json > "$tmp/e1.json" 2> "$tmp/e1.err" \
    || { cat "$tmp/e1.err"; fail "eval on the valid split"; }
grep -q '^eval \[' "$tmp/e1.err" && fail "--json should draw no progress bar"
"$py" - "$tmp/e1.json" "$valid" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); valid = float(sys.argv[2])
assert r["sequences"] == 6 and r["seq_len"] == 32 and r["tokens"] == 192, r
assert r["recipe"] == "fp8-blockwise" and r["backend"] == "cpu", r
# the trainer logs %.9g: equal to that precision
assert "%.9g" % r["loss"] == "%.9g" % valid, (r["loss"], valid)
print("eval of the valid split: loss %.9g = the trainer's valid loss" % r["loss"])
PY

# 2. the same through --job, with progress on stderr
"$ck" eval "$tmp/a" --job "$src/deploy/examples/tiny-cpu.json" "${sets[@]}" --threads 1 \
    --out "$tmp/o2/loss.npy" > "$tmp/e2.txt" 2> "$tmp/e2.err" || { cat "$tmp/e2.err"; fail "eval --job"; }
grep -q '^eval \[####################\] 100%  192/192 tokens' "$tmp/e2.err" || { cat "$tmp/e2.err"; fail "no progress"; }
grep -q "^loss        $("$py" -c "print('%.9g' % $valid)") " "$tmp/e2.txt" || { cat "$tmp/e2.txt"; fail "eval --job loss"; }
cmp "$tmp/o1/loss.npy" "$tmp/o2/loss.npy" || fail "--job and the saved job differ"

# 3. token files: .npy and text, other batch sizes (a padded last batch)
"$ck" eval "$tmp/a" --tokens "$tmp/o1/loss.tokens.npy" --batch 4 --quiet --threads 1 \
    --out "$tmp/o3/loss.npy" > /dev/null
cmp "$tmp/o1/loss.npy" "$tmp/o3/loss.npy" || fail "the .npy token file scores differently"
"$py" -c '
import numpy as np, sys
t = np.load(sys.argv[1])
with open(sys.argv[2], "w") as f:
    f.write("# the valid split, one sequence per line\n\n")
    for row in t: f.write(" ".join(map(str, row)) + "\n")
np.save(sys.argv[3], t[2].astype(np.int64))  # one sequence, 1-D, int64
' "$tmp/o1/loss.tokens.npy" "$tmp/tok.txt" "$tmp/one.npy"
"$ck" eval "$tmp/a" --tokens "$tmp/tok.txt" --batch 1 --quiet --threads 1 --out "$tmp/o4/loss" > /dev/null
cmp "$tmp/o1/loss.npy" "$tmp/o4/loss.npy" || fail "the text token file scores differently"
"$ck" eval "$tmp/a" --tokens "$tmp/one.npy" --quiet --threads 1 --out "$tmp/o5/loss.npy" > /dev/null

# 4. numpy reads the outputs; logits and losses agree
"$py" - "$tmp" <<'PY'
import numpy as np, sys
d = sys.argv[1]
l, t, g = (np.load(d + "/o1/loss" + s + ".npy") for s in ("", ".tokens", ".logits"))
assert l.dtype == np.float32 and l.shape == (6, 32), (l.dtype, l.shape)
assert t.dtype == np.int32 and t.shape == (6, 33), (t.dtype, t.shape)
assert g.dtype == np.float32 and g.shape == (6, 32, 64), (g.dtype, g.shape)
g = g.astype(np.float64)
m = g.max(-1, keepdims=True)
ref = np.log(np.exp(g - m).sum(-1)) + m[..., 0] - np.take_along_axis(g, t[:, 1:, None], -1)[..., 0]
assert np.abs(ref - l).max() < 1e-5, np.abs(ref - l).max()
one = np.load(d + "/o5/loss.npy")
assert one.shape == (1, 32) and np.array_equal(one[0], l[2]), one
print("numpy reads loss, tokens and logits; log-softmax of the logits = the loss")
PY

# 5. fp32: the same weights, close but not equal
"$ck" eval "$tmp/a" --fp32 --json --threads 1 > "$tmp/e6.json"
"$py" - "$tmp/e1.json" "$tmp/e6.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
assert b["recipe"] == "fp32", b
assert a["loss"] != b["loss"] and abs(a["loss"] - b["loss"]) < 0.02 * a["loss"], (a["loss"], b["loss"])
print("fp32: loss %.6f vs fp8-blockwise %.6f" % (b["loss"], a["loss"]))
PY

# 6. a Hugging Face directory, and its config.json in transformers 5's spelling
"$ck" export-hf --quiet --input "$tmp/a" --output "$tmp/hf"
"$ck" eval "$tmp/hf" --tokens "$tmp/o1/loss.tokens.npy" --quiet --threads 1 --out "$tmp/o7/loss.npy" > /dev/null
cmp "$tmp/o1/loss.npy" "$tmp/o7/loss.npy" || fail "the exported Hugging Face directory scores differently"
"$py" - "$tmp/hf" "$tmp" <<'PY'
import json, os, sys
d, tmp = sys.argv[1:]
cfg = json.load(open(os.path.join(d, "config.json")))
def variant(name, c):
    o = os.path.join(tmp, name); os.makedirs(o, exist_ok=True)
    for f in os.listdir(d):
        if f != "config.json": os.symlink(os.path.join(d, f), os.path.join(o, f))
    json.dump(c, open(os.path.join(o, "config.json"), "w"), indent=2)
def tf5(c):
    c = dict(c); c["rope_parameters"] = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
    assert c.pop("rope_scaling") is None
    c["head_dim"] = c["qk_rope_head_dim"]; c["dtype"] = c.pop("torch_dtype")
    c["transformers_version"] = "5.0.0"
    return c
variant("hf5", tf5(cfg))
theta = dict(cfg, rope_theta=50000.0)
variant("hf4_theta", theta)
variant("hf5_theta", tf5(theta))
PY
for v in hf5 hf4_theta hf5_theta; do
    "$ck" eval "$tmp/$v" --tokens "$tmp/o1/loss.tokens.npy" --quiet --threads 1 --out "$tmp/o_$v/loss.npy" > /dev/null
done
cmp "$tmp/o1/loss.npy" "$tmp/o_hf5/loss.npy" || fail "rope_parameters scores differently from rope_theta"
cmp "$tmp/o_hf4_theta/loss.npy" "$tmp/o_hf5_theta/loss.npy" || fail "rope_parameters.rope_theta 50000 is not rope_theta 50000"
cmp -s "$tmp/o1/loss.npy" "$tmp/o_hf5_theta/loss.npy" && fail "rope_theta 50000 made no difference"
echo "Hugging Face directory: the same losses; transformers 5 rope_parameters = rope_theta + rope_scaling"

# 7. bad input: clear errors, exit 2 (1 for usage), no output left behind
expect() { # expect STATUS NEEDLE ARGS...
    local want=$1 needle=$2; shift 2
    set +e; "$ck" eval "$@" > "$tmp/bad.out" 2> "$tmp/bad.err"; local got=$?; set -e
    [ "$got" = "$want" ] || { cat "$tmp/bad.err"; fail "eval $*: exit $got, want $want"; }
    grep -qF -- "$needle" "$tmp/bad.err" || { cat "$tmp/bad.err"; fail "eval $*: no \"$needle\""; }
}
printf '1 2 3 4\n5 6 64 7\n' > "$tmp/oov.txt"
expect 2 "oov.txt: sequence 1, position 2: token 64 is outside the vocabulary [0, 64)" \
    "$tmp/a" --tokens "$tmp/oov.txt" --quiet --out "$tmp/o8/loss.npy"
[ -z "$(ls -A "$tmp/o8" 2>/dev/null)" ] || fail "a failed eval left $(ls "$tmp/o8")"
printf '1 2 3 4\n5 6 7\n' > "$tmp/ragged.txt"
expect 2 "ragged.txt:2: 3 tokens, but line 1 has 4" "$tmp/a" --tokens "$tmp/ragged.txt"
printf '1 2 x3\n' > "$tmp/word.txt"
expect 2 'word.txt:1: "x3" is not a token id' "$tmp/a" --tokens "$tmp/word.txt"
printf '5\n' > "$tmp/short.txt"
expect 2 "sequences of 1 token(s): at least 2 are needed" "$tmp/a" --tokens "$tmp/short.txt"
printf '1 2\n' > "$tmp/two.txt"
expect 2 "too short for 1 MTP depth" "$tmp/a" --tokens "$tmp/two.txt"
expect 2 "$tmp/nothere: no such directory" "$tmp/nothere" --tokens "$tmp/tok.txt"
expect 2 "fp32 runs on the CPU backend only" "$tmp/a" --fp32 --backend cuda
expect 1 "--logits needs --out" "$tmp/a" --logits
expect 1 "give --tokens or --job, not both" "$tmp/a" --tokens "$tmp/tok.txt" --job x.json
echo "moetrain-ckpt eval: loss = the training forward's, numpy-readable outputs, clear errors"
rm -rf "$tmp"
