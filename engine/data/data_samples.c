/* data_samples.c - GPT sample windows over shuffled document streams. */
#include "engine/data/data_samples.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_rng.h"
#include "base/mt_status.h"

/* Per-epoch index entries (order and offsets) allowed: 2^28 each, 2 GiB. */
#define SAMPLES_MAX_ENTRIES (1ll << 28)
#define FEISTEL_ROUNDS 6

struct mt_samples {
    const mt_indexed *ds;
    int split;
    int64_t seq_len;
    int64_t count;        /* samples */
    int64_t epochs;       /* E */
    int64_t doc0, doc1;   /* split documents [doc0, doc1) */
    int64_t ndocs;        /* doc1 - doc0 */
    int64_t epoch_tokens; /* T: stream tokens per epoch */
    int32_t eod;
    int64_t *order;  /* [E][ndocs] dataset document ids in stream order */
    int64_t *offset; /* [E][ndocs + 1] stream offset of each position in its epoch */
    int half_bits;   /* Feistel half width h; domain [0, 2^(2h)) */
    uint64_t keys[FEISTEL_ROUNDS];
};

const char *mt_split_name(int split)
{
    static const char *const names[MT_SPLIT_COUNT] = {"train", "valid", "test"};
    _Static_assert(sizeof names / sizeof names[0] == MT_SPLIT_COUNT, "split names");
    return split >= 0 && split < MT_SPLIT_COUNT ? names[split] : "unknown";
}

/* Python's round(): half to even, as Megatron's int(round(w * n)). */
static int64_t round_half_even(double x)
{
    double f = floor(x), r = x - f;
    int64_t i = (int64_t)f;
    if (r > 0.5 || (r == 0.5 && (i & 1))) i++;
    return i;
}

static int split_parse(const char *ratios, double w[MT_SPLIT_COUNT])
{
    for (int k = 0; k < MT_SPLIT_COUNT; k++) w[k] = 0.0;
    const char *p = ratios;
    int n = 0;
    for (;;) {
        char *end;
        double v = strtod(p, &end);
        if (end == p)
            return MT_ERR(MT_EINVAL, "split \"%s\": expected a number at \"%s\"", ratios, p);
        if (!(v >= 0.0) || isinf(v))
            return MT_ERR(MT_EINVAL, "split \"%s\": weight %g must be finite and >= 0", ratios, v);
        if (n == MT_SPLIT_COUNT)
            return MT_ERR(MT_EINVAL, "split \"%s\": more than 3 weights (train,valid,test)",
                          ratios);
        w[n++] = v;
        while (*end == ' ') end++;
        if (*end == '\0') break;
        if (*end != ',' && *end != '/')
            return MT_ERR(MT_EINVAL, "split \"%s\": unexpected '%c'; use \"98,1,1\"", ratios,
                          *end);
        p = end + 1;
    }
    double sum = w[0] + w[1] + w[2];
    if (!(sum > 0.0)) return MT_ERR(MT_EINVAL, "split \"%s\": the weights sum to 0", ratios);
    for (int k = 0; k < MT_SPLIT_COUNT; k++) w[k] /= sum;
    return MT_OK;
}

int mt_split_bounds(const char *ratios, int64_t num_docs, int64_t bounds[4])
{
    double w[MT_SPLIT_COUNT];
    if (!ratios) ratios = "1,0,0";
    if (num_docs < 0) return MT_ERR(MT_EINVAL, "split: negative document count %lld",
                                    (long long)num_docs);
    MT_CHECK(split_parse(ratios, w));
    bounds[0] = 0;
    for (int k = 0; k < MT_SPLIT_COUNT; k++)
        bounds[k + 1] = bounds[k] + round_half_even(w[k] * (double)num_docs);
    int64_t diff = bounds[3] - num_docs;
    for (int k = 1; k <= MT_SPLIT_COUNT; k++) bounds[k] -= diff;
    /* Megatron can leave a boundary below its predecessor; clamp to keep the
     * ranges ordered and inside [0, num_docs]. */
    for (int k = 1; k <= MT_SPLIT_COUNT; k++) {
        if (bounds[k] < bounds[k - 1]) bounds[k] = bounds[k - 1];
        if (bounds[k] > num_docs) bounds[k] = num_docs;
    }
    bounds[3] = num_docs;
    return MT_OK;
}

/* ---- the sample permutation: a keyed Feistel bijection with cycle walking --- */

static void feistel_init(mt_samples *s, uint64_t seed)
{
    int bits = 0;
    while (bits < 62 && (1ll << bits) < s->count) bits++;
    s->half_bits = bits < 2 ? 1 : (bits + 1) / 2;
    uint64_t base = mt_hash_u64(seed, 0x53414d50ull + (uint64_t)s->split); /* "SAMP" */
    for (int r = 0; r < FEISTEL_ROUNDS; r++) s->keys[r] = mt_hash_u64(base, (uint64_t)r);
}

static uint64_t feistel_encrypt(const mt_samples *s, uint64_t x)
{
    int h = s->half_bits;
    uint64_t mask = (1ull << h) - 1;
    uint64_t l = x >> h, r = x & mask;
    for (int k = 0; k < FEISTEL_ROUNDS; k++) {
        uint64_t t = l ^ (mt_hash_u64(s->keys[k], r) & mask);
        l = r;
        r = t;
    }
    return (l << h) | r;
}

int64_t mt_samples_window_of(const mt_samples *s, int64_t idx)
{
    if (idx < 0 || idx >= s->count)
        return MT_ERR(MT_EINVAL, "samples: index %lld out of range [0, %lld)", (long long)idx,
                      (long long)s->count);
    /* The cycle through idx stays in [0, 4 * count), so this ends after about
     * four steps on average. */
    uint64_t y = feistel_encrypt(s, (uint64_t)idx);
    while (y >= (uint64_t)s->count) y = feistel_encrypt(s, y);
    return (int64_t)y;
}

/* ---- building ---------------------------------------------------------------- */

static int samples_check_config(const mt_indexed *ds, const mt_samples_config *cfg)
{
    const char *prefix = mt_indexed_prefix(ds);
    if (cfg->split < 0 || cfg->split >= MT_SPLIT_COUNT)
        return MT_ERR(MT_EINVAL, "samples %s: split %d is not train (0), valid (1) or test (2)",
                      prefix, cfg->split);
    if (cfg->seq_len < 1)
        return MT_ERR(MT_EINVAL, "samples %s: seq_len %lld must be >= 1", prefix,
                      (long long)cfg->seq_len);
    if (cfg->num_samples < 0)
        return MT_ERR(MT_EINVAL, "samples %s: num_samples %lld must be >= 0", prefix,
                      (long long)cfg->num_samples);
    if (cfg->eod_token < 0)
        return MT_ERR(MT_EINVAL, "samples %s: EOD token %d must be >= 0", prefix,
                      (int)cfg->eod_token);
    return MT_OK;
}

/* Stream length of each split document: its tokens plus an EOD unless it is
 * empty or already ends with EOD. len[ndocs]. */
static int samples_doc_lengths(const mt_samples *s, int64_t *len, int64_t *total)
{
    *total = 0;
    for (int64_t k = 0; k < s->ndocs; k++) {
        int64_t t0 = 0, n = 0;
        MT_CHECK(mt_indexed_document_span(s->ds, s->doc0 + k, &t0, &n));
        if (n > 0) {
            int32_t last;
            MT_CHECK(mt_indexed_read(s->ds, t0 + n - 1, 1, &last));
            if (last != s->eod) n++;
        }
        len[k] = n;
        *total += n;
    }
    return MT_OK;
}

/* Picks the epoch count and the sample count. */
static int samples_size(mt_samples *s, int64_t requested)
{
    const char *prefix = mt_indexed_prefix(s->ds);
    int64_t T = s->epoch_tokens, L = s->seq_len;
    if (requested == 0) {
        s->epochs = 1;
        s->count = (T - 1) / L;
        if (s->count == 0)
            return MT_ERR(MT_EINVAL, "samples %s: split %s has %lld tokens, fewer than the %lld "
                          "a sample of seq_len %lld needs", prefix, mt_split_name(s->split),
                          (long long)T, (long long)(L + 1), (long long)L);
        return MT_OK;
    }
    if (requested > (INT64_MAX - 1) / L)
        return MT_ERR(MT_EINVAL, "samples %s: %lld samples of seq_len %lld overflow a 64-bit "
                      "token count", prefix, (long long)requested, (long long)L);
    int64_t need = requested * L + 1; /* stream tokens the last window ends at */
    s->epochs = need / T + (need % T != 0);
    s->count = requested;
    if (s->epochs > SAMPLES_MAX_ENTRIES / (s->ndocs + 1))
        return MT_ERR(MT_EINVAL, "samples %s: %lld samples of seq_len %lld need %lld epochs over "
                      "the %lld documents (%lld tokens) of split %s: too many index entries "
                      "(limit %lld)", prefix, (long long)requested, (long long)L,
                      (long long)s->epochs, (long long)s->ndocs, (long long)T,
                      mt_split_name(s->split), (long long)SAMPLES_MAX_ENTRIES);
    return MT_OK;
}

static void samples_build_epochs(mt_samples *s, const int64_t *len, uint64_t seed)
{
    uint64_t base = mt_hash_u64(seed, 0x444f4353ull + (uint64_t)s->split); /* "DOCS" */
    for (int64_t e = 0; e < s->epochs; e++) {
        int64_t *ord = s->order + e * s->ndocs;
        int64_t *off = s->offset + e * (s->ndocs + 1);
        for (int64_t k = 0; k < s->ndocs; k++) ord[k] = s->doc0 + k;
        mt_rng rng;
        mt_rng_seed(&rng, mt_hash_u64(base, (uint64_t)e));
        mt_rng_shuffle_i64(&rng, ord, s->ndocs);
        off[0] = 0;
        for (int64_t k = 0; k < s->ndocs; k++) off[k + 1] = off[k] + len[ord[k] - s->doc0];
    }
}

int mt_samples_open(const mt_indexed *ds, const mt_samples_config *cfg, mt_samples **out)
{
    *out = NULL;
    MT_CHECK(samples_check_config(ds, cfg));
    int64_t bounds[4];
    MT_CHECK(mt_split_bounds(cfg->split_ratios, mt_indexed_num_documents(ds), bounds));
    const char *prefix = mt_indexed_prefix(ds);
    const char *ratios = cfg->split_ratios ? cfg->split_ratios : "1,0,0";
    mt_samples *s = calloc(1, sizeof *s);
    if (!s) return MT_ERR(MT_ENOMEM, "samples %s: out of memory", prefix);
    s->ds = ds;
    s->split = cfg->split;
    s->seq_len = cfg->seq_len;
    s->eod = cfg->eod_token;
    s->doc0 = bounds[cfg->split];
    s->doc1 = bounds[cfg->split + 1];
    s->ndocs = s->doc1 - s->doc0;
    int rc = MT_OK;
    int64_t *len = NULL;
    if (s->ndocs == 0) {
        rc = MT_ERR(MT_EINVAL, "samples %s: split %s has no documents (ratios \"%s\" over %lld "
                    "documents)", prefix, mt_split_name(s->split), ratios,
                    (long long)mt_indexed_num_documents(ds));
        goto fail;
    }
    len = malloc((size_t)s->ndocs * sizeof *len);
    if (!len) {
        rc = MT_ERR(MT_ENOMEM, "samples %s: out of memory for %lld documents", prefix,
                    (long long)s->ndocs);
        goto fail;
    }
    MT_GOTO(samples_doc_lengths(s, len, &s->epoch_tokens), fail);
    if (s->epoch_tokens == 0) {
        rc = MT_ERR(MT_EINVAL, "samples %s: split %s (documents [%lld, %lld)) has no tokens",
                    prefix, mt_split_name(s->split), (long long)s->doc0, (long long)s->doc1);
        goto fail;
    }
    MT_GOTO(samples_size(s, cfg->num_samples), fail);
    s->order = malloc((size_t)(s->epochs * s->ndocs) * sizeof *s->order);
    s->offset = malloc((size_t)(s->epochs * (s->ndocs + 1)) * sizeof *s->offset);
    if (!s->order || !s->offset) {
        rc = MT_ERR(MT_ENOMEM, "samples %s: out of memory for %lld epochs of %lld documents",
                    prefix, (long long)s->epochs, (long long)s->ndocs);
        goto fail;
    }
    samples_build_epochs(s, len, cfg->seed);
    feistel_init(s, cfg->seed);
    free(len);
    *out = s;
    return MT_OK;
fail:
    free(len);
    mt_samples_close(s);
    return rc;
}

void mt_samples_close(mt_samples *s)
{
    if (!s) return;
    free(s->order);
    free(s->offset);
    free(s);
}

int64_t mt_samples_count(const mt_samples *s) { return s->count; }
int64_t mt_samples_seq_len(const mt_samples *s) { return s->seq_len; }
int64_t mt_samples_epochs(const mt_samples *s) { return s->epochs; }
int64_t mt_samples_epoch_tokens(const mt_samples *s) { return s->epoch_tokens; }

void mt_samples_documents(const mt_samples *s, int64_t *doc_begin, int64_t *doc_end)
{
    *doc_begin = s->doc0;
    *doc_end = s->doc1;
}

int64_t mt_samples_epoch_document(const mt_samples *s, int64_t e, int64_t k)
{
    if (e < 0 || e >= s->epochs || k < 0 || k >= s->ndocs)
        return MT_ERR(MT_EINVAL, "samples: epoch %lld position %lld out of range (%lld epochs of "
                      "%lld documents)", (long long)e, (long long)k, (long long)s->epochs,
                      (long long)s->ndocs);
    return s->order[e * s->ndocs + k];
}

/* Last position k of an epoch with off[k] <= q: the document holding stream
 * token q (documents of stream length 0 are skipped). off[ndocs + 1]. */
static int64_t epoch_find(const int64_t *off, int64_t ndocs, int64_t q)
{
    int64_t lo = 0, hi = ndocs; /* off[lo] <= q < off[hi] */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (off[mid] <= q) lo = mid;
        else hi = mid;
    }
    return lo;
}

int mt_samples_window(const mt_samples *s, int64_t j, int32_t *out)
{
    if (j < 0 || j >= s->count)
        return MT_ERR(MT_EINVAL, "samples: window %lld out of range [0, %lld)", (long long)j,
                      (long long)s->count);
    int64_t p = j * s->seq_len, need = s->seq_len + 1, got = 0;
    int64_t e = p / s->epoch_tokens;
    const int64_t *off = s->offset + e * (s->ndocs + 1);
    int64_t k = epoch_find(off, s->ndocs, p % s->epoch_tokens);
    int64_t within = p % s->epoch_tokens - off[k]; /* position inside document k's stream */
    while (got < need) {
        if (k == s->ndocs) {
            if (++e >= s->epochs)
                return MT_ERR(MT_ESTATE, "samples: window %lld runs past epoch %lld",
                              (long long)j, (long long)s->epochs);
            off = s->offset + e * (s->ndocs + 1);
            k = 0;
            within = 0;
            continue;
        }
        int64_t slen = off[k + 1] - off[k];
        int64_t t0 = 0, n = 0;
        MT_CHECK(mt_indexed_document_span(s->ds, s->order[e * s->ndocs + k], &t0, &n));
        if (within < n) {
            int64_t m = n - within < need - got ? n - within : need - got;
            MT_CHECK(mt_indexed_read(s->ds, t0 + within, m, out + got));
            got += m;
            within += m;
        }
        if (got < need && within < slen) { /* the EOD the stream adds */
            out[got++] = s->eod;
            within++;
        }
        if (within >= slen) {
            k++;
            within = 0;
        }
    }
    return MT_OK;
}

int mt_samples_get(const mt_samples *s, int64_t idx, int32_t *out)
{
    int64_t j = mt_samples_window_of(s, idx);
    if (j < 0) return (int)j;
    return mt_samples_window(s, j, out);
}
