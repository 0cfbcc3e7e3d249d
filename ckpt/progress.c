/* progress.c - see progress.h. */
#define _POSIX_C_SOURCE 200809L
#include "ckpt/progress.h"
#include "base/mt_clock.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void mt_progress_start(mt_progress *p, const char *label, int64_t total, int enabled)
{
    if (!p) return;
    memset(p, 0, sizeof *p);
    snprintf(p->label, sizeof p->label, "%s", label);
    p->total = total > 0 ? total : 1;
    p->enabled = enabled;
    p->tty = isatty(2);
    p->t0 = p->last = mt_now_s();
}

void mt_progress_start_count(mt_progress *p, const char *label, int64_t total, const char *unit,
                             int enabled)
{
    mt_progress_start(p, label, total, enabled);
    if (p) snprintf(p->unit, sizeof p->unit, "%s", unit);
}

static void draw(mt_progress *p, double t, int final)
{
    double frac = (double)p->done / (double)p->total;
    if (frac > 1) frac = 1;
    double el = t - p->t0, rate = el > 0 ? (double)p->done / el : 0;
    char bar[21];
    int fill = (int)(frac * 20);
    for (int i = 0; i < 20; i++) bar[i] = i < fill ? '#' : '.';
    bar[20] = '\0';
    char eta[32] = "";
    if (!final && rate > 0) snprintf(eta, sizeof eta, "  eta %.0fs", (double)(p->total - p->done) / rate);
    else if (final) snprintf(eta, sizeof eta, "  %.1fs", el);
    char amount[96];
    if (p->unit[0])
        snprintf(amount, sizeof amount, "%lld/%lld %s  %.0f %s/s", (long long)p->done,
                 (long long)p->total, p->unit, rate, p->unit);
    else
        snprintf(amount, sizeof amount, "%.2f/%.2f GB  %.0f MB/s", (double)p->done / 1e9,
                 (double)p->total / 1e9, rate / 1e6);
    fprintf(stderr, "%s%s [%s] %3.0f%%  %s%s%s", p->tty ? "\r" : "", p->label, bar, 100 * frac,
            amount, eta, p->tty && !final ? "\033[K" : "\n");
    fflush(stderr);
}

void mt_progress_add(mt_progress *p, int64_t bytes)
{
    if (!p) return;
    p->done += bytes;
    if (!p->enabled) return;
    double t = mt_now_s();
    if (p->tty) {
        if (t - p->last < 0.1) return;
        p->last = t;
        draw(p, t, 0);
        return;
    }
    int q = (int)(4 * (double)p->done / (double)p->total);
    if (q > p->last_quarter && q < 4) {
        p->last_quarter = q;
        draw(p, t, 0);
    }
}

void mt_progress_end(mt_progress *p)
{
    if (!p || !p->enabled) return;
    p->done = p->total > p->done ? p->done : p->total;
    draw(p, mt_now_s(), 1);
}
