/* rope_table.c - rotary frequencies, with YaRN context extension.
 *
 * Follows transformers' yarn parameters for DeepSeek-V3: frequencies between
 * the correction range [low, high] (from beta_fast / beta_slow rotations over
 * the original context) blend interpolated (divided by `factor`) and original
 * frequencies by a linear ramp; cos / sin carry the attention factor
 * get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); and the
 * softmax scale is qk_head_dim^-1/2 * get_mscale(factor, mscale_all_dim)^2.
 */
#include <math.h>
#include <stdlib.h>

#include "engine/model/layers.h"
#include "base/mt_status.h"

static double yarn_mscale(double scale, double mscale)
{
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* Dimension index at which a frequency makes `rotations` turns over `ctx`. */
static double correction_dim(double rotations, int dim, double base, double ctx)
{
    return (dim * log(ctx / (rotations * 2.0 * 3.14159265358979323846))) / (2.0 * log(base));
}

int mt_rope_tables(const mt_model_config *cfg, int T, float *cos_t, float *sin_t,
                   float *attn_scale)
{
    const int R = cfg->qk_rope_head_dim, half = R / 2;
    const double base = cfg->rope_theta;
    const mt_rope_scaling *rs = &cfg->rope_scaling;
    double *inv = malloc((size_t)half * sizeof *inv);
    if (!inv) return MT_ERR(MT_ENOMEM, "rope tables: out of memory");
    double factor_cs = 1.0;
    double scale = 1.0 / sqrt((double)mt_config_qk_head_dim(cfg));
    for (int i = 0; i < half; i++) inv[i] = 1.0 / pow(base, (2.0 * i) / R);
    if (rs->type == MT_ROPE_SCALING_YARN) {
        double ctx = (double)rs->original_max_position_embeddings;
        double lo = floor(correction_dim(rs->beta_fast, R, base, ctx));
        double hi = ceil(correction_dim(rs->beta_slow, R, base, ctx));
        if (lo < 0) lo = 0;
        if (hi > R - 1) hi = R - 1;
        /* Kimi-K2 sets beta_fast == beta_slow: the range is then one step
         * wide (floor / ceil of one correction dim) or, where that dim is an
         * integer or both ends are clamped together, empty; transformers'
         * linear ramp widens an empty range by 0.001, which makes it a step
         * at lo. */
        if (lo == hi) hi += 0.001;
        for (int i = 0; i < half; i++) {
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrap = 1.0 - ramp; /* weight of the original frequency */
            inv[i] = inv[i] / rs->factor * (1.0 - extrap) + inv[i] * extrap;
        }
        if (rs->mscale != 0 && rs->mscale_all_dim != 0)
            factor_cs = yarn_mscale(rs->factor, rs->mscale) /
                        yarn_mscale(rs->factor, rs->mscale_all_dim);
        else
            factor_cs = yarn_mscale(rs->factor, 1.0);
        if (rs->mscale_all_dim != 0) {
            double m = yarn_mscale(rs->factor, rs->mscale_all_dim);
            scale *= m * m;
        }
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double a = (double)t * inv[i];
            cos_t[(size_t)t * half + i] = (float)(cos(a) * factor_cs);
            sin_t[(size_t)t * half + i] = (float)(sin(a) * factor_cs);
        }
    *attn_scale = (float)scale;
    free(inv);
    return MT_OK;
}
