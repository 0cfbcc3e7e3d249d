/* dash_json.c - see dash_json.h. */
#define _POSIX_C_SOURCE 200809L
#include "service/dash_json.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/mt_status.h"
#include "service/board.h"

#ifndef MOETRAIN_VERSION
#define MOETRAIN_VERSION "dev"
#endif

/* A step's metrics JSON: 128 MoE layers x 3 numbers of up to ~20 characters
 * each plus the scalars stay well under this. */
#define STEP_JSON_CAP 32768

int dash_parse_event_id(const char *header, const char *epoch, uint64_t *seq)
{
    if (!header) return 0;
    size_t n = strlen(epoch);
    if (strncmp(header, epoch, n) || header[n] != '-') return 0;
    const char *d = header + n + 1;
    if (*d < '0' || *d > '9') return 0;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(d, &end, 10);
    if (*end || errno) return 0;
    *seq = (uint64_t)v;
    return 1;
}

/* ---- JSON values ------------------------------------------------------------------ */

/* JSON has no NaN: an unmeasured or non-finite value is null. */
static json_t *jnum(double v) { return isfinite(v) ? json_real(v) : json_null(); }

/* A float as the shortest decimal that reads back as the same float
 * (0.007, not 0.00700000068173). */
static json_t *jfloat(float f)
{
    if (!isfinite(f)) return json_null();
    char t[32];
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(t, sizeof t, "%.*g", digits, (double)f);
        if (strtof(t, NULL) == f) break;
    }
    return json_real(strtod(t, NULL));
}

/* A JSON string of s; bytes that do not form UTF-8 (a path, a line cut
 * mid-character) become '?' rather than failing the whole answer. */
static json_t *jstr(const char *s)
{
    json_t *v = json_string(s);
    if (v) return v;
    char *c = strdup(s);
    if (!c) return NULL;
    for (char *p = c; *p; p++)
        if ((unsigned char)*p >= 0x80) *p = '?';
    v = json_string(c);
    free(c);
    return v;
}

/* Sets obj[key] = v, remembering a failed allocation in *oom. */
static void put(json_t *obj, const char *key, json_t *v, int *oom)
{
    if (!v || json_object_set_new(obj, key, v) < 0) *oom = 1;
}

static json_t *layout_json(const mt_layout *p)
{
    return json_pack("{s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "tp", p->tp, "pp", p->pp, "vpp", p->vpp,
                     "ep", p->ep, "etp", p->etp, "dp", p->dp, "schedule",
                     svc_schedule_name(p->schedule));
}

static json_t *ckpt_json(const svc_ckpt *c, int *oom)
{
    if (!c->valid) return json_null();
    json_t *o = json_object();
    if (!o) {
        *oom = 1;
        return NULL;
    }
    put(o, "name", jstr(c->name), oom);
    put(o, "step", json_integer(c->step), oom);
    put(o, "path", jstr(c->path), oom);
    put(o, "bytes", json_integer(c->bytes), oom);
    put(o, "layout", c->have_layout ? layout_json(&c->layout) : json_null(), oom);
    /* Listed checkpoints are the committed ones (renamed into place after
     * fsync, with checksums): the page says so rather than claiming a
     * verify pass that did not run. */
    put(o, "committed", json_true(), oom);
    /* how the save went, when this daemon saved it (null: not known) */
    put(o, "write_ms", c->write_ms > 0 ? jnum(c->write_ms) : json_null(), oom);
    put(o, "stall_ms", c->write_ms > 0 ? jnum(c->stall_ms) : json_null(), oom);
    put(o, "verify", jstr(c->verify), oom);
    return o;
}

static json_t *reshard_json(const svc_reshard *r, int *oom)
{
    json_t *o = json_object();
    if (!o) {
        *oom = 1;
        return NULL;
    }
    put(o, "active", json_boolean(r->active), oom);
    put(o, "done", json_boolean(r->done), oom);
    put(o, "failed", json_boolean(r->failed), oom);
    put(o, "source", jstr(r->source), oom);
    put(o, "target", jstr(r->target), oom);
    put(o, "progress", jnum(r->progress), oom);
    put(o, "message", jstr(r->message), oom);
    put(o, "layout", layout_json(&r->layout), oom);
    return o;
}

/* The step's metrics as a JSON value (the JSONL sink's text, parsed). */
static json_t *step_json(const mt_step_metrics *m)
{
    char *buf = malloc(STEP_JSON_CAP);
    if (!buf) return NULL;
    mt_metrics_to_json(m, buf, STEP_JSON_CAP);
    json_t *v = json_loads(buf, 0, NULL);
    free(buf);
    return v;
}

/* Dumps and frees `v` into a malloc'd string. */
static int dump(json_t *v, int oom, char **out, size_t *len)
{
    *out = NULL;
    char *s = !oom && v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(12)) : NULL;
    json_decref(v);
    if (!s) return MT_ERR(MT_ENOMEM, "dashboard JSON: out of memory");
    *out = s;
    *len = strlen(s);
    return MT_OK;
}

/* ---- SSE frames ------------------------------------------------------------------- */

/* "id: ...\nevent: ...\ndata: JSON\n\n" (id optional). A compact JSON text
 * holds no newline, so it is one data line. */
static int frame(const char *id, const char *event, json_t *data, int oom, char **out,
                 size_t *len)
{
    char *js = NULL; /* set by dump on success */
    size_t jn = 0;
    MT_CHECK(dump(data, oom, &js, &jn));
    size_t cap = jn + (id ? strlen(id) : 0) + strlen(event) + 64;
    char *f = malloc(cap);
    if (!f) {
        free(js);
        return MT_ERR(MT_ENOMEM, "dashboard events: out of memory");
    }
    int n = snprintf(f, cap, "%s%s%sevent: %s\ndata: %s\n\n", id ? "id: " : "", id ? id : "",
                     id ? "\n" : "", event, js);
    free(js);
    *out = f;
    *len = (size_t)n;
    return MT_OK;
}

int dash_hello_frame(const char *epoch, int resumed, uint64_t head, char **out, size_t *len)
{
    int oom = 0;
    json_t *o = json_object();
    if (o) {
        put(o, "kind", jstr("hello"), &oom);
        put(o, "epoch", jstr(epoch), &oom);
        put(o, "resumed", json_boolean(resumed), &oom);
        put(o, "head", json_integer((json_int_t)head), &oom);
    }
    /* retry: how long a browser waits before reconnecting (ms). */
    char *f;
    size_t n;
    MT_CHECK(frame(NULL, "hello", o, oom, &f, &n));
    static const char retry[] = "retry: 1000\n";
    char *g = malloc(n + sizeof retry);
    if (!g) {
        free(f);
        return MT_ERR(MT_ENOMEM, "dashboard events: out of memory");
    }
    memcpy(g, retry, sizeof retry - 1);
    memcpy(g + sizeof retry - 1, f, n + 1);
    free(f);
    *out = g;
    *len = n + sizeof retry - 1;
    return MT_OK;
}

int dash_gap_frame(uint64_t missed, uint64_t next, char **out, size_t *len)
{
    int oom = 0;
    json_t *o = json_object();
    if (o) {
        put(o, "kind", jstr("gap"), &oom);
        put(o, "missed", json_integer((json_int_t)missed), &oom);
        put(o, "next", json_integer((json_int_t)next), &oom);
    }
    return frame(NULL, "gap", o, oom, out, len);
}

int dash_event_frame(const char *epoch, const hub_event *e, char **out, size_t *len)
{
    static const char *const kinds[HUB_N_KINDS] = {"step", "state", "checkpoint", "reshard"};
    _Static_assert(HUB_N_KINDS == 4, "a name for every hub event kind");
    if ((int)e->kind < 0 || e->kind >= HUB_N_KINDS)
        return MT_ERR(MT_EINVAL, "dashboard events: hub event kind %d", (int)e->kind);
    const char *kind = kinds[e->kind];
    int oom = 0;
    json_t *o = json_object();
    if (!o) return MT_ERR(MT_ENOMEM, "dashboard events: out of memory");
    put(o, "seq", json_integer((json_int_t)e->seq), &oom);
    put(o, "run_id", json_integer((json_int_t)e->run_id), &oom);
    put(o, "job", jstr(e->job), &oom);
    put(o, "kind", jstr(kind), &oom);
    switch (e->kind) {
    case HUB_STEP: put(o, "step", step_json(&e->u.step), &oom); break;
    case HUB_STATE:
        put(o, "state", jstr(svc_state_name(e->u.state.state)), &oom);
        put(o, "step", json_integer(e->u.state.step), &oom);
        put(o, "message", jstr(e->u.state.message), &oom);
        break;
    case HUB_CHECKPOINT: put(o, "checkpoint", ckpt_json(&e->u.ckpt, &oom), &oom); break;
    case HUB_RESHARD: put(o, "reshard", reshard_json(&e->u.reshard, &oom), &oom); break;
    default: break;
    }
    char id[DASH_EPOCH_CAP + 32];
    snprintf(id, sizeof id, "%s-%llu", epoch, (unsigned long long)e->seq);
    return frame(id, kind, o, oom, out, len);
}

/* ---- /api ----------------------------------------------------------------------- */

/* Every rank's last step: [{"rank","step","step_ms","compute_ms","mem_in_use",
 * "mem_peak"}], and the slowest rank (null before the first step). */
static void ranks_json(json_t *o, board *bd, int *oom)
{
    board_ranks br = {0};
    br.slowest = -1;
    if (bd && board_get_ranks(bd, &br) < 0) *oom = 1;
    json_t *a = json_array();
    if (!a) *oom = 1;
    for (int i = 0; a && i < br.n; i++) {
        const board_rank *r = &br.r[i];
        json_t *e = json_pack("{s:i,s:I,s:o,s:o,s:I,s:I}", "rank", r->rank, "step",
                              (json_int_t)r->step, "step_ms", jnum(r->step_ms), "compute_ms",
                              jnum(r->compute_ms), "mem_in_use", (json_int_t)r->mem_in_use,
                              "mem_peak", (json_int_t)r->mem_peak);
        if (!e || json_array_append_new(a, e) < 0) *oom = 1;
    }
    put(o, "rank_stats", a, oom);
    put(o, "slowest_rank", br.n > 0 ? json_integer(br.slowest) : json_null(), oom);
    board_ranks_free(&br);
}

int dash_status_json(service *svc, const dash_access *acc, char **out, size_t *len)
{
    control_status *st = malloc(sizeof *st);
    if (!st) return MT_ERR(MT_ENOMEM, "status: out of memory");
    control_get_status(svc->ctl, st);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    int oom = 0;
    json_t *o = json_object();
    if (!o) oom = 1;
    else {
        put(o, "version", jstr(MOETRAIN_VERSION), &oom);
        put(o, "backend", jstr(st->backend), &oom);
        put(o, "ranks", json_integer(st->ranks), &oom);
        put(o, "uptime_s",
            jnum((double)now.tv_sec + 1e-9 * (double)now.tv_nsec - st->started_unix), &oom);
        put(o, "state", jstr(svc_state_name(st->state)), &oom);
        put(o, "job", jstr(st->job), &oom);
        put(o, "run_id", json_integer((json_int_t)st->run_id), &oom);
        put(o, "step", json_integer(st->step), &oom);
        put(o, "total_steps", json_integer(st->total_steps), &oom);
        put(o, "tokens", json_integer(st->tokens), &oom);
        put(o, "layout", st->have_layout ? layout_json(&st->layout) : json_null(), &oom);
        put(o, "error", jstr(st->error), &oom);
        put(o, "outcome", jstr(st->outcome), &oom);
        put(o, "valid_loss", jnum(st->last_valid_loss), &oom);
        put(o, "checkpoints_saved", json_integer((json_int_t)st->ckpt_saved_total), &oom);
        put(o, "last_checkpoint", ckpt_json(&st->last_ckpt, &oom), &oom);
        int rs = st->reshard.active || st->reshard.done || st->reshard.failed;
        put(o, "reshard", rs ? reshard_json(&st->reshard, &oom) : json_null(), &oom);
        put(o, "shutting_down", json_boolean(st->shutting_down), &oom);
        put(o, "last", st->have_metrics ? step_json(&st->last) : json_null(), &oom);
        ranks_json(o, control_board(svc->ctl), &oom);
        json_t *c = json_object();
        if (c) {
            put(c, "mode", jstr(acc->mode), &oom);
            put(c, "allowed", json_boolean(acc->allowed), &oom);
            put(c, "why", jstr(acc->why ? acc->why : ""), &oom);
        }
        put(o, "control", c, &oom);
    }
    free(st);
    return dump(o, oom, out, len);
}

int dash_experts_json(service *svc, char **out, size_t *len)
{
    board *bd = control_board(svc->ctl);
    board_experts e;
    memset(&e, 0, sizeof e);
    if (bd) MT_CHECK(board_get_experts(bd, &e));
    char job[SVC_NAME_CAP];
    control_status *st = malloc(sizeof *st);
    if (!st) {
        board_experts_free(&e);
        return MT_ERR(MT_ENOMEM, "experts: out of memory");
    }
    control_get_status(svc->ctl, st);
    snprintf(job, sizeof job, "%s", st->run_id == e.run_id ? st->job : "");
    free(st);
    int oom = 0;
    json_t *o = json_object(), *layers = json_array();
    if (!o || !layers) oom = 1;
    const size_t E = (size_t)(e.n_experts > 0 ? e.n_experts : 0);
    for (int l = 0; !oom && l < e.n_layers; l++) {
        json_t *ly = json_object(), *load = json_array(), *bias = e.have_bias ? json_array() : json_null();
        if (!ly || !load || !bias) oom = 1;
        double sum = 0;
        for (size_t x = 0; !oom && x < E; x++) {
            const int64_t v = e.load[(size_t)l * E + x];
            sum += (double)v;
            if (json_array_append_new(load, json_integer((json_int_t)v)) < 0) oom = 1;
            if (e.have_bias && json_array_append_new(bias, jfloat(e.bias[(size_t)l * E + x])) < 0)
                oom = 1;
        }
        if (ly) {
            put(ly, "layer", json_integer(e.layer[l]), &oom);
            put(ly, "mean", jnum(E ? sum / (double)E : 0), &oom);
            put(ly, "load", load, &oom);
            put(ly, "bias", bias, &oom);
            if (json_array_append_new(layers, ly) < 0) oom = 1;
        } else {
            json_decref(load);
            json_decref(bias);
        }
    }
    if (o) {
        put(o, "run_id", json_integer((json_int_t)e.run_id), &oom);
        put(o, "job", jstr(job), &oom);
        put(o, "step", json_integer(e.step), &oom);
        put(o, "experts", json_integer((json_int_t)E), &oom);
        put(o, "have_bias", json_boolean(e.have_bias), &oom);
        put(o, "layers", layers, &oom);
    } else {
        json_decref(layers);
    }
    board_experts_free(&e);
    return dump(o, oom, out, len);
}

int dash_checkpoints_json(service *svc, char **out, size_t *len)
{
    svc_ckpt *list = NULL;
    int n = 0;
    char dir[MT_PATH_CAP];
    MT_CHECK(control_list_checkpoints(svc->ctl, "", dir, sizeof dir, &list, &n));
    int oom = 0;
    json_t *o = json_object(), *a = json_array();
    if (!o || !a) oom = 1;
    for (int i = 0; !oom && i < n; i++) {
        json_t *c = ckpt_json(&list[i], &oom);
        if (!c || json_array_append_new(a, c) < 0) oom = 1;
    }
    free(list);
    if (o) {
        put(o, "directory", jstr(dir), &oom);
        put(o, "checkpoints", a, &oom);
    } else {
        json_decref(a);
    }
    return dump(o, oom, out, len);
}

int dash_logs_json(log_ring *r, uint64_t after, char **out, size_t *len)
{
    static const char *const levels[] = {"error", "warn", "info", "debug"};
    log_line *lines = malloc(LOG_RING_LINES * sizeof *lines);
    if (!lines) return MT_ERR(MT_ENOMEM, "logs: out of memory");
    uint64_t next;
    int n = log_ring_read(r, after, lines, LOG_RING_LINES, &next);
    int oom = 0;
    json_t *o = json_object(), *a = json_array();
    if (!o || !a) oom = 1;
    for (int i = 0; !oom && i < n; i++) {
        int lv = lines[i].level >= 0 && lines[i].level <= MT_LOG_DEBUG ? (int)lines[i].level : 2;
        json_t *l = json_pack("{s:I,s:s,s:o}", "seq", (json_int_t)lines[i].seq, "level",
                              levels[lv], "text", jstr(lines[i].text));
        if (!l || json_array_append_new(a, l) < 0) oom = 1;
    }
    free(lines);
    if (o) {
        put(o, "next", json_integer((json_int_t)next), &oom);
        put(o, "lines", a, &oom);
    } else {
        json_decref(a);
    }
    return dump(o, oom, out, len);
}

int dash_command_json(const char *command, int rc, const char *msg, const ctl_result *res,
                      char **out, size_t *len)
{
    int oom = 0;
    json_t *o = json_object();
    if (!o) return MT_ERR(MT_ENOMEM, "out of memory");
    put(o, "command", jstr(command), &oom);
    put(o, "ok", json_boolean(rc >= 0), &oom);
    if (rc < 0) {
        put(o, "error", jstr(msg ? msg : ""), &oom);
    } else if (!res) {
        put(o, "queued", json_true(), &oom);
    } else {
        put(o, "queued", json_false(), &oom);
        put(o, "step", json_integer(res->step), &oom);
        put(o, "state", jstr(svc_state_name(res->state)), &oom);
        put(o, "checkpoint", ckpt_json(&res->ckpt, &oom), &oom);
    }
    return dump(o, oom, out, len);
}
