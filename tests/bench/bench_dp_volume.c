/* bench_dp_volume.c - bytes each data-parallel rank sends and receives per
 * optimizer step for ZeRO-1 (issue 13), computed from the parameter table
 * and the owners alone (nothing is run or allocated at model size).
 *
 *   bench_dp_volume JOB.json [DP ...]      (default DP: 2 4 8)
 *
 * Per rank r of dp Z (expert parallelism off: every parameter is owned by
 * one dp rank, mt_zero_owners):
 *   gradient reduce-scatter into the owners (comm.h reduce_owned), wire w
 *   bytes per element (fp32 4, bf16 2):
 *     sent = w x (elements not owned by r), received = w x (Z - 1) x owned;
 *   compute-copy all-gather from the owners (comm.h gather_owned), per
 *   parameter: FP8 (fp8-blockwise recipe, linear layers) E4M3 weights +
 *   transposed copy + their 128x128 f32 scales = 2 n + 8 blocks bytes;
 *   otherwise the act copy, n x act bytes (2 on CUDA, 4 on the CPU):
 *     sent = (Z - 1) x owned bytes, received = all bytes - owned bytes.
 * Prints the largest rank's numbers (the step waits for it) and the mean,
 * and the one-rank all-reduce volume for comparison (a ring all-reduce of
 * fp32 gradients: 2 (Z - 1) / Z x 4 bytes per element, sent and received).
 */
#include <stdio.h>
#include <stdlib.h>

#include "base/mt_status.h"
#include "engine/model/param_table.h"
#include "engine/parallel/sharding.h"
#include "engine/train/jobspec.h"

static double mb(double b) { return b / 1e6; }

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_dp_volume JOB.json [DP ...]\n");
        return 2;
    }
    /* the job's data is not read: empty stand-ins satisfy the spec's check */
    char dp_set[256], f[240];
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dp_set, sizeof dp_set, "data.path=%s/bench_dp_volume_data", tmp);
    for (int e = 0; e < 2; e++) {
        snprintf(f, sizeof f, "%s/bench_dp_volume_data.%s", tmp, e ? "bin" : "idx");
        FILE *fp = fopen(f, "a");
        if (fp) fclose(fp);
    }
    mt_jobspec j;
    const char *sets[] = {dp_set};
    if (mt_jobspec_load(&j, argv[1], sets, 1) < 0) {
        fprintf(stderr, "%s: %s\n", argv[1], mt_errmsg());
        return 1;
    }
    mt_param_table t;
    if (mt_params_build(&t, &j.model, 0, -1) < 0) {
        fprintf(stderr, "parameter table: %s\n", mt_errmsg());
        return 1;
    }
    const int fp8 = j.precision.recipe == MT_RECIPE_FP8_BLOCKWISE;
    const double act = j.backend == MT_BACKEND_CUDA ? 2 : 4;
    /* optimizer state per element: main copy (fp32 4, bf16 2, none 0) + m + v (bf16) */
    const int per_el = (j.precision.main_params == MT_MAIN_FP32   ? 4
                        : j.precision.main_params == MT_MAIN_BF16 ? 2
                                                                  : 0) + 4;
    const char *mp_name = j.precision.main_params == MT_MAIN_FP32   ? "fp32"
                          : j.precision.main_params == MT_MAIN_BF16 ? "bf16"
                                                                    : "none";
    double n_all = 0, copy_all = 0;
    double *copy = calloc((size_t)t.n + 1, sizeof *copy);
    int *owner = calloc((size_t)t.n + 1, sizeof *owner);
    if (!copy || !owner) return 1;
    for (int i = 0; i < t.n; i++) {
        const mt_param_desc *d = &t.p[i];
        if (d->kind == MT_PK_ROUTER_BIAS) continue; /* no gradient, set by the balancing rule */
        const double n = (double)mt_param_numel(d);
        const double nb = (double)(((d->rows + 127) / 128) * ((d->cols + 127) / 128));
        copy[i] = fp8 && mt_param_kind_is_fp8(d->kind) ? 2 * n + 8 * nb : n * act;
        n_all += n;
        copy_all += copy[i];
    }
    printf("%s: %d parameters, %.0f gradient elements (%.1f MB fp32), compute copies %.1f MB "
           "(%s, act %.0f bytes)\n", j.name, t.n, n_all, mb(4 * n_all), mb(copy_all),
           fp8 ? "fp8-blockwise" : "bf16/fp32", act);
    printf("%3s | %-28s | %-28s | %-28s | %s\n", "dp", "reduce-scatter fp32 MB sent/recv",
           "reduce-scatter bf16 MB sent/recv", "all-gather MB sent/recv",
           "ring all-reduce fp32 MB (each way)");
    int dps[16] = {2, 4, 8}, n_dp = 3;
    if (argc > 2) {
        n_dp = 0;
        for (int a = 2; a < argc && n_dp < 16; a++) dps[n_dp++] = atoi(argv[a]);
    }
    for (int k = 0; k < n_dp; k++) {
        const int Z = dps[k];
        mt_layout l = j.parallel;
        l.tp = l.pp = l.vpp = l.ep = l.etp = 1;
        l.dp = Z;
        if (Z < 1 || mt_zero_owners(&j.model, &l, owner) < 0) {
            fprintf(stderr, "dp %d: %s\n", Z, mt_errmsg());
            return 1;
        }
        double worst[4] = {0, 0, 0, 0}, mean[4] = {0, 0, 0, 0}; /* rs send, rs recv, ag send, ag recv */
        double own_max = 0;
        for (int r = 0; r < Z; r++) {
            double own_n = 0, own_c = 0;
            for (int i = 0; i < t.n; i++)
                if (owner[i] == r && t.p[i].kind != MT_PK_ROUTER_BIAS) {
                    own_n += (double)mt_param_numel(&t.p[i]);
                    own_c += copy[i];
                }
            if (own_n > own_max) own_max = own_n;
            const double v[4] = {n_all - own_n, (Z - 1) * own_n, (Z - 1) * own_c, copy_all - own_c};
            for (int q = 0; q < 4; q++) {
                if (v[q] > worst[q]) worst[q] = v[q];
                mean[q] += v[q] / Z;
            }
        }
        printf("%3d | max %8.1f / %8.1f      | max %8.1f / %8.1f      | max %8.1f / %8.1f      | "
               "%.1f\n", Z, mb(4 * worst[0]), mb(4 * worst[1]), mb(2 * worst[0]),
               mb(2 * worst[1]), mb(worst[2]), mb(worst[3]), mb(4 * n_all * 2 * (Z - 1) / Z));
        printf("    | mean %7.1f / %8.1f      | mean %7.1f / %8.1f      | mean %7.1f / %8.1f      |\n",
               mb(4 * mean[0]), mb(4 * mean[1]), mb(2 * mean[0]), mb(2 * mean[1]), mb(mean[2]),
               mb(mean[3]));
        printf("    | optimizer state per rank (main %s + bf16 m, v: %d bytes/element): max %.1f MB, "
               "one rank %.1f MB\n", mp_name, per_el, mb(per_el * own_max), mb(per_el * n_all));
    }
    free(copy);
    free(owner);
    mt_params_free(&t);
    return 0;
}
