/* data_synth.c - moetrain-data synth: a corpus from a random sparse order-2
 * Markov source whose entropy rate is known exactly, so a trained model's loss
 * can be compared with the best achievable one.
 *
 * Source over tokens 0..V-1, EOD = V-1, context (a, b) = the two previous
 * tokens:
 *   P(c | a, b) = p_eod [c = EOD] + (1 - p_eod) q_ab(c),  p_eod = 1 / L,
 * where q_ab puts normalised exp(N(0,1)) weights on K distinct non-EOD tokens
 * drawn at random per context, and every context (a, EOD) uses one shared q,
 * so a document (the tokens after an EOD up to and including the next one)
 * does not depend on the document before it: shuffling documents keeps the
 * statistics. The stream starts in context (EOD, EOD). Document lengths are
 * geometric with mean L.
 *
 * Entropy rate H = sum over contexts of pi(a, b) H(P(. | a, b)), pi the
 * stationary distribution over the V*V contexts, found by power iteration.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/data/data_indexed.h"
#include "engine/data/data_tool.h"
#include "base/mt_rng.h"
#include "base/mt_status.h"

/* The whole source is held in memory: V*V*K successor entries at most. */
#define SYNTH_MAX_ENTRIES (1ll << 25)
/* Power iteration stops when the L1 change of pi falls below this. */
#define SYNTH_TOL 1e-13
/* Longer runs report progress on stderr. */
#define SYNTH_PROGRESS_TOKENS 10000000ll

static const char synth_usage[] =
    "usage: moetrain-data synth --output PREFIX --vocab V --tokens N --seed S\n"
    "                           [--branching K] [--mean-doc-len L]\n"
    "\n"
    "Generates PREFIX.bin/.idx from a random sparse order-2 Markov source with\n"
    "EOD = V-1 part of the chain: P(next | a, b) = p_eod [next = EOD]\n"
    "+ (1 - p_eod) q_ab(next), q_ab spread over K random non-EOD tokens with\n"
    "normalised exp(N(0,1)) weights, p_eod = 1/L, all contexts (a, EOD) sharing\n"
    "one distribution. Documents are the pieces of the stream ending in EOD; the\n"
    "last document runs to its EOD, so the corpus holds at least N tokens.\n"
    "PREFIX.json records the parameters, the exact conditional entropy rate\n"
    "(nats/token; the loss floor of a perfect model) and empirical estimates.\n"
    "\n"
    "  --output PREFIX     output path without .bin/.idx/.json\n"
    "  --vocab V           tokens 0..V-1 including EOD; V >= 3\n"
    "  --tokens N          tokens to generate, >= 1\n"
    "  --seed S            unsigned 64-bit seed; same seed, same corpus\n"
    "  --branching K       successors per context, 1 <= K <= V-1 (default min(8, V-1))\n"
    "  --mean-doc-len L    mean document length in tokens, EOD included, > 1\n"
    "                      (default 128)\n"
    "V*V*K may not exceed 33554432 (the source is held in memory).\n";

typedef struct synth_params {
    int64_t vocab;     /* V */
    int64_t branching; /* K */
    int64_t tokens;    /* N requested */
    uint64_t seed;
    double mean_doc_len; /* L */
} synth_params;

typedef struct synth_source {
    int64_t V, K;
    int64_t eod;  /* V - 1 */
    double p_eod; /* 1 / L */
    uint16_t *tok; /* [V*V][K] successors of each context's sparse part */
    double *cum;   /* [V*V][K] cumulative probabilities of the sparse part */
    double *h;     /* [V*V] entropy of P(. | context), nats */
} synth_source;

typedef struct synth_stats {
    int64_t tokens, documents;
    double entropy;   /* exact rate, nats/token */
    int64_t iterations;
    double residual;  /* last L1 change of pi */
    double empirical; /* plug-in H(next | a, b) of the sample, nats */
    double nll;       /* mean -log P(token) of the sample under the source */
} synth_stats;

/* The table row of context (a, b): all (a, EOD) share the row of (EOD, EOD). */
static int64_t ctx_row(const synth_source *s, int64_t a, int64_t b)
{
    return b == s->eod ? s->eod * s->V + s->eod : a * s->V + b;
}

static double rng_normal(mt_rng *r)
{
    double u1 = 1.0 - mt_rng_uniform(r), u2 = mt_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

static void source_free(synth_source *s)
{
    free(s->tok);
    free(s->cum);
    free(s->h);
}

/* Draws row ctx: K distinct successors from [0, V-1) by Floyd's algorithm
 * (stamp[V-1] marks the ones taken for this row) and their weights. */
static void source_row(synth_source *s, mt_rng *rng, int64_t ctx, int64_t *stamp, double *w)
{
    int64_t n = s->V - 1, K = s->K, c = 0;
    uint16_t *t = s->tok + ctx * K;
    double *cum = s->cum + ctx * K;
    for (int64_t j = n - K; j < n; j++) {
        int64_t x = (int64_t)mt_rng_below(rng, (uint64_t)j + 1);
        if (stamp[x] == ctx) x = j;
        stamp[x] = ctx;
        t[c++] = (uint16_t)x;
    }
    double sum = 0.0, acc = 0.0, hq = 0.0;
    for (int64_t j = 0; j < K; j++) {
        w[j] = exp(rng_normal(rng));
        sum += w[j];
    }
    for (int64_t j = 0; j < K; j++) {
        double q = w[j] / sum;
        acc += q;
        cum[j] = acc;
        hq -= q * log(q);
    }
    cum[K - 1] = 1.0;
    double p = s->p_eod;
    /* -p log p - sum_j (1-p) q_j log((1-p) q_j) */
    s->h[ctx] = -p * log(p) - (1.0 - p) * log(1.0 - p) + (1.0 - p) * hq;
}

static int source_build(synth_source *s, const synth_params *prm)
{
    int64_t V = prm->vocab, K = prm->branching;
    memset(s, 0, sizeof *s);
    s->V = V;
    s->K = K;
    s->eod = V - 1;
    s->p_eod = 1.0 / prm->mean_doc_len;
    s->tok = malloc((size_t)(V * V * K) * sizeof *s->tok);
    s->cum = malloc((size_t)(V * V * K) * sizeof *s->cum);
    s->h = calloc((size_t)(V * V), sizeof *s->h);
    int64_t *stamp = malloc((size_t)V * sizeof *stamp);
    double *w = malloc((size_t)K * sizeof *w);
    if (!s->tok || !s->cum || !s->h || !stamp || !w) {
        free(stamp);
        free(w);
        source_free(s);
        return MT_ERR(MT_ENOMEM, "synth: out of memory for a source of %lld x %lld contexts, "
                      "%lld successors each", (long long)V, (long long)V, (long long)K);
    }
    for (int64_t k = 0; k < V; k++) stamp[k] = -1;
    mt_rng rng;
    mt_rng_seed(&rng, mt_hash_u64(prm->seed, 1));
    for (int64_t a = 0; a < V; a++)
        for (int64_t b = 0; b < V; b++)
            if (ctx_row(s, a, b) == a * V + b) source_row(s, &rng, a * V + b, stamp, w);
    free(stamp);
    free(w);
    return MT_OK;
}

/* One step pi -> nx = pi P over contexts: (a, b) -> (b, c). Returns the L1
 * change after renormalising nx. */
static double stationary_step(const synth_source *s, const double *pi, double *nx)
{
    int64_t V = s->V, K = s->K, S = V * V;
    double p = s->p_eod;
    memset(nx, 0, (size_t)S * sizeof *nx);
    for (int64_t a = 0; a < V; a++) {
        for (int64_t b = 0; b < V; b++) {
            double m = pi[a * V + b];
            if (m == 0.0) continue;
            int64_t row = ctx_row(s, a, b);
            const uint16_t *t = s->tok + row * K;
            const double *cum = s->cum + row * K;
            double *dst = nx + b * V, mr = m * (1.0 - p), prev = 0.0;
            dst[s->eod] += m * p;
            for (int64_t j = 0; j < K; j++) {
                dst[t[j]] += mr * (cum[j] - prev);
                prev = cum[j];
            }
        }
    }
    double sum = 0.0, diff = 0.0;
    for (int64_t k = 0; k < S; k++) sum += nx[k];
    for (int64_t k = 0; k < S; k++) {
        nx[k] /= sum;
        diff += fabs(nx[k] - pi[k]);
    }
    return diff;
}

/* The chain forgets its start at rate (1 - p_eod) per step at worst (an EOD
 * followed by the shared row couples any two copies), so about
 * 31 L steps reach SYNTH_TOL; the cap leaves a wide margin. */
static int source_entropy(const synth_source *s, double mean_doc_len, synth_stats *st)
{
    int64_t V = s->V, S = V * V;
    int64_t max_iter = (int64_t)(100.0 * mean_doc_len) + 1000;
    double *pi = malloc((size_t)S * sizeof *pi), *nx = malloc((size_t)S * sizeof *nx);
    if (!pi || !nx) {
        free(pi);
        free(nx);
        return MT_ERR(MT_ENOMEM, "synth: out of memory for %lld context states", (long long)S);
    }
    for (int64_t k = 0; k < S; k++) pi[k] = 1.0 / (double)S;
    int verbose = (double)S * (double)(s->K + 1) * mean_doc_len > 2e10;
    clock_t last = clock();
    double diff = INFINITY;
    int64_t it = 0;
    while (diff >= SYNTH_TOL && it < max_iter) {
        diff = stationary_step(s, pi, nx);
        double *t = pi;
        pi = nx;
        nx = t;
        it++;
        if (verbose && clock() - last > 5 * CLOCKS_PER_SEC) {
            fprintf(stderr, "synth: stationary distribution: iteration %lld, L1 change %.3g\n",
                    (long long)it, diff);
            last = clock();
        }
    }
    double H = 0.0;
    for (int64_t a = 0; a < V; a++)
        for (int64_t b = 0; b < V; b++) H += pi[a * V + b] * s->h[ctx_row(s, a, b)];
    free(pi);
    free(nx);
    if (diff >= SYNTH_TOL)
        return MT_ERR(MT_ENUMERIC, "synth: stationary distribution did not converge in %lld "
                      "iterations (L1 change %.3g)", (long long)it, diff);
    st->entropy = H;
    st->iterations = it;
    st->residual = diff;
    return MT_OK;
}

/* Draws the next token in context (a, b); *slot is its successor index, K for
 * EOD, and *prob its probability. */
static int64_t source_draw(const synth_source *s, mt_rng *rng, int64_t a, int64_t b,
                           int64_t *slot, double *prob)
{
    if (mt_rng_uniform(rng) < s->p_eod) {
        *slot = s->K;
        *prob = s->p_eod;
        return s->eod;
    }
    int64_t row = ctx_row(s, a, b);
    const double *cum = s->cum + row * s->K;
    double u = mt_rng_uniform(rng);
    int64_t lo = 0, hi = s->K - 1; /* first j with cum[j] > u; cum[K-1] = 1 > u */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (cum[mid] > u) hi = mid;
        else lo = mid + 1;
    }
    *slot = lo;
    *prob = (1.0 - s->p_eod) * (cum[lo] - (lo ? cum[lo - 1] : 0.0));
    return s->tok[row * s->K + lo];
}

/* Plug-in H(next | a, b) from counts[V*V][K+1]. */
static double empirical_entropy(const synth_source *s, const uint64_t *counts, int64_t total)
{
    int64_t rows = s->V * s->V, W = s->K + 1;
    double H = 0.0;
    for (int64_t r = 0; r < rows; r++) {
        const uint64_t *c = counts + r * W;
        uint64_t n = 0;
        for (int64_t j = 0; j < W; j++) n += c[j];
        for (int64_t j = 0; j < W; j++)
            if (c[j]) H -= (double)c[j] * log((double)c[j] / (double)n);
    }
    return H / (double)total;
}

typedef struct doc_buf {
    int32_t *p; /* [cap] */
    int64_t n, cap;
} doc_buf;

static int doc_push(doc_buf *d, int32_t t)
{
    if (d->n == d->cap) {
        int64_t cap = d->cap ? 2 * d->cap : 1024;
        int32_t *q = realloc(d->p, (size_t)cap * sizeof *q);
        if (!q) return MT_ERR(MT_ENOMEM, "synth: out of memory for a document of %lld tokens",
                              (long long)d->n);
        d->p = q;
        d->cap = cap;
    }
    d->p[d->n++] = t;
    return MT_OK;
}

static int synth_generate(const synth_source *s, const synth_params *prm, mt_indexed_writer *w,
                          synth_stats *st)
{
    int64_t W = s->K + 1;
    uint64_t *counts = calloc((size_t)(s->V * s->V * W), sizeof *counts);
    if (!counts) return MT_ERR(MT_ENOMEM, "synth: out of memory for the context counts");
    mt_rng rng;
    mt_rng_seed(&rng, mt_hash_u64(prm->seed, 2));
    doc_buf doc = {0};
    int64_t a = s->eod, b = s->eod, total = 0, next_report = prm->tokens / 10;
    int progress = prm->tokens > SYNTH_PROGRESS_TOKENS;
    double nll = 0.0;
    int rc = MT_OK;
    for (;;) {
        int64_t slot;
        double prob;
        int64_t c = source_draw(s, &rng, a, b, &slot, &prob);
        counts[(a * s->V + b) * W + slot]++;
        nll -= log(prob);
        total++;
        if ((rc = doc_push(&doc, (int32_t)c)) < 0) break;
        a = b;
        b = c;
        if (c == s->eod) {
            if ((rc = mt_indexed_writer_add_document(w, doc.p, doc.n)) < 0) break;
            doc.n = 0;
            if (total >= prm->tokens) break;
        }
        if (progress && total >= next_report && total < prm->tokens) {
            fprintf(stderr, "synth: %3d%% (%lld of %lld tokens, %lld documents)\n",
                    (int)(100 * total / prm->tokens), (long long)total, (long long)prm->tokens,
                    (long long)mt_indexed_writer_num_documents(w));
            next_report += prm->tokens / 10;
        }
    }
    if (rc == MT_OK) {
        st->tokens = total;
        st->documents = mt_indexed_writer_num_documents(w);
        st->nll = nll / (double)total;
        st->empirical = empirical_entropy(s, counts, total);
    }
    free(doc.p);
    free(counts);
    return rc;
}

static int synth_metadata(const char *prefix, const synth_params *prm, const synth_stats *st)
{
    json_t *o = json_object();
    json_object_set_new(o, "generator", json_string("moetrain-data synth"));
    json_object_set_new(o, "source", json_string("sparse order-2 Markov, EOD in the chain"));
    json_object_set_new(o, "vocab", json_integer(prm->vocab));
    json_object_set_new(o, "tokens", json_integer(st->tokens));
    json_object_set_new(o, "tokens_requested", json_integer(prm->tokens));
    if (prm->seed <= (uint64_t)INT64_MAX) {
        json_object_set_new(o, "seed", json_integer((json_int_t)prm->seed));
    } else { /* JSON integers are signed 64-bit in jansson */
        char buf[24];
        snprintf(buf, sizeof buf, "%llu", (unsigned long long)prm->seed);
        json_object_set_new(o, "seed", json_string(buf));
    }
    json_object_set_new(o, "order", json_integer(2));
    json_object_set_new(o, "branching", json_integer(prm->branching));
    json_object_set_new(o, "eod_token", json_integer(prm->vocab - 1));
    json_object_set_new(o, "mean_doc_len", json_real(prm->mean_doc_len));
    json_object_set_new(o, "p_eod", json_real(1.0 / prm->mean_doc_len));
    json_object_set_new(o, "weights", json_string("normalised exp(N(0,1))"));
    json_object_set_new(o, "documents", json_integer(st->documents));
    json_object_set_new(o, "dtype", json_string(mt_idx_dtype_name(mt_idx_dtype_for_vocab(prm->vocab))));
    json_object_set_new(o, "conditional_entropy_nats", json_real(st->entropy));
    json_object_set_new(o, "conditional_entropy_bits", json_real(st->entropy / log(2.0)));
    json_object_set_new(o, "empirical_conditional_entropy_nats", json_real(st->empirical));
    json_object_set_new(o, "sample_nll_nats", json_real(st->nll));
    json_object_set_new(o, "stationary_iterations", json_integer(st->iterations));
    json_object_set_new(o, "stationary_l1_change", json_real(st->residual));
    int rc = data_write_meta(prefix, o);
    json_decref(o);
    return rc;
}

static int synth_run(const char *prefix, const synth_params *prm)
{
    synth_source src;
    synth_stats st = {0};
    MT_CHECK(source_build(&src, prm));
    int rc = source_entropy(&src, prm->mean_doc_len, &st);
    mt_indexed_writer *w = NULL;
    if (rc == MT_OK) rc = mt_indexed_writer_create(prefix, mt_idx_dtype_for_vocab(prm->vocab), &w);
    if (rc == MT_OK) rc = synth_generate(&src, prm, w, &st);
    if (rc == MT_OK) rc = mt_indexed_writer_finish(w);
    if (rc == MT_OK) rc = synth_metadata(prefix, prm, &st);
    if (rc == MT_OK)
        printf("synth %s: %lld tokens, %lld documents, vocab %lld, branching %lld, mean doc len "
               "%.6g\n  conditional entropy %.6f nats/token (exact); sample: plug-in %.6f, "
               "NLL under the source %.6f\n", prefix, (long long)st.tokens,
               (long long)st.documents, (long long)prm->vocab, (long long)prm->branching,
               prm->mean_doc_len, st.entropy, st.empirical, st.nll);
    mt_indexed_writer_free(w);
    source_free(&src);
    return rc;
}

static int synth_parse(const char *vocab, const char *tokens, const char *seed,
                       const char *branching, const char *mean_len, synth_params *prm)
{
    MT_CHECK(data_parse_i64("--vocab", vocab, 3, 65535, &prm->vocab));
    MT_CHECK(data_parse_i64("--tokens", tokens, 1, INT64_MAX / 2, &prm->tokens));
    MT_CHECK(data_parse_u64("--seed", seed, &prm->seed));
    int64_t V = prm->vocab;
    prm->branching = V - 1 < 8 ? V - 1 : 8;
    if (branching)
        MT_CHECK(data_parse_i64("--branching", branching, 1, V - 1, &prm->branching));
    prm->mean_doc_len = 128.0;
    if (mean_len) MT_CHECK(data_parse_f64("--mean-doc-len", mean_len, &prm->mean_doc_len));
    if (!(prm->mean_doc_len > 1.0))
        return MT_ERR(MT_EINVAL, "--mean-doc-len: %g must be > 1 (p_eod = 1/L below 1)",
                      prm->mean_doc_len);
    if (V * V * prm->branching > SYNTH_MAX_ENTRIES)
        return MT_ERR(MT_EINVAL, "--vocab %lld with --branching %lld: V*V*K = %lld successor "
                      "entries, more than the %lld held in memory for the exact entropy; "
                      "lower --vocab or --branching", (long long)V, (long long)prm->branching,
                      (long long)(V * V * prm->branching), (long long)SYNTH_MAX_ENTRIES);
    return MT_OK;
}

int data_synth_main(int argc, char **argv)
{
    const char *output = NULL, *vocab = NULL, *tokens = NULL, *seed = NULL;
    const char *branching = NULL, *mean_len = NULL;
    data_opt opts[] = {
        {"--output", &output, NULL},       {"--vocab", &vocab, NULL},
        {"--tokens", &tokens, NULL},       {"--seed", &seed, NULL},
        {"--branching", &branching, NULL}, {"--mean-doc-len", &mean_len, NULL},
    };
    const char *pos[1];
    int npos = 0;
    int rc = data_parse_args(argc, argv, synth_usage, opts, 6, pos, 0, &npos);
    if (rc < 0) return DATA_EXIT_OK;
    if (rc != DATA_EXIT_OK) return rc;
    const char *missing = !output ? "--output" : !vocab ? "--vocab" : !tokens ? "--tokens"
                        : !seed ? "--seed" : NULL;
    if (missing) {
        fprintf(stderr, "moetrain-data synth: missing %s\n\n%s", missing, synth_usage);
        return DATA_EXIT_USAGE;
    }
    synth_params prm;
    if (synth_parse(vocab, tokens, seed, branching, mean_len, &prm) < 0) return data_fail();
    if (synth_run(output, &prm) < 0) return data_fail();
    return DATA_EXIT_OK;
}
