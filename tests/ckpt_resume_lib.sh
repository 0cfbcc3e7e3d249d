# shellcheck shell=bash disable=SC2154  # bin, src, tmp and shape come from the sourcing test
# ckpt_resume_lib.sh - sourced by the resume tests across layouts
# (ckpt_dp_resume.sh, ckpt_tp_resume.sh, ckpt_pp_resume.sh) after they set
# bin, src, tmp and, optionally, `shape` (settings of the model and the
# sequence; default: the tiny job at 32 tokens). Provides:
#   common        the tiny job, fp32, 6 steps of 4 sequences, no validation
#   run NP NAME [SETTINGS...]   ckpt_run under mpirun; metrics to $tmp/NAME.jsonl
#   losses FILE [FROM]          "step loss grad_norm" lines from step FROM on
#   close A B TOL               steps 4-6 of B within TOL (relative) of A's
command -v mpirun > /dev/null || { echo "SKIP: no mpirun"; exit 77; }
rm -rf "$tmp" && mkdir -p "$tmp"
"$bin/engine/moetrain-data" synth --output "$tmp/syn" --vocab 64 --tokens 60000 --seed 4 > /dev/null
[ -n "${shape+x}" ] || shape=(--set batch.seq_len=32)
common=(--job "$src/deploy/examples/tiny-cpu.json" --threads 1 --set data.path="$tmp/syn"
        --set precision.recipe=fp32 "${shape[@]}" --set batch.micro_batch_size=1
        --set batch.global_batch_size=4 --set train.steps=6 --set lr_schedule.warmup_steps=1
        --set data.valid_interval=0 --set train.log_interval=100)
run() {
    local np=$1 name=$2; shift 2
    mpirun --allow-run-as-root --oversubscribe -np "$np" "$bin/tests/ckpt_run" "${common[@]}" \
        --metrics-jsonl "$tmp/$name.jsonl" "$@" 2> "$tmp/$name.log" || { cat "$tmp/$name.log"; exit 1; }
}
losses() {
    grep -o '"step":[0-9]*\|"loss":[^,]*\|"grad_norm":[^,]*' "$1" | cut -d: -f2 | paste -d' ' - - - |
        awk -v s="${2:-1}" '$1 >= s'
}
close() {
    paste -d' ' <(losses "$1" 4) <(losses "$2") | awk -v tol="$3" '
        { n++; if ($1 != $4) bad = 1
          for (i = 2; i <= 3; i++) { d = $i - $(i + 3); if (d < 0) d = -d
            r = d / ($i < 0 ? -$i : $i); if (r > worst) worst = r } }
        END { printf "  worst relative difference %.3g over %d steps\n", worst, n
              exit (bad || n != 3 || worst > tol) }'
}
