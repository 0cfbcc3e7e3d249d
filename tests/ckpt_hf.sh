#!/bin/bash
# ckpt_hf.sh BIN_DIR SOURCE_DIR TMP
#
# Properties:
#  - export-hf writes the DeepSeek-V3 release format: config.json with
#    quantization_config, model-0000N-of-0000M.safetensors shards of bounded
#    size and model.safetensors.index.json covering every tensor; FP8 E4M3
#    linears with float32 weight_scale_inv [ceil(r/128), ceil(c/128)], BF16
#    norms / router / embedding / head / eh_proj, F32 e_score_correction_bias,
#    the MTP module's copies of embed_tokens and shared_head.head;
#  - export-hf -> import-hf is exact for every weight (FP8 bytes and scales);
#  - import-hf of BF16 sources quantises them by the 128x128 block rule;
#  - diff notices a checkpoint that differs.
set -euo pipefail
bin=$1 src=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
ck="$bin/ckpt/moetrain-ckpt"
py=/usr/bin/python3

"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 4 > /dev/null
"$bin/tests/ckpt_run" --job "$src/deploy/examples/tiny-cpu.json" --threads 2 \
    --set data.path="$tmp/syn" --set batch.seq_len=32 --set batch.micro_batch_size=2 \
    --set batch.global_batch_size=2 --set train.steps=2 --set lr_schedule.warmup_steps=1 \
    --set data.valid_interval=0 --set checkpoint.dir="$tmp/a" --set checkpoint.interval=2 \
    --set train.log_interval=100 2> "$tmp/run.log" || { cat "$tmp/run.log"; exit 1; }

"$ck" export-hf --quiet --input "$tmp/a" --output "$tmp/hf" --shard-size 300K
ls "$tmp/hf"/model-00001-of-*.safetensors > /dev/null

# the release format, checked by an independent reader
"$py" - "$tmp/hf" <<'PY'
import json, struct, sys, os, math
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, "config.json")))
q = cfg["quantization_config"]
assert q == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
             "weight_block_size": [128, 128]}, q
assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
wm = idx["weight_map"]
files = sorted(set(wm.values()))
assert len(files) >= 2, files
for i, f in enumerate(files):
    assert f == "model-%05d-of-%05d.safetensors" % (i + 1, len(files)), f
hdr, data = {}, {}
total = 0
for f in files:
    b = open(os.path.join(d, f), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); h.pop("__metadata__", None)
    for k, v in h.items():
        assert wm[k] == f, k
        s, e = v["data_offsets"]
        hdr[k] = v; data[k] = b[8 + n + s: 8 + n + e]; total += e - s
    # shards of bounded size (a single larger tensor may exceed it)
    assert len(h) == 1 or os.path.getsize(os.path.join(d, f)) < 300e3 + 64e3, f
assert set(hdr) == set(wm), set(wm) ^ set(hdr)
assert idx["metadata"]["total_size"] == total
L = cfg["num_hidden_layers"]
def dt(k): return hdr[k]["dtype"]
n_fp8 = 0
for k, v in hdr.items():
    if k.endswith("weight_scale_inv"):
        w = hdr[k.replace("weight_scale_inv", "weight")]
        assert v["dtype"] == "F32" and w["dtype"] == "F8_E4M3", k
        assert v["shape"] == [math.ceil(w["shape"][0] / 128), math.ceil(w["shape"][1] / 128)], k
        n_fp8 += 1
    elif k.endswith("e_score_correction_bias"):
        assert v["dtype"] == "F32", k
    elif any(s in k for s in ("norm", "embed_tokens", "lm_head", "mlp.gate.weight", "eh_proj", "shared_head.head")):
        assert v["dtype"] == "BF16", (k, v["dtype"])
    else:
        assert v["dtype"] == "F8_E4M3", (k, v["dtype"])
assert n_fp8 > 10
# the MTP module (layer L) carries copies of the embedding and the head
assert data["model.layers.%d.embed_tokens.weight" % L] == data["model.embed_tokens.weight"]
assert data["model.layers.%d.shared_head.head.weight" % L] == data["lm_head.weight"]
assert "model.layers.%d.eh_proj.weight" % L in hdr and "model.layers.%d.enorm.weight" % L in hdr
print("export: %d tensors in %d shards, release format" % (len(hdr), len(files)))
PY

# export -> import: exact for every weight
"$ck" import-hf --quiet --input "$tmp/hf" --output "$tmp/imp"
[ -d "$tmp/imp/step_00000000" ] || { echo "FAIL: import did not write step_00000000"; exit 1; }
"$ck" verify --quiet "$tmp/imp" > /dev/null
"$ck" diff --weights-only "$tmp/a" "$tmp/imp" > /dev/null || { echo "FAIL: export -> import is not exact"; exit 1; }
# ... and diff does notice differences (the optimizer state is not imported)
if "$ck" diff "$tmp/a" "$tmp/imp" > /dev/null 2>&1; then echo "FAIL: diff missed the optimizer state"; exit 1; fi

# BF16 sources are quantised on import: write a BF16 copy of the export
"$py" - "$tmp/hf" "$tmp/hfbf16" <<'PY'
import json, struct, sys, os, shutil
import numpy as np
d, o = sys.argv[1], sys.argv[2]
os.makedirs(o, exist_ok=True)
shutil.copy(os.path.join(d, "config.json"), o)
idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
def e4m3(b):
    b = b.astype(np.int32); s = np.where(b & 0x80, -1.0, 1.0); e = (b >> 3) & 15; m = b & 7
    return s * np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
def bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7fff + ((u >> 16) & 1)) >> 16).astype(np.uint16)
T = {}
for f in sorted(set(idx["weight_map"].values())):
    b = open(os.path.join(d, f), "rb").read(); n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n]); h.pop("__metadata__", None)
    for k, v in h.items():
        s, e = v["data_offsets"]; T[k] = (v, b[8 + n + s: 8 + n + e])
out, off, hdr = [], 0, {}
for k, (v, raw) in T.items():
    if k.endswith("weight_scale_inv"): continue
    if v["dtype"] == "F8_E4M3":
        r, c = v["shape"]; q = e4m3(np.frombuffer(raw, np.uint8)).reshape(r, c)
        sv, sraw = T[k[:-len("weight")] + "weight_scale_inv"]
        sc = np.frombuffer(sraw, np.float32).reshape(sv["shape"])
        x = q * np.repeat(np.repeat(sc, 128, 0), 128, 1)[:r, :c]
        raw = bf16(x).tobytes(); v = {"dtype": "BF16", "shape": [r, c]}
    hdr[k] = {"dtype": v["dtype"], "shape": v["shape"], "data_offsets": [off, off + len(raw)]}
    out.append(raw); off += len(raw)
h = json.dumps(hdr).encode(); h += b" " * ((8 - len(h) % 8) % 8)
with open(os.path.join(o, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h); [f.write(r) for r in out]
PY
"$ck" import-hf --quiet --input "$tmp/hfbf16" --output "$tmp/imp16"
"$ck" export-hf --quiet --input "$tmp/imp16" --output "$tmp/hf2"
# the re-quantised weights are within FP8 rounding of the originals
"$py" - "$tmp/hf" "$tmp/hf2" <<'PY'
import json, struct, sys, os
import numpy as np
def load(d):
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json"))); T = {}
    for f in sorted(set(idx["weight_map"].values())):
        b = open(os.path.join(d, f), "rb").read(); n = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + n]); h.pop("__metadata__", None)
        for k, v in h.items():
            s, e = v["data_offsets"]; T[k] = (v, b[8 + n + s: 8 + n + e])
    return T
def e4m3(b):
    b = b.astype(np.int32); s = np.where(b & 0x80, -1.0, 1.0); e = (b >> 3) & 15; m = b & 7
    return s * np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
def deq(T, k):
    v, raw = T[k]; r, c = v["shape"]
    sv, sraw = T[k[:-len("weight")] + "weight_scale_inv"]
    sc = np.frombuffer(sraw, np.float32).reshape(sv["shape"])
    return e4m3(np.frombuffer(raw, np.uint8)).reshape(r, c) * np.repeat(np.repeat(sc, 128, 0), 128, 1)[:r, :c]
A, B = load(sys.argv[1]), load(sys.argv[2])
n = 0
for k, (v, raw) in A.items():
    if v["dtype"] != "F8_E4M3": continue
    x, y = deq(A, k), deq(B, k)
    tol = 2.0 ** -3 * np.abs(x) + 2.0 ** -9 * np.abs(x).max() + 1e-30
    assert np.all(np.abs(x - y) <= tol), (k, np.abs(x - y).max())
    n += 1
print("bf16 import: %d FP8 weights re-quantised within rounding" % n)
PY
echo "export-hf / import-hf: release format, exact round trip"
rm -rf "$tmp"
