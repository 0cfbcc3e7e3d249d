/* moetrain_ckpt.c - the moetrain-ckpt tool: inspect, verify, reshard,
 * export-hf, import-hf, diff, list (ckpt/FORMAT.md), eval (ckpt_eval.h).
 *
 * Exit status: 0 success, 1 usage error, 2 failure (verify / diff: the
 * checkpoint is damaged or different; the report is on stderr).
 */
#define _POSIX_C_SOURCE 200809L
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt/ckpt.h"
#include "runtime/ckpt_eval.h"
#include "ckpt/hf.h"
#include "engine/model/config.h"
#include "base/mt_log.h"
#include "base/mt_status.h"

enum { EXIT_OK = 0, EXIT_USAGE = 1, EXIT_FAIL = 2 };

static const char usage_text[] =
    "usage: moetrain-ckpt <command> [options]\n"
    "\n"
    "  inspect DIR [--json]        format, step, layout, model, tensors, files, state\n"
    "  verify DIR [--quiet]        every checksum, shard coverage, index consistency;\n"
    "                              exit 2 with one line per problem\n"
    "  reshard --input DIR --output DIR --layout tp=..,pp=..,ep=..,dp=..[,vpp=..,etp=..]\n"
    "          [--overwrite]       re-lay a checkpoint out for another parallel layout\n"
    "                              (streaming, bounded memory)\n"
    "  export-hf --input DIR --output DIR [--shard-size 5G]\n"
    "                              Hugging Face DeepSeek-V3 release format (FP8 +\n"
    "                              weight_scale_inv, config.json, safetensors index)\n"
    "  import-hf --input DIR --output DIR [--layout ...] [--recipe fp8-blockwise|bf16|fp32]\n"
    "          [--overwrite]       a step-0 checkpoint for continued pre-training\n"
    "  diff A B [--weights-only] [--meta]\n"
    "                              compare two checkpoints tensor by tensor (bytes)\n"
    "  list ROOT                   committed checkpoints under a root\n"
    "  eval DIR [--tokens FILE | --job JOB.json [--set key.path=value ...]]\n"
    "       [--out FILE.npy [--logits]] [--backend cpu|cuda] [--fp32] [--batch N]\n"
    "       [--threads N] [--json]\n"
    "                              score token sequences with the weights of DIR (a\n"
    "                              checkpoint or a Hugging Face directory): mean loss;\n"
    "                              --out writes the per-token loss [S, T] f32 to\n"
    "                              FILE.npy, the scored tokens [S, T+1] to\n"
    "                              FILE.tokens.npy and with --logits the logits\n"
    "                              [S, T, V] f32 to FILE.logits.npy (numpy.load reads\n"
    "                              them). --tokens: a .npy integer array [S, L] or [L],\n"
    "                              or text, one sequence per line; default: the valid\n"
    "                              split of --job, else of the job saved with DIR.\n"
    "                              The checkpoint's recipe, or --fp32 (CPU only).\n"
    "\n"
    "DIR is a checkpoint directory (step_NNNNNNNN) or a root (its newest committed\n"
    "checkpoint). An --output root gets OUTPUT/step_NNNNNNNN through the commit\n"
    "protocol; an --output named step_NNNNNNNN is written as that directory.\n"
    "A step that exists already is refused; --overwrite replaces it atomically\n"
    "(one committed copy at every instant).\n"
    "Long operations draw a progress bar on stderr (--quiet: none).\n";

static int usage_error(const char *fmt, const char *arg)
{
    fprintf(stderr, "moetrain-ckpt: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage_text);
    return EXIT_USAGE;
}

static int fail(void)
{
    fprintf(stderr, "moetrain-ckpt: %s\n", mt_errmsg());
    return EXIT_FAIL;
}

/* ---- options ----------------------------------------------------------------------- */

typedef struct opts {
    const char *pos[4];
    int npos;
    const char *input, *output, *layout, *shard_size, *recipe;
    const char *tokens, *job, *out, *backend, *batch, *threads;
    const char *sets[128];
    int n_sets;
    int json, quiet, weights_only, meta, logits, fp32, overwrite;
} opts;

static int parse(int argc, char **argv, opts *o)
{
    memset(o, 0, sizeof *o);
    for (int i = 2; i < argc; i++) {
        const char *s = argv[i];
        const char **val = !strcmp(s, "--input")        ? &o->input
                           : !strcmp(s, "--output")     ? &o->output
                           : !strcmp(s, "--layout")     ? &o->layout
                           : !strcmp(s, "--shard-size") ? &o->shard_size
                           : !strcmp(s, "--recipe")     ? &o->recipe
                           : !strcmp(s, "--tokens")     ? &o->tokens
                           : !strcmp(s, "--job")        ? &o->job
                           : !strcmp(s, "--out")        ? &o->out
                           : !strcmp(s, "--backend")    ? &o->backend
                           : !strcmp(s, "--batch")      ? &o->batch
                           : !strcmp(s, "--threads")    ? &o->threads
                                                        : NULL;
        if (!strcmp(s, "--set")) {
            if (i + 1 >= argc) return usage_error("missing value for %s", s);
            if (o->n_sets == 128) return usage_error("more than 128 %s", s);
            o->sets[o->n_sets++] = argv[++i];
        } else if (val) {
            if (i + 1 >= argc) return usage_error("missing value for %s", s);
            *val = argv[++i];
        } else if (!strcmp(s, "--json")) o->json = 1;
        else if (!strcmp(s, "--quiet")) o->quiet = 1;
        else if (!strcmp(s, "--weights-only")) o->weights_only = 1;
        else if (!strcmp(s, "--meta")) o->meta = 1;
        else if (!strcmp(s, "--logits")) o->logits = 1;
        else if (!strcmp(s, "--fp32")) o->fp32 = 1;
        else if (!strcmp(s, "--overwrite")) o->overwrite = 1;
        else if (s[0] == '-' && s[1]) return usage_error("unknown option %s", s);
        else if (o->npos < 4) o->pos[o->npos++] = s;
        else return usage_error("too many arguments at %s", s);
    }
    return EXIT_OK;
}

/* One line per problem, the first 50 (the count comes with the verdict). */
static void report_line(void *ctx, const char *file, const char *tensor, const char *problem)
{
    int *n = ctx;
    if (++*n <= 50) fprintf(stderr, "%s%s%s: %s\n", file, tensor[0] ? ": tensor " : "", tensor, problem);
    else if (*n == 51) fprintf(stderr, "...\n");
}

/* ---- inspect --------------------------------------------------------------------------- */

static const char *contents_text(const mt_shard_opts *o, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s, other weights %s%s%s%s", o->fp8 ? "FP8 linears (e4m3 + weight_scale_inv)" : "no FP8",
             mt_dtype_name(o->act_dtype), o->optimizer ? ", optimizer exp_avg / exp_avg_sq bf16" : ", no optimizer state",
             o->optimizer && o->has_main ? ", main params " : "",
             o->optimizer && o->has_main ? mt_dtype_name(o->main_dtype) : "");
    return buf;
}

static int cmd_inspect(const opts *o)
{
    if (o->npos != 1) return usage_error("inspect needs one DIR%s", "");
    mt_ckpt *ck;
    if (mt_ckpt_open(&ck, o->pos[0]) < 0) return fail();
    const mt_ckpt_meta *m = mt_ckpt_get_meta(ck);
    char lt[128], ct[256];
    mt_layout_format(&m->layout, lt, sizeof lt);
    mt_model_config c;
    json_error_t e;
    json_t *cj = json_loads(m->config_json, 0, &e);
    int have_cfg = cj && mt_config_from_json(&c, cj, "model", 0) == MT_OK;
    json_t *sj = json_loads(m->state_json, 0, &e);
    /* per writing rank (file): pieces and bytes */
    int max_rank = 0, nf = 0;
    for (int p = 0; p < mt_ckpt_n_pieces(ck); p++)
        if (mt_ckpt_piece_at(ck, p)->rank > max_rank) max_rank = mt_ckpt_piece_at(ck, p)->rank;
    int64_t *fbytes = calloc((size_t)max_rank + 1, sizeof *fbytes);
    int *fpieces = calloc((size_t)max_rank + 1, sizeof *fpieces);
    int *ranks = calloc((size_t)max_rank + 1, sizeof *ranks);
    if (!fbytes || !fpieces || !ranks) {
        fprintf(stderr, "moetrain-ckpt: out of memory\n");
        return EXIT_FAIL;
    }
    for (int p = 0; p < mt_ckpt_n_pieces(ck); p++) {
        const mt_ckpt_piece_rec *r = mt_ckpt_piece_at(ck, p);
        fbytes[r->rank] += r->nbytes;
        fpieces[r->rank]++;
    }
    for (int r = 0; r <= max_rank; r++) {
        if (!fpieces[r]) continue;
        fbytes[nf] = fbytes[r];
        fpieces[nf] = fpieces[r];
        ranks[nf++] = r;
    }
    int n_params = 0;
    for (int t = 0; t < mt_ckpt_n_tensors(ck); t++)
        n_params += strncmp(mt_ckpt_tensor_at(ck, t)->name, "optimizer.", 10) != 0 &&
                    !strstr(mt_ckpt_tensor_at(ck, t)->name, "weight_scale_inv");
    if (o->json) {
        json_t *files = json_array(), *tensors = json_array();
        for (int k = 0; k < nf; k++) {
            char fn[32];
            snprintf(fn, sizeof fn, "shard_%05d.h5", ranks[k]);
            json_array_append_new(files, json_pack("{s:s,s:i,s:I,s:i}", "name", fn, "rank", ranks[k],
                                                   "bytes", (json_int_t)fbytes[k], "pieces", fpieces[k]));
        }
        for (int t = 0; t < mt_ckpt_n_tensors(ck); t++) {
            const mt_ckpt_tensor *x = mt_ckpt_tensor_at(ck, t);
            json_t *shape = x->ndim == 2 ? json_pack("[I,I]", (json_int_t)x->shape[0], (json_int_t)x->shape[1])
                                         : json_pack("[I]", (json_int_t)x->shape[0]);
            json_array_append_new(tensors, json_pack("{s:s,s:s,s:o,s:i}", "name", x->name, "dtype",
                                                     mt_dtype_name(x->dtype), "shape", shape,
                                                     "pieces", x->n_pieces));
        }
        json_t *lj = json_pack("{s:i,s:i,s:i,s:i,s:i,s:i,s:b}", "tp", m->layout.tp, "pp", m->layout.pp,
                               "vpp", m->layout.vpp, "ep", m->layout.ep, "etp", m->layout.etp, "dp",
                               m->layout.dp, "dualpipev", m->layout.schedule == MT_PP_DUALPIPEV);
        json_t *out = json_pack(
            "{s:s,s:s,s:i,s:I,s:I,s:I,s:o,s:s,s:O?,s:O?,s:I,s:i,s:i,s:o,s:o}", "path", mt_ckpt_dir(ck),
            "format", MT_CKPT_FORMAT, "format_version", MT_CKPT_FORMAT_VERSION, "step",
            (json_int_t)m->step, "consumed_samples", (json_int_t)m->consumed_samples,
            "consumed_tokens", (json_int_t)m->consumed_tokens, "layout", lj, "contents",
            contents_text(&m->opts, ct, sizeof ct), "model", cj, "state", sj, "bytes",
            (json_int_t)mt_ckpt_bytes(ck), "n_tensors", mt_ckpt_n_tensors(ck), "n_pieces",
            mt_ckpt_n_pieces(ck), "files", files, "tensors", tensors);
        char *text = json_dumps(out, JSON_INDENT(2));
        puts(text);
        free(text);
        json_decref(out);
    } else {
        printf("checkpoint  %s  (%s v%d)\n", mt_ckpt_dir(ck), MT_CKPT_FORMAT, MT_CKPT_FORMAT_VERSION);
        printf("step        %lld   consumed samples %lld   tokens %lld\n", (long long)m->step,
               (long long)m->consumed_samples, (long long)m->consumed_tokens);
        printf("layout      %s\n", lt);
        printf("contents    %s\n", contents_text(&m->opts, ct, sizeof ct));
        if (have_cfg)
            printf("model       hidden %d, %d layers (+%d MTP), %d routed experts (top %d), vocab %lld\n",
                   c.hidden_size, c.num_hidden_layers, c.num_nextn_predict_layers, c.n_routed_experts,
                   c.num_experts_per_tok, (long long)c.vocab_size);
        printf("tensors     %d (%d parameters), %d pieces, %d files, %.1f MB\n", mt_ckpt_n_tensors(ck),
               n_params, mt_ckpt_n_pieces(ck), nf, (double)mt_ckpt_bytes(ck) / 1e6);
        for (int k = 0; k < nf; k++)
            printf("  shard_%05d.h5  %10.1f MB  %d pieces\n", ranks[k], (double)fbytes[k] / 1e6, fpieces[k]);
        printf("state       %s\n", m->state_json);
        json_decref(cj);
        json_decref(sj);
    }
    free(fbytes);
    free(fpieces);
    free(ranks);
    mt_ckpt_close(ck);
    return EXIT_OK;
}

/* ---- the other commands ------------------------------------------------------------------- */

static int cmd_verify(const opts *o)
{
    if (o->npos != 1) return usage_error("verify needs one DIR%s", "");
    mt_progress p;
    mt_progress_start(&p, "verify", 1, !o->quiet);
    int n = 0;
    if (mt_ckpt_verify(o->pos[0], report_line, &n, &p) < 0) {
        fprintf(stderr, "moetrain-ckpt verify: FAILED: %s\n", mt_errmsg());
        return EXIT_FAIL;
    }
    char dir[4200];
    mt_ckpt_resolve(o->pos[0], dir, sizeof dir);
    printf("%s: OK\n", dir);
    return EXIT_OK;
}

static int cmd_reshard(const opts *o)
{
    if (!o->input || !o->output || !o->layout)
        return usage_error("reshard needs --input, --output and --layout%s", "");
    mt_layout l;
    if (mt_layout_parse(&l, o->layout) < 0) return fail();
    mt_progress p;
    mt_progress_start(&p, "reshard", 1, !o->quiet);
    if (mt_ckpt_reshard(o->input, o->output, &l, o->overwrite ? MT_CKPT_OVERWRITE : 0, &p) < 0)
        return fail();
    return EXIT_OK;
}

static int parse_size(const char *s, int64_t *out)
{
    char *end;
    double v = strtod(s, &end);
    double mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1e3;
    else if (*end == 'M' || *end == 'm') mul = 1e6;
    else if (*end == 'G' || *end == 'g') mul = 1e9;
    else if (*end) return MT_ERR(MT_EINVAL, "--shard-size %s: a number with an optional K, M or G", s);
    if (v <= 0) return MT_ERR(MT_EINVAL, "--shard-size %s: must be positive", s);
    *out = (int64_t)(v * mul);
    return MT_OK;
}

static int cmd_export(const opts *o)
{
    if (!o->input || !o->output) return usage_error("export-hf needs --input and --output%s", "");
    int64_t shard = (int64_t)5e9;
    if (o->shard_size && parse_size(o->shard_size, &shard) < 0) return fail();
    mt_progress p;
    mt_progress_start(&p, "export", 1, !o->quiet);
    if (mt_hf_export(o->input, o->output, shard, &p) < 0) return fail();
    return EXIT_OK;
}

static int cmd_import(const opts *o)
{
    if (!o->input || !o->output) return usage_error("import-hf needs --input and --output%s", "");
    mt_layout l;
    mt_layout_default(&l);
    if (o->layout && mt_layout_parse(&l, o->layout) < 0) return fail();
    mt_shard_opts so = {.fp8 = 1, .act_dtype = MT_DT_BF16};
    if (o->recipe) {
        if (!strcmp(o->recipe, "bf16")) so.fp8 = 0;
        else if (!strcmp(o->recipe, "fp32")) so.fp8 = 0, so.act_dtype = MT_DT_F32;
        else if (strcmp(o->recipe, "fp8-blockwise") != 0)
            return usage_error("--recipe %s: fp8-blockwise, bf16 or fp32", o->recipe);
    }
    mt_progress p;
    mt_progress_start(&p, "import", 1, !o->quiet);
    if (mt_hf_import(o->input, o->output, &so, &l, o->overwrite ? MT_CKPT_OVERWRITE : 0, &p) < 0)
        return fail();
    return EXIT_OK;
}

static int cmd_diff(const opts *o)
{
    if (o->npos != 2) return usage_error("diff needs two checkpoints%s", "");
    int n = 0;
    if (mt_ckpt_diff(o->pos[0], o->pos[1], o->weights_only, o->meta, report_line, &n) < 0) {
        fprintf(stderr, "moetrain-ckpt diff: %s\n", mt_errmsg());
        return EXIT_FAIL;
    }
    printf("identical\n");
    return EXIT_OK;
}

static int cmd_list(const opts *o)
{
    if (o->npos != 1) return usage_error("list needs one ROOT%s", "");
    int64_t *steps;
    int n;
    if (mt_ckpt_list(o->pos[0], &steps, &n) < 0) return fail();
    for (int i = 0; i < n; i++) printf("step_%08lld\n", (long long)steps[i]);
    free(steps);
    return EXIT_OK;
}

/* ---- eval ---------------------------------------------------------------------------- */

static volatile sig_atomic_t interrupted;
static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

typedef struct eval_progress {
    mt_progress bar;
    int quiet, scoring, loading;
} eval_progress;

static void on_eval_progress(void *ctx, const char *phase, int64_t done, int64_t total)
{
    eval_progress *p = ctx;
    if (!strcmp(phase, "load")) {
        if (!p->loading) mt_progress_start_count(&p->bar, "load", total, "tensors", !p->quiet);
        p->loading = 1;
        mt_progress_add(&p->bar, done - p->bar.done);
        if (done == total) mt_progress_end(&p->bar);
        return;
    }
    if (!p->scoring) mt_progress_start_count(&p->bar, "eval", total, "tokens", !p->quiet);
    p->scoring = 1;
    if (done == 0) return;
    mt_progress_add(&p->bar, done - p->bar.done);
    if (done == total) mt_progress_end(&p->bar);
}

/* A positive integer option; 0 when absent. */
static int int_option(const char *name, const char *v, int *out)
{
    *out = 0;
    if (!v) return EXIT_OK;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < 0 || x > 1 << 20) return usage_error("%s: a count", name);
    *out = (int)x;
    return EXIT_OK;
}

static int cmd_eval(const opts *o)
{
    if (o->npos != 1) return usage_error("eval needs one DIR (a checkpoint or a Hugging Face directory)%s", "");
    if (o->tokens && o->job) return usage_error("eval: give --tokens or --job, not both%s", "");
    if (o->n_sets && !o->job) return usage_error("eval: --set needs --job%s", "");
    if (o->logits && !o->out) return usage_error("eval: --logits needs --out FILE.npy%s", "");
    mt_ckpt_eval_args a = {.ckpt = o->pos[0], .tokens = o->tokens, .out = o->out, .logits = o->logits,
                           .backend = o->backend, .fp32 = o->fp32};
    int rc;
    if ((rc = int_option("--batch", o->batch, &a.micro_batch)) != EXIT_OK) return rc;
    if ((rc = int_option("--threads", o->threads, &a.threads)) != EXIT_OK) return rc;
    mt_jobspec job;
    if (o->job) {
        if (mt_jobspec_load(&job, o->job, o->sets, o->n_sets) < 0) return fail();
        a.job = &job;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    eval_progress p;
    memset(&p, 0, sizeof p);
    p.quiet = o->quiet || o->json;
    if (p.quiet && mt_log_get_level() == MT_LOG_INFO) mt_log_set_level(MT_LOG_WARN);
    mt_ckpt_eval_report rep;
    if (mt_ckpt_eval(&a, on_eval_progress, &p, &interrupted, &rep) < 0) return fail();
    const mt_eval_result *r = &rep.r;
    if (o->json) {
        json_t *j = json_pack("{s:s,s:s,s:f,s:f,s:I,s:I,s:i,s:s,s:s,s:f}", "checkpoint", rep.dir,
                              "input", rep.input, "loss", r->loss, "perplexity", exp(r->loss),
                              "sequences", (json_int_t)r->sequences, "tokens",
                              (json_int_t)r->tokens, "seq_len", r->seq_len, "recipe", rep.recipe,
                              "backend", rep.backend, "seconds", r->seconds);
        if (rep.loss_path[0]) json_object_set_new(j, "loss_file", json_string(rep.loss_path));
        if (rep.tokens_path[0]) json_object_set_new(j, "tokens_file", json_string(rep.tokens_path));
        if (rep.logits_path[0]) json_object_set_new(j, "logits_file", json_string(rep.logits_path));
        char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
        puts(text);
        free(text);
        json_decref(j);
        return EXIT_OK;
    }
    printf("checkpoint  %s\n", rep.dir);
    printf("input       %s: %lld sequences x %d tokens scored\n", rep.input,
           (long long)r->sequences, r->seq_len);
    printf("loss        %.9g (perplexity %.6g), mean over %lld tokens\n", r->loss, exp(r->loss),
           (long long)r->tokens);
    printf("computed    %s recipe on %s in %.1f s\n", rep.recipe, rep.backend, r->seconds);
    if (rep.loss_path[0]) printf("wrote       %s (loss), %s (tokens)\n", rep.loss_path, rep.tokens_path);
    if (rep.logits_path[0]) printf("wrote       %s (logits)\n", rep.logits_path);
    return EXIT_OK;
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(usage_text, argc < 2 ? stderr : stdout);
        return argc < 2 ? EXIT_USAGE : EXIT_OK;
    }
    opts o;
    int rc = parse(argc, argv, &o);
    if (rc) return rc;
    const char *c = argv[1];
    if (!strcmp(c, "inspect")) return cmd_inspect(&o);
    if (!strcmp(c, "verify")) return cmd_verify(&o);
    if (!strcmp(c, "reshard")) return cmd_reshard(&o);
    if (!strcmp(c, "export-hf")) return cmd_export(&o);
    if (!strcmp(c, "import-hf")) return cmd_import(&o);
    if (!strcmp(c, "diff")) return cmd_diff(&o);
    if (!strcmp(c, "list")) return cmd_list(&o);
    if (!strcmp(c, "eval")) return cmd_eval(&o);
    return usage_error("unknown command %s", c);
}
