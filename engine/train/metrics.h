/* metrics.h - per-step training metrics and the sinks that deliver them.
 *
 * The trainer fills one mt_step_metrics per optimizer step and hands it to
 * every registered sink: a one-line log, a JSONL file (one object per step),
 * and the service's ring buffer (gRPC StreamMetrics, Prometheus /metrics).
 *
 * Model TFLOPS per GPU = mt_model_flops_per_token() x tokens / second / ranks:
 * all linear layers' matmul FLOPs (active experts, router, head, MTP) plus the
 * causal attention core, x3 for forward + backward. MFU divides it by the
 * backend's dense BF16 peak (989 TFLOPS on H100/H200; none on the CPU).
 */
#ifndef MT_METRICS_H
#define MT_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MT_METRICS_MAX_MOE 128 /* MoE layers reported (DeepSeek-V3: 58 + MTP) */

typedef struct mt_step_metrics {
    int64_t step;            /* 1-based optimizer step just completed */
    int64_t total_steps;
    double loss;             /* LM loss, mean over the global batch */
    double mtp_loss;         /* mean MTP loss over depths; 0 without MTP */
    double aux_loss;         /* sequence-wise balance loss (with alpha) */
    double lr;
    double grad_norm;        /* global gradient norm before clipping */
    double valid_loss;       /* LM loss on the valid split; NaN when not measured */
    double step_ms;          /* wall time of the step */
    double compute_ms;       /* this rank's own work: until its gradients are
                                ready for the dp reduction (data, forward,
                                backward); without dp the whole step */
    int pp_size;             /* pipeline stages; 0: no pipeline (the pp_ fields unset) */
    int pp_stage;            /* pipeline stage of this rank */
    double pp_idle;          /* measured: 1 - the device time of this stage's compute
                                actions / the pipeline part's span (pipeline.h); NaN: none */
    double pp_bubble;        /* the schedule's predicted idle fraction of this stage
                                (simulator, equal costs F = 1, B = 2); NaN: none */
    double pp_bubble_measured; /* the same simulated with the step's measured per-chunk
                                costs, gathered over the stages; NaN: none */
    double tokens_per_s;
    double tflops;           /* model TFLOPS per GPU (or per rank on the CPU) */
    double mfu;              /* fraction of peak; NaN when the peak is unknown */
    int64_t tokens;          /* tokens consumed so far */
    int64_t samples;         /* sequences consumed so far */
    size_t mem_in_use, mem_peak; /* backend bytes */
    int skipped;             /* this step was skipped (NaN/Inf) */
    int64_t skipped_total;
    int spike;               /* the spike detector's verdict (engine/train/spike.h); 0: normal */
    int64_t rollbacks_total; /* rollbacks to a checkpoint done by this process */
    int n_moe;               /* MoE layers reported below */
    int moe_layer[MT_METRICS_MAX_MOE];
    double load_min[MT_METRICS_MAX_MOE];  /* min / mean expert load of the step */
    double load_max[MT_METRICS_MAX_MOE];  /* max / mean */
    double load_cv[MT_METRICS_MAX_MOE];   /* coefficient of variation */
} mt_step_metrics;

typedef struct mt_metrics_sink mt_metrics_sink;
struct mt_metrics_sink {
    int (*emit)(mt_metrics_sink *s, const mt_step_metrics *m);
    void (*close)(mt_metrics_sink *s);
    void *impl;
};

/* Step log line every `interval` steps (and on skipped steps and the last). */
int mt_metrics_log_sink(mt_metrics_sink **out, int interval);
/* One JSON object per step appended to `path` (flushed each line). */
int mt_metrics_jsonl_sink(mt_metrics_sink **out, const char *path);

/* Load statistics of one layer: min / mean, max / mean, coefficient of variation. */
void mt_metrics_load_stats(const int64_t *load, int E, double *min_r, double *max_r, double *cv);

/* The step as one JSON object (no newline) into buf; returns its length. */
int mt_metrics_to_json(const mt_step_metrics *m, char *buf, size_t cap);

#endif
