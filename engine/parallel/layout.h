/* layout.h - the one parallel layout of the program.
 *
 * The job spec's `parallel` section is this struct (engine/train/jobspec.c
 * maps the fields onto it); checkpoints record it; the service reports it;
 * the sharding map and the process groups are built from it.
 *
 * Sizes: tp (tensor), pp (pipeline stages), vpp (virtual chunks per stage),
 * ep (expert), etp (expert tensor), dp (data). dp = 0 means "derive from the
 * world size": mt_layout_resolve turns it into world / (tp * pp) once the
 * number of ranks is known, and checks everything that depends on it. After
 * resolve, tp * pp * dp == world and edp = tp * dp / (etp * ep) is whole.
 *
 * Rank order (Megatron, context parallelism 1):
 *   dense   rank = tp + TP * (dp + DP * pp)
 *   experts the TP * DP ranks of a stage refolded as
 *           local = etp + ETP * (ep + EP * edp) (MoE parallel folding),
 *           rank = local + TP * DP * pp.
 * Pipeline chunks: PP * VPP contiguous chunks of decoder layers; chunk c runs
 * on stage c % PP, or under DualPipeV (V shape, VPP = 2) on
 * c < PP ? c : 2 PP - 1 - c.
 */
#ifndef MT_LAYOUT_H
#define MT_LAYOUT_H

#include <stddef.h>

typedef enum { MT_PP_1F1B = 0, MT_PP_INTERLEAVED, MT_PP_DUALPIPEV } mt_pp_schedule;

#define MT_LAYOUT_MAX_CHUNKS 256

typedef struct mt_layout {
    int tp, pp, vpp, ep, etp; /* >= 1 */
    int dp;                   /* >= 1 once resolved; 0: world / (tp * pp) */
    mt_pp_schedule schedule;  /* DualPipeV also places chunks in a V (vpp = 2) */
    /* Decoder layers of each pipeline chunk in chunk order (the job spec's
     * parallel.pp_layers); n_pp_layers 0: balanced (sharding.h,
     * mt_layout_chunk_layers). Not part of mt_layout_format / _parse. */
    int n_pp_layers;
    int pp_layers[MT_LAYOUT_MAX_CHUNKS];
    /* Sequence parallelism with tp > 1 (parallel.sequence_parallel): how
     * activations move between the tensor-parallel regions, not where
     * weights live: it is not part of mt_layout_format / parse. */
    int sequence_parallel;
} mt_layout;

/* A rank's position in every process group of the layout. */
typedef struct mt_rank_coords {
    int tp, dp, pp;     /* dense groups */
    int etp, ep, edp;   /* expert groups of the same rank */
} mt_rank_coords;

/* Every size 1, schedule 1F1B: one rank. */
void mt_layout_default(mt_layout *l);

/* Derives dp (when 0) for `world` ranks and checks the layout against them:
 * tp * pp * dp == world, etp * ep divides tp * dp (expert folding), DualPipeV
 * gets vpp = 2. Errors name the layout, the numbers and the world size. */
int mt_layout_resolve(mt_layout *l, int world);

/* Sizes of a resolved layout. */
int mt_layout_world(const mt_layout *l);
int mt_layout_edp(const mt_layout *l); /* tp * dp / (etp * ep) */
void mt_layout_coords(const mt_layout *l, int rank, mt_rank_coords *c);
int mt_layout_rank(const mt_layout *l, int tp, int dp, int pp);
/* Rank of expert coordinates on pipeline stage pp. */
int mt_layout_expert_rank(const mt_layout *l, int etp, int ep, int edp, int pp);

/* Pipeline chunks (pp * vpp) and the stage that runs chunk c. */
int mt_layout_chunks(const mt_layout *l);
int mt_layout_stage_of_chunk(const mt_layout *l, int c);

/* Parses "tp=2,pp=2,ep=4,dp=1" (keys tp pp vpp ep etp dp, all >= 1 except
 * dp >= 0; schedule=1f1b|interleaved|dualpipev; dualpipev=0|1 as written by
 * mt_layout_format). Missing keys are 1 (dp 1). Errors name the key. */
int mt_layout_parse(mt_layout *l, const char *text);
/* "tp=2,pp=2,vpp=1,ep=4,etp=1,dp=1[,dualpipev=1]" into buf. */
int mt_layout_format(const mt_layout *l, char *buf, size_t cap);

/* Schedule names as the job spec writes them; NULL-terminated. */
extern const char *const mt_pp_schedule_names[];

#endif
