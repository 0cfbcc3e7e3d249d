/* eval_rpc.c - moetrain.v1.Trainer/Evaluate: scoring token sequences with a
 * checkpoint on rank 0 (runtime/ckpt_eval.h, what `moetrain-ckpt eval` runs).
 *
 * Every path the request names is confined to the workdir (workdir.h). The
 * evaluation runs in a thread of its own so the server keeps answering;
 * the call is a stream that waits (RPC_WAIT) until the thread is done.
 * One evaluation at a time. If the client goes away the evaluation stops
 * at its next micro-batch and writes nothing; the thread and the call
 * share the state and the last one to let go frees it. Progress goes to
 * the daemon's log at every quarter of the tokens.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "runtime/ckpt_eval.h"
#include "moetrain.pb-c.h"
#include "service/job_admit.h"
#include "service/rpc_validate.h"
#include "service/service.h"
#include "service/workdir.h"

static atomic_int busy; /* an evaluation is running */

typedef struct eval_call {
    rpc_stream s;
    pthread_mutex_t mu;
    int refs;                       /* the call and the thread */
    volatile sig_atomic_t stop;     /* the client went away */
    atomic_int done;
    int rc;
    char msg[RPC_DETAIL_CAP];       /* the error, captured on the thread */
    char ckpt[MT_PATH_CAP], tokens[MT_PATH_CAP], out[MT_PATH_CAP], backend[8];
    mt_jobspec job;
    mt_ckpt_eval_args a;
    mt_ckpt_eval_report rep;
    int quarter;                    /* progress logged so far */
} eval_call;

static void release(eval_call *c)
{
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left) return;
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void on_progress(void *ctx, const char *phase, int64_t done, int64_t total)
{
    eval_call *c = ctx;
    if (strcmp(phase, "score") != 0 || total <= 0) return;
    int q = (int)(4 * done / total);
    if (q <= c->quarter) return;
    c->quarter = q;
    MT_LOGI("evaluate: %d%% (%lld of %lld tokens)", 25 * q, (long long)done, (long long)total);
}

static void *run(void *arg)
{
    eval_call *c = arg;
    c->rc = mt_ckpt_eval(&c->a, on_progress, c, &c->stop, &c->rep);
    if (c->rc < 0) {
        snprintf(c->msg, sizeof c->msg, "%s", mt_errmsg());
        MT_LOGW("evaluate %s: %s", c->ckpt, c->msg);
    } else {
        MT_LOGI("evaluate %s: loss %.6f over %lld tokens in %.1f s", c->rep.dir, c->rep.r.loss,
                (long long)c->rep.r.tokens, c->rep.r.seconds);
    }
    atomic_store(&busy, 0);
    atomic_store(&c->done, 1);
    release(c);
    return NULL;
}

static int eval_next(rpc_stream *s, rpc_reply *out)
{
    eval_call *c = (eval_call *)s;
    if (!atomic_load(&c->done)) return RPC_WAIT;
    if (c->rc < 0) {
        rpc_reply_mt_msg(out, c->rc, NULL, c->msg);
        return RPC_END;
    }
    const mt_ckpt_eval_report *p = &c->rep;
    Moetrain__V1__EvaluateResponse m = MOETRAIN__V1__EVALUATE_RESPONSE__INIT;
    m.loss = p->r.loss;
    m.sequences = p->r.sequences;
    m.tokens = p->r.tokens;
    m.seq_len = p->r.seq_len;
    m.recipe = (char *)p->recipe;
    m.backend = (char *)p->backend;
    m.checkpoint = (char *)p->dir;
    m.input = (char *)p->input;
    m.loss_file = (char *)p->loss_path;
    m.tokens_file = (char *)p->tokens_path;
    m.logits_file = (char *)p->logits_path;
    m.seconds = p->r.seconds;
    rpc_reply_pack(out, &m.base);
    return RPC_END;
}

static void eval_close(rpc_stream *s)
{
    eval_call *c = (eval_call *)s;
    c->stop = 1; /* no effect once done */
    release(c);
}

static int validate(const ProtobufCMessage *req, rpc_reply *r)
{
    const Moetrain__V1__EvaluateRequest *q = (const void *)req;
    if (!q->checkpoint[0]) return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "checkpoint: required");
    if (q->backend[0] && strcmp(q->backend, "cpu") != 0 && strcmp(q->backend, "cuda") != 0)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "backend: \"%.40s\" is not cpu or cuda",
                               q->backend);
    if (q->fp32 && !strcmp(q->backend, "cuda"))
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT,
                               "fp32: runs on the CPU backend only (CUDA activations are bf16)");
    if (q->logits && !q->output[0])
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "logits: needs output (they go beside it)");
    if (q->micro_batch < 0 || q->micro_batch > 65536)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "micro_batch: %d is outside [0, 65536]",
                               q->micro_batch);
    if (q->threads < 0 || q->threads > 4096)
        return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "threads: %d is outside [0, 4096]", q->threads);
    if (q->spec && (q->spec->json[0] || q->spec->path[0])) {
        if (q->tokens[0])
            return rpc_reply_error(r, RPC_INVALID_ARGUMENT, "spec: give tokens or spec, not both");
        /* the job spec's own checks, as StartJob makes them */
        Moetrain__V1__StartJobRequest s = MOETRAIN__V1__START_JOB_REQUEST__INIT;
        s.spec = q->spec;
        return rpc_validate_start(&s.base, r);
    }
    return RPC_OK;
}

static rpc_stream *handle(void *ctx, const ProtobufCMessage *req, rpc_reply *out)
{
    service *sv = ctx;
    const Moetrain__V1__EvaluateRequest *q = (const void *)req;
    eval_call *c = calloc(1, sizeof *c);
    if (!c) {
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    int rc = wd_resolve(sv->workdir, q->checkpoint, "checkpoint", c->ckpt, sizeof c->ckpt);
    if (rc == MT_OK && q->tokens[0])
        rc = wd_resolve(sv->workdir, q->tokens, "tokens", c->tokens, sizeof c->tokens);
    if (rc == MT_OK && q->output[0])
        rc = wd_resolve(sv->workdir, q->output, "output", c->out, sizeof c->out);
    int has_job = q->spec && (q->spec->json[0] || q->spec->path[0]);
    if (rc == MT_OK && has_job) {
        job_request jr = {
            .json = q->spec->json,
            .path = q->spec->path,
            .base_dir = q->spec->base_dir,
            .sets = (const char *const *)q->spec->set,
            .n_sets = (int)q->spec->n_set,
        };
        rc = job_admit(sv->workdir, &jr, &c->job);
    }
    if (rc < 0) {
        rpc_reply_mt(out, rc, NULL);
        free(c);
        return NULL;
    }
    snprintf(c->backend, sizeof c->backend, "%s", q->backend[0] ? q->backend : "cpu");
    c->a = (mt_ckpt_eval_args){
        .ckpt = c->ckpt,
        .tokens = c->tokens[0] ? c->tokens : NULL,
        .job = has_job ? &c->job : NULL,
        .out = c->out[0] ? c->out : NULL,
        .logits = q->logits,
        .backend = c->backend,
        .fp32 = q->fp32,
        .threads = q->threads,
        .micro_batch = q->micro_batch,
    };
    int expected = 0;
    if (!atomic_compare_exchange_strong(&busy, &expected, 1)) {
        rpc_reply_error(out, RPC_FAILED_PRECONDITION, "an evaluation is running; try again later");
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 2;
    c->s.next = eval_next;
    c->s.close = eval_close;
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&th, &at, run, c);
    pthread_attr_destroy(&at);
    if (e != 0) {
        atomic_store(&busy, 0);
        pthread_mutex_destroy(&c->mu);
        free(c);
        rpc_reply_error(out, RPC_RESOURCE_EXHAUSTED, "cannot start a thread: %s", strerror(e));
        return NULL;
    }
    MT_LOGI("evaluate %s: started (%s)", c->ckpt, c->tokens[0] ? c->tokens : "valid split");
    return &c->s;
}

const rpc_method eval_rpc_methods[] = {
    {"/moetrain.v1.Trainer/Evaluate", RPC_UNARY, 1, &moetrain__v1__evaluate_request__descriptor,
     validate, handle},
};
const int eval_rpc_n_methods = 1;
