/* layout.c - see layout.h. */
#include "engine/parallel/layout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"

const char *const mt_pp_schedule_names[] = {"1f1b", "interleaved", "dualpipev", NULL};

void mt_layout_default(mt_layout *l)
{
    memset(l, 0, sizeof *l);
    l->tp = l->pp = l->vpp = l->ep = l->etp = l->dp = 1;
    l->schedule = MT_PP_1F1B;
}

static const char *plural(int n) { return n == 1 ? "" : "s"; }

int mt_layout_resolve(mt_layout *l, int world)
{
    char lt[128];
    mt_layout_format(l, lt, sizeof lt);
    if (l->tp < 1 || l->pp < 1 || l->vpp < 1 || l->ep < 1 || l->etp < 1 || l->dp < 0)
        return MT_ERR(MT_EINVAL, "parallel: layout %s: every size must be >= 1 (dp >= 0)", lt);
    if (world < 1) return MT_ERR(MT_EINVAL, "parallel: world size %d is not positive", world);
    const int tpp = l->tp * l->pp;
    if (l->dp == 0) {
        if (world % tpp != 0)
            return MT_ERR(MT_EINVAL,
                          "parallel: layout %s: %d rank%s run%s the job, not a multiple of tp %d x "
                          "pp %d = %d, so dp cannot be derived",
                          lt, world, plural(world), world == 1 ? "s" : "", l->tp, l->pp, tpp);
        l->dp = world / tpp;
    } else if ((long long)tpp * l->dp != world) {
        return MT_ERR(MT_EINVAL,
                      "parallel: layout %s needs tp %d x pp %d x dp %d = %lld rank%s, but %d "
                      "rank%s run%s the job",
                      lt, l->tp, l->pp, l->dp, (long long)tpp * l->dp,
                      plural(tpp * l->dp), world, plural(world), world == 1 ? "s" : "");
    }
    if (l->schedule == MT_PP_DUALPIPEV) l->vpp = 2;
    if ((l->tp * l->dp) % (l->etp * l->ep) != 0) {
        mt_layout_format(l, lt, sizeof lt);
        return MT_ERR(MT_EINVAL,
                      "parallel: layout %s: etp %d x ep %d = %d must divide tp %d x dp %d = %d "
                      "(the expert ranks are the dense tp x dp ranks refolded)",
                      lt, l->etp, l->ep, l->etp * l->ep, l->tp, l->dp, l->tp * l->dp);
    }
    return MT_OK;
}

int mt_layout_world(const mt_layout *l) { return l->tp * l->dp * l->pp; }

int mt_layout_edp(const mt_layout *l) { return l->tp * l->dp / (l->etp * l->ep); }

void mt_layout_coords(const mt_layout *l, int rank, mt_rank_coords *c)
{
    c->tp = rank % l->tp;
    c->dp = (rank / l->tp) % l->dp;
    c->pp = rank / (l->tp * l->dp);
    int local = rank % (l->tp * l->dp);
    c->etp = local % l->etp;
    c->ep = (local / l->etp) % l->ep;
    c->edp = local / (l->etp * l->ep);
}

int mt_layout_rank(const mt_layout *l, int tp, int dp, int pp)
{
    return tp + l->tp * (dp + l->dp * pp);
}

int mt_layout_expert_rank(const mt_layout *l, int etp, int ep, int edp, int pp)
{
    return etp + l->etp * (ep + l->ep * edp) + l->tp * l->dp * pp;
}

int mt_layout_chunks(const mt_layout *l) { return l->pp * l->vpp; }

int mt_layout_stage_of_chunk(const mt_layout *l, int c)
{
    if (l->schedule == MT_PP_DUALPIPEV) return c < l->pp ? c : 2 * l->pp - 1 - c;
    return c % l->pp;
}

/* One "key=value" of a layout text; *s advances past it and its comma. */
static int parse_pair(mt_layout *l, const char *text, const char **s)
{
    char key[16], val[32];
    size_t k = 0, v = 0;
    while (**s && **s != '=' && **s != ',' && k + 1 < sizeof key) key[k++] = *(*s)++;
    key[k] = '\0';
    if (**s != '=')
        return MT_ERR(MT_EINVAL, "layout \"%s\": expected key=value at \"%s\"", text, key);
    (*s)++;
    while (**s && **s != ',' && v + 1 < sizeof val) val[v++] = *(*s)++;
    val[v] = '\0';
    if (**s == ',') (*s)++;
    else if (**s)
        return MT_ERR(MT_EINVAL, "layout \"%s\": value of %s is too long", text, key);

    if (!strcmp(key, "schedule")) {
        for (int i = 0; mt_pp_schedule_names[i]; i++)
            if (!strcmp(val, mt_pp_schedule_names[i])) {
                l->schedule = (mt_pp_schedule)i;
                return MT_OK;
            }
        return MT_ERR(MT_EINVAL, "layout \"%s\": schedule \"%s\" is not 1f1b, interleaved or "
                      "dualpipev", text, val);
    }
    char *end;
    long n = strtol(val, &end, 10);
    if (end == val || *end || n < 0 || n > 1 << 20)
        return MT_ERR(MT_EINVAL, "layout \"%s\": %s needs a number, not \"%s\"", text, key, val);
    if (!strcmp(key, "dualpipev")) {
        if (n > 1) return MT_ERR(MT_EINVAL, "layout \"%s\": dualpipev is 0 or 1", text);
        if (n) l->schedule = MT_PP_DUALPIPEV;
        else if (l->schedule == MT_PP_DUALPIPEV) l->schedule = MT_PP_1F1B;
        return MT_OK;
    }
    int *dst = !strcmp(key, "tp")    ? &l->tp
               : !strcmp(key, "pp")  ? &l->pp
               : !strcmp(key, "vpp") ? &l->vpp
               : !strcmp(key, "ep")  ? &l->ep
               : !strcmp(key, "etp") ? &l->etp
               : !strcmp(key, "dp")  ? &l->dp
                                     : NULL;
    if (!dst)
        return MT_ERR(MT_EINVAL,
                      "layout \"%s\": unknown key \"%s\" (tp pp vpp ep etp dp schedule dualpipev)",
                      text, key);
    if (dst != &l->dp && n < 1)
        return MT_ERR(MT_EINVAL, "layout \"%s\": %s must be >= 1", text, key);
    *dst = (int)n;
    return MT_OK;
}

int mt_layout_parse(mt_layout *l, const char *text)
{
    mt_layout_default(l);
    const char *s = text;
    while (*s) MT_CHECK(parse_pair(l, text, &s));
    if (l->schedule == MT_PP_DUALPIPEV) l->vpp = 2;
    return MT_OK;
}

int mt_layout_format(const mt_layout *l, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "tp=%d,pp=%d,vpp=%d,ep=%d,etp=%d,dp=%d%s", l->tp, l->pp, l->vpp,
                     l->ep, l->etp, l->dp, l->schedule == MT_PP_DUALPIPEV ? ",dualpipev=1" : "");
    return n >= 0 && (size_t)n < cap ? MT_OK : MT_ERR(MT_EINVAL, "layout text too long");
}
