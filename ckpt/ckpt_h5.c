/* ckpt_h5.c - HDF5 and small shared helpers of the checkpoint module. */
#define _XOPEN_SOURCE 700
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/ckpt_internal.h"
#include "engine/model/config.h"
#include "kernels/mt_fp8.h"
#include "base/mt_status.h"

/* ---- lock ------------------------------------------------------------------ */

static pthread_mutex_t h5_mutex;
static pthread_once_t h5_once = PTHREAD_ONCE_INIT;

static void h5_init(void)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&h5_mutex, &a);
    pthread_mutexattr_destroy(&a);
}

void ck_lock(void)
{
    pthread_once(&h5_once, h5_init);
    pthread_mutex_lock(&h5_mutex);
    /* errors are reported through our messages, not printed by HDF5 */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

void ck_unlock(void) { pthread_mutex_unlock(&h5_mutex); }

typedef struct errwalk {
    char *buf;
    size_t cap;
    int found;
} errwalk;

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *data)
{
    (void)n;
    errwalk *w = data;
    if (w->found || !e->desc || !e->desc[0]) return 0;
    snprintf(w->buf, w->cap, "%s", e->desc);
    w->found = 1;
    return 0;
}

const char *ck_h5_errstr(char *buf, size_t cap)
{
    buf[0] = '\0';
    errwalk w = {buf, cap, 0};
    /* upward: from the innermost call, where the cause is named */
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, walk_cb, &w);
    H5Eclear2(H5E_DEFAULT);
    return buf;
}

hid_t ck_h5_type(mt_dtype dt)
{
    switch (dt) {
    case MT_DT_F32: return H5Tcopy(H5T_IEEE_F32LE);
    case MT_DT_BF16: {
        /* bfloat16: sign bit 15, exponent bits 7..14 (bias 127), mantissa 0..6 */
        hid_t t = H5Tcopy(H5T_IEEE_F32LE);
        if (t < 0) return t;
        if (H5Tset_fields(t, 15, 7, 8, 0, 7) < 0 || H5Tset_offset(t, 0) < 0 ||
            H5Tset_precision(t, 16) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 127) < 0) {
            H5Tclose(t);
            return -1;
        }
        return t;
    }
    case MT_DT_E4M3: return H5Tcopy(H5T_STD_U8LE); /* no HDF5 float fits E4M3FN (no infinities) */
    case MT_DT_I32: return H5Tcopy(H5T_STD_I32LE);
    case MT_DT_I64: return H5Tcopy(H5T_STD_I64LE);
    case MT_DT_U8: return H5Tcopy(H5T_STD_U8LE);
    default: return -1;
    }
}

void ck_shard_name(char *out, size_t cap, int rank) { snprintf(out, cap, "shard_%05d.h5", rank); }

/* Largest power of two <= x (x >= 1). */
static int64_t pow2_floor(int64_t x)
{
    int64_t p = 1;
    while (p * 2 <= x) p *= 2;
    return p;
}

int64_t ck_chunk_rows(int64_t rows, int64_t cols, size_t esize)
{
    int64_t rb = cols * (int64_t)esize;
    int64_t c = pow2_floor((int64_t)CK_CHUNK_BYTES / rb > 0 ? (int64_t)CK_CHUNK_BYTES / rb : 1);
    return c < rows ? c : rows;
}

int64_t ck_band_rows_within(int64_t rows, int64_t cols, size_t esize, size_t bytes)
{
    int64_t rb = cols * (int64_t)esize;
    int64_t b = pow2_floor((int64_t)bytes / rb > 0 ? (int64_t)bytes / rb : 1);
    if (b < 128) b = 128;
    return b < rows ? b : rows;
}

int64_t ck_band_rows(int64_t rows, int64_t cols, size_t esize)
{
    return ck_band_rows_within(rows, cols, esize, CK_BAND_BYTES);
}

/* HDF5's Fletcher32 (H5checksum.c), bit for bit: 16-bit big-endian words,
 * sums folded every 360 words, an odd last byte as the high byte. Within a
 * block of t words HDF5 adds in uint32 without folding, so
 *   s2 += t s1 + sum_i (t - i) w_i,  s1 += sum_i w_i   (mod 2^32)
 * gives the same values; block_sums computes the two sums of a block. */
typedef void (*block_fn)(const uint8_t *d, uint32_t t, uint32_t *a, uint32_t *b);

static void block_sums_c(const uint8_t *d, uint32_t t, uint32_t *pa, uint32_t *pb)
{
    uint32_t a = 0, b = 0;
    for (uint32_t i = 0; i < t; i++) {
        uint32_t w = ((uint32_t)d[2 * i] << 8) | (uint32_t)d[2 * i + 1];
        a += w;
        b += (t - i) * w;
    }
    *pa = a;
    *pb = b;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same sums 16 words at a time: bytes swapped to native words,
 * widened to uint32, weighted by (t - i); exact mod 2^32 like the loop. */
__attribute__((target("avx2"))) static void block_sums_avx2(const uint8_t *d, uint32_t t,
                                                             uint32_t *pa, uint32_t *pb)
{
    const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1,
                                          0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const __m256i step8 = _mm256_set1_epi32(8), step16 = _mm256_set1_epi32(16);
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    /* weights of words i .. i + 7: t - i - k */
    __m256i wlo = _mm256_sub_epi32(_mm256_set1_epi32((int)t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    uint32_t i = 0;
    for (; i + 16 <= t; i += 16) {
        __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(d + 2 * i)), swap);
        __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
        __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1));
        __m256i whi = _mm256_sub_epi32(wlo, step8);
        a = _mm256_add_epi32(a, _mm256_add_epi32(lo, hi));
        b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_mullo_epi32(lo, wlo), _mm256_mullo_epi32(hi, whi)));
        wlo = _mm256_sub_epi32(wlo, step16);
    }
    uint32_t la[8], lb[8];
    _mm256_storeu_si256((__m256i *)la, a);
    _mm256_storeu_si256((__m256i *)lb, b);
    uint32_t sa = 0, sb = 0;
    for (int k = 0; k < 8; k++) sa += la[k], sb += lb[k];
    for (; i < t; i++) {
        uint32_t w = ((uint32_t)d[2 * i] << 8) | (uint32_t)d[2 * i + 1];
        sa += w;
        sb += (t - i) * w;
    }
    *pa = sa;
    *pb = sb;
}
#endif

static block_fn pick_block(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && !getenv("MT_CKPT_NO_SIMD")) return block_sums_avx2;
#endif
    return block_sums_c;
}

uint32_t ck_fletcher32(const void *data, size_t n)
{
    static block_fn block;
    if (!block) block = pick_block(); /* idempotent: a race picks the same */
    const uint8_t *d = data;
    size_t len = n / 2;
    uint32_t s1 = 0, s2 = 0;
    while (len) {
        const uint32_t t = (uint32_t)(len > 360 ? 360 : len);
        uint32_t a, b;
        block(d, t, &a, &b);
        s2 += t * s1 + b;
        s1 += a;
        d += 2 * (size_t)t;
        len -= t;
        s1 = (s1 & 0xffff) + (s1 >> 16);
        s2 = (s2 & 0xffff) + (s2 >> 16);
    }
    if (n % 2) {
        s1 += (uint32_t)*d << 8;
        s2 += s1;
        s1 = (s1 & 0xffff) + (s1 >> 16);
        s2 = (s2 & 0xffff) + (s2 >> 16);
    }
    s1 = (s1 & 0xffff) + (s1 >> 16);
    s2 = (s2 & 0xffff) + (s2 >> 16);
    return (s2 << 16) | s1;
}

/* ---- strings and attributes --------------------------------------------------------- */

int ck_write_string(hid_t loc, const char *name, const char *text)
{
    size_t len = strlen(text);
    hid_t t = H5Tcopy(H5T_C_S1), sp = -1, dcpl = -1, ds = -1;
    int rc = MT_OK;
    hsize_t one = 1;
    if (t < 0 || H5Tset_size(t, len > 0 ? len : 1) < 0 || H5Tset_strpad(t, H5T_STR_NULLPAD) < 0) {
        rc = MT_ERR(MT_EHDF5, "%s: cannot make a string type", name);
        goto out;
    }
    sp = H5Screate_simple(1, &one, NULL);
    dcpl = H5Pcreate(H5P_DATASET_CREATE);
    if (sp < 0 || dcpl < 0 || H5Pset_chunk(dcpl, 1, &one) < 0 || H5Pset_fletcher32(dcpl) < 0) {
        rc = MT_ERR(MT_EHDF5, "%s: cannot set up the dataset", name);
        goto out;
    }
    ds = H5Dcreate2(loc, name, t, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    if (ds < 0 || H5Dwrite(ds, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, len ? text : "") < 0)
        rc = MT_ERR(MT_EHDF5, "%s: cannot write", name);
out:
    if (ds >= 0) H5Dclose(ds);
    if (dcpl >= 0) H5Pclose(dcpl);
    if (sp >= 0) H5Sclose(sp);
    if (t >= 0) H5Tclose(t);
    return rc;
}

int ck_read_string(hid_t loc, const char *name, char **out)
{
    *out = NULL;
    char eb[256];
    hid_t ds = H5Dopen2(loc, name, H5P_DEFAULT);
    if (ds < 0) return MT_ERR(MT_ECORRUPT, "%s: missing (%s)", name, ck_h5_errstr(eb, sizeof eb));
    hid_t t = H5Dget_type(ds);
    size_t len = t >= 0 ? H5Tget_size(t) : 0;
    char *buf = len ? calloc(len + 1, 1) : NULL;
    int rc = MT_OK;
    if (!buf || H5Tget_class(t) != H5T_STRING)
        rc = MT_ERR(MT_ECORRUPT, "%s: not a string", name);
    else if (H5Dread(ds, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0)
        rc = MT_ERR(MT_ECORRUPT, "%s: cannot read (%s)", name, ck_h5_errstr(eb, sizeof eb));
    if (t >= 0) H5Tclose(t);
    H5Dclose(ds);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    *out = buf;
    return MT_OK;
}

static int attr_write(hid_t obj, const char *name, hid_t type, hid_t sp, const void *v)
{
    hid_t a = H5Acreate2(obj, name, type, sp, H5P_DEFAULT, H5P_DEFAULT);
    int rc = a >= 0 && H5Awrite(a, type, v) >= 0 ? MT_OK
                                                : MT_ERR(MT_EHDF5, "attribute %s: cannot write", name);
    if (a >= 0) H5Aclose(a);
    return rc;
}

int ck_attr_i64(hid_t obj, const char *name, const int64_t *v, int n)
{
    hsize_t d = (hsize_t)n;
    hid_t sp = H5Screate_simple(1, &d, NULL);
    int rc = attr_write(obj, name, H5T_STD_I64LE, sp, v);
    H5Sclose(sp);
    return rc;
}

int ck_attr_u64(hid_t obj, const char *name, uint64_t v)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    int rc = attr_write(obj, name, H5T_STD_U64LE, sp, &v);
    H5Sclose(sp);
    return rc;
}

int ck_attr_str(hid_t obj, const char *name, const char *s)
{
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, strlen(s) > 0 ? strlen(s) : 1);
    H5Tset_strpad(t, H5T_STR_NULLPAD);
    hid_t sp = H5Screate(H5S_SCALAR);
    int rc = attr_write(obj, name, t, sp, strlen(s) ? s : "");
    H5Sclose(sp);
    H5Tclose(t);
    return rc;
}

int ck_attr_read_i64(hid_t obj, const char *name, int64_t *v, int n)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return MT_ERR(MT_ECORRUPT, "attribute %s missing", name);
    hid_t sp = H5Aget_space(a);
    hssize_t np = H5Sget_simple_extent_npoints(sp);
    int rc = np == n && H5Aread(a, H5T_NATIVE_INT64, v) >= 0
                 ? MT_OK
                 : MT_ERR(MT_ECORRUPT, "attribute %s: expected %d integers", name, n);
    H5Sclose(sp);
    H5Aclose(a);
    return rc;
}

int ck_attr_read_u64(hid_t obj, const char *name, uint64_t *v)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return MT_ERR(MT_ECORRUPT, "attribute %s missing", name);
    int rc = H5Aread(a, H5T_NATIVE_UINT64, v) >= 0
                 ? MT_OK
                 : MT_ERR(MT_ECORRUPT, "attribute %s: cannot read", name);
    H5Aclose(a);
    return rc;
}

int ck_attr_read_str(hid_t obj, const char *name, char *buf, size_t cap)
{
    hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
    if (a < 0) return MT_ERR(MT_ECORRUPT, "attribute %s missing", name);
    hid_t t = H5Aget_type(a);
    size_t len = H5Tget_size(t);
    int rc = MT_OK;
    if (H5Tget_class(t) != H5T_STRING || len + 1 > cap || H5Aread(a, t, buf) < 0)
        rc = MT_ERR(MT_ECORRUPT, "attribute %s: not a string of at most %zu bytes", name, cap - 1);
    else
        buf[len] = '\0';
    H5Tclose(t);
    H5Aclose(a);
    return rc;
}

/* ---- meta JSON -------------------------------------------------------------------- */

static char *dump(json_t *o)
{
    char *s = o ? json_dumps(o, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    json_decref(o);
    return s;
}

char *ck_layout_json(const mt_layout *l)
{
    return dump(json_pack("{s:i,s:i,s:i,s:i,s:i,s:i,s:b}", "tp", l->tp, "pp", l->pp, "vpp", l->vpp,
                          "ep", l->ep, "etp", l->etp, "dp", l->dp, "dualpipev", l->schedule == MT_PP_DUALPIPEV));
}

int ck_layout_from_json(const char *text, mt_layout *l)
{
    json_error_t e;
    json_t *o = json_loads(text, 0, &e);
    mt_layout_default(l);
    int dual = 0;
    int rc = o && json_unpack_ex(o, &e, 0, "{s:i,s:i,s:i,s:i,s:i,s:i,s?b}", "tp", &l->tp, "pp",
                                 &l->pp, "vpp", &l->vpp, "ep", &l->ep, "etp", &l->etp, "dp", &l->dp,
                                 "dualpipev", &dual) == 0
                 ? MT_OK
                 : MT_ERR(MT_ECORRUPT, "layout: %s", e.text);
    if (dual) l->schedule = MT_PP_DUALPIPEV;
    json_decref(o);
    return rc;
}

char *ck_opts_json(const mt_shard_opts *o)
{
    json_t *j = json_pack("{s:b,s:s,s:b}", "fp8", o->fp8, "weights", mt_dtype_name(o->act_dtype),
                          "optimizer", o->optimizer);
    if (j && o->optimizer && o->has_main)
        json_object_set_new(j, "main", json_string(mt_dtype_name(o->main_dtype)));
    return dump(j);
}

int ck_opts_from_json(const char *text, mt_shard_opts *o)
{
    json_error_t e;
    json_t *j = json_loads(text, 0, &e);
    memset(o, 0, sizeof *o);
    const char *w = NULL, *mn = NULL;
    int rc = j && json_unpack_ex(j, &e, 0, "{s:b,s:s,s:b,s?s}", "fp8", &o->fp8, "weights", &w,
                                 "optimizer", &o->optimizer, "main", &mn) == 0
                 ? MT_OK
                 : MT_ERR(MT_ECORRUPT, "contents: %s", e.text);
    if (rc == MT_OK) {
        int wd = mt_dtype_parse(w);
        o->act_dtype = wd >= 0 ? (mt_dtype)wd : MT_DT_BF16;
        if (wd < 0) rc = MT_ERR(MT_ECORRUPT, "contents: unknown weights dtype %s", w);
        if (mn) {
            int md = mt_dtype_parse(mn);
            o->has_main = 1;
            o->main_dtype = md >= 0 ? (mt_dtype)md : MT_DT_F32;
            if (md < 0) rc = MT_ERR(MT_ECORRUPT, "contents: unknown main dtype %s", mn);
        }
    }
    json_decref(j);
    return rc;
}

int ck_meta_config(const mt_ckpt_meta *m, mt_model_config *c)
{
    json_error_t e;
    json_t *o = json_loads(m->config_json ? m->config_json : "", 0, &e);
    if (!o) return MT_ERR(MT_ECORRUPT, "model config: %s", e.text);
    int rc = mt_config_from_json(c, o, "model", 0);
    json_decref(o);
    return rc;
}

void mt_ckpt_meta_free(mt_ckpt_meta *m)
{
    free(m->config_json);
    free(m->job_json);
    free(m->state_json);
    m->config_json = m->job_json = m->state_json = NULL;
}

static char *dupstr(const char *s) { return s ? strdup(s) : NULL; }

int mt_ckpt_meta_copy(mt_ckpt_meta *dst, const mt_ckpt_meta *src)
{
    *dst = *src;
    dst->config_json = dupstr(src->config_json);
    dst->job_json = dupstr(src->job_json);
    dst->state_json = dupstr(src->state_json);
    if ((src->config_json && !dst->config_json) || (src->job_json && !dst->job_json) ||
        (src->state_json && !dst->state_json)) {
        mt_ckpt_meta_free(dst);
        return MT_ERR(MT_ENOMEM, "checkpoint meta: out of memory");
    }
    return MT_OK;
}

/* ---- coverage ---------------------------------------------------------------------- */

static int cmp_piece(const void *a, const void *b)
{
    const mt_ckpt_piece_rec *x = *(const mt_ckpt_piece_rec *const *)a;
    const mt_ckpt_piece_rec *y = *(const mt_ckpt_piece_rec *const *)b;
    for (int k = 0; k < 2; k++)
        if (x->off[k] != y->off[k]) return x->off[k] < y->off[k] ? -1 : 1;
    return 0;
}

int ck_check_tiling(int ndim, const int64_t shape[2], const mt_ckpt_piece_rec *const *p, int n,
                    char *msg, size_t cap)
{
    const int64_t S0 = shape[0], S1 = ndim == 1 ? 1 : shape[1];
    int64_t vol = 0;
    for (int i = 0; i < n; i++) {
        const int64_t *o = p[i]->off, *c = p[i]->count;
        int64_t c1 = ndim == 1 ? 1 : c[1], o1 = ndim == 1 ? 0 : o[1];
        if (o[0] < 0 || o1 < 0 || c[0] <= 0 || c1 <= 0 || o[0] + c[0] > S0 || o1 + c1 > S1) {
            snprintf(msg, cap,
                     "piece [%lld:%lld, %lld:%lld] of rank %d lies outside the shape [%lld, %lld]",
                     (long long)o[0], (long long)(o[0] + c[0]), (long long)o1, (long long)(o1 + c1),
                     p[i]->rank, (long long)S0, (long long)S1);
            return 1;
        }
        vol += c[0] * c1;
    }
    const mt_ckpt_piece_rec **s = malloc((size_t)(n > 0 ? n : 1) * sizeof *s);
    if (!s) {
        snprintf(msg, cap, "out of memory");
        return 1;
    }
    memcpy(s, p, (size_t)n * sizeof *s);
    qsort(s, (size_t)n, sizeof *s, cmp_piece);
    int bad = 0;
    for (int i = 0; i < n && !bad; i++) {
        const mt_ckpt_piece_rec *a = s[i];
        for (int j = i + 1; j < n && s[j]->off[0] < a->off[0] + a->count[0]; j++) {
            const mt_ckpt_piece_rec *b = s[j];
            int64_t a1 = ndim == 1 ? 0 : a->off[1], b1 = ndim == 1 ? 0 : b->off[1];
            int64_t ac = ndim == 1 ? 1 : a->count[1], bc = ndim == 1 ? 1 : b->count[1];
            if (b1 < a1 + ac && a1 < b1 + bc) {
                snprintf(msg, cap,
                         "pieces of ranks %d [%lld:%lld, %lld:%lld] and %d [%lld:%lld, %lld:%lld] "
                         "overlap",
                         a->rank, (long long)a->off[0], (long long)(a->off[0] + a->count[0]),
                         (long long)a1, (long long)(a1 + ac), b->rank, (long long)b->off[0],
                         (long long)(b->off[0] + b->count[0]), (long long)b1,
                         (long long)(b1 + bc));
                bad = 1;
                break;
            }
        }
    }
    free(s);
    if (bad) return 1;
    if (vol != S0 * S1) {
        snprintf(msg, cap, "pieces cover %lld of %lld elements: a gap", (long long)vol,
                 (long long)(S0 * S1));
        return 1;
    }
    return 0;
}

/* ---- conversions -------------------------------------------------------------------- */

void ck_convert(void *dst, mt_dtype dd, const void *src, mt_dtype ds, int64_t n)
{
    if (dd == ds) {
        memcpy(dst, src, (size_t)n * mt_dtype_size(dd));
        return;
    }
    if (dd == MT_DT_F32 && ds == MT_DT_BF16) {
        float *o = dst;
        const uint16_t *i = src;
        for (int64_t k = 0; k < n; k++) o[k] = mt_bf16_to_f32(i[k]);
    } else if (dd == MT_DT_BF16 && ds == MT_DT_F32) {
        uint16_t *o = dst;
        const float *i = src;
        for (int64_t k = 0; k < n; k++) o[k] = mt_bf16_from_f32(i[k]);
    }
}
