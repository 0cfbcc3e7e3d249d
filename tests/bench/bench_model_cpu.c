/* bench_model_cpu.c - forward + backward time per token of a model on the
 * CPU backend (default: the demo's tiny config, deploy/examples/tiny-cpu.json).
 *
 *   bench_model_cpu [JOB.json] [--steps N] [--threads N]
 *
 * Prints, per recipe: ms per micro-batch, microseconds per token, tokens/s
 * and model GFLOPS (mt_model_flops_per_token). Results: tests/bench/RESULTS.md.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/train/jobspec.h"
#include "base/json_util.h"
#include "base/mt_clock.h"
#include "engine/model/model.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

int main(int argc, char **argv)
{
    const char *path = "deploy/examples/tiny-cpu.json";
    int steps = 20, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else
            path = argv[i];
    }
    json_t *root, *mj;
    if (mt_json_load_file(path, &root) < 0 || !(mj = json_object_get(root, "model"))) {
        fprintf(stderr, "bench: %s: %s\n", path, mt_errmsg());
        return 2;
    }
    mt_model_config cfg;
    if (mt_config_from_json(&cfg, mj, "model", 1) < 0) {
        fprintf(stderr, "bench: %s\n", mt_errmsg());
        return 2;
    }
    json_t *b = json_object_get(root, "batch");
    int B = (int)json_integer_value(json_object_get(b, "micro_batch_size"));
    int T = (int)json_integer_value(json_object_get(b, "seq_len"));
    mt_backend *be;
    if (mt_backend_cpu_create(&be, threads) < 0) return 2;
    int32_t *tok = malloc((size_t)B * (T + 1) * 4);
    mt_rng r;
    mt_rng_seed(&r, 1);
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)mt_rng_below(&r, (uint64_t)cfg.vocab_size);
    printf("model %s: micro-batch %d x %d tokens, %d steps\n", path, B, T, steps);
    const mt_recipe recipes[] = {MT_RECIPE_FP8_BLOCKWISE, MT_RECIPE_BF16, MT_RECIPE_FP32};
    const char *names[] = {"fp8-blockwise", "bf16", "fp32"};
    for (int ri = 0; ri < 3; ri++) {
        mt_model_opts o = {.recipe = recipes[ri], .micro_batch = B, .seq_len = T,
                           .mtp_weight = 0.3, .aux_alpha = 1e-4};
        mt_model *m;
        if (mt_model_create(&m, &cfg, &o, be) < 0 || mt_model_init_random(m, 1) < 0) {
            fprintf(stderr, "bench: %s\n", mt_errmsg());
            return 2;
        }
        mt_mb_stats st;
        for (int i = 0; i < 3; i++) mt_model_step(m, tok, 1, 1.0, &st); /* warm-up */
        double t0 = mt_now_s();
        for (int i = 0; i < steps; i++)
            if (mt_model_step(m, tok, 1, 1.0, &st) < 0) {
                fprintf(stderr, "bench: %s\n", mt_errmsg());
                return 2;
            }
        double dt = (mt_now_s() - t0) / steps, ntok = (double)B * T;
        printf("  %-14s fwd+bwd %8.2f ms/micro-batch  %7.2f us/token  %8.0f tokens/s  %6.2f GFLOPS\n",
               names[ri], 1e3 * dt, 1e6 * dt / ntok, ntok / dt,
               mt_model_flops_per_token(&cfg, T) * ntok / dt / 1e9);
        mt_model_destroy(m);
    }
    free(tok);
    be->destroy(be);
    json_decref(root);
    return 0;
}
