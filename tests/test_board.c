/* test_board.c - the board (service/board.h): what the engine posts after
 * each step, latest only, and what the status, /metrics and the dashboard
 * make of it: per-rank step records with the slowest rank, per-expert loads
 * and router bias (per-expert Prometheus series only under the cap), and
 * the records of saved checkpoints joined to a listing by path. Without a
 * server; the gather of several ranks is exercised under mpirun by
 * test_service_mpi. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mt_status.h"
#include "engine/parallel/comm.h"
#include "service/board.h"
#include "service/dash_json.h"
#include "service/prom.h"
#include "service/service.h"
#include "service/workdir.h"
#include "test_util.h"

static board_rank rank_rec(int64_t step, double step_ms, double compute_ms, int64_t mem)
{
    board_rank r = {.rank = 99, .step = step, .step_ms = step_ms, .compute_ms = compute_ms,
                    .mem_in_use = mem, .mem_peak = 2 * mem};
    return r;
}

static void gather_over_a_world_of_one_posts_its_record(void **state)
{
    (void)state;
    mt_comm *w;
    mt_comm_opts o = {.backend = MT_COMM_LOCAL, .mem = MT_COMM_HOST};
    assert_int_equal(mt_comm_world(&w, &o), MT_OK);
    board *b;
    assert_int_equal(board_create(&b, 1), MT_OK);
    board_ranks br;
    assert_int_equal(board_get_ranks(b, &br), MT_OK);
    assert_int_equal(br.n, 0); /* nothing before the first step */
    assert_int_equal(br.slowest, -1);
    board_rank me = rank_rec(7, 120.5, 80.25, 1000);
    assert_int_equal(board_gather_ranks(b, w, &me), MT_OK);
    assert_int_equal(board_get_ranks(b, &br), MT_OK);
    assert_int_equal(br.n, 1);
    assert_int_equal(br.slowest, 0);
    assert_int_equal(br.r[0].rank, 0); /* numbered by position, not by what was sent */
    assert_int_equal(br.r[0].step, 7);
    assert_true(br.r[0].step_ms == 120.5 && br.r[0].compute_ms == 80.25);
    assert_int_equal(br.r[0].mem_peak, 2000);
    board_ranks_free(&br);
    /* a new job: the last one's records are gone */
    board_new_run(b, 2);
    assert_int_equal(board_get_ranks(b, &br), MT_OK);
    assert_int_equal(br.n, 0);
    assert_int_equal(br.run_id, 2);
    board_destroy(b);
    mt_comm_destroy(w);
}

static void slowest_rank_has_the_longest_own_work_lowest_on_ties(void **state)
{
    (void)state;
    board *b;
    assert_int_equal(board_create(&b, 4), MT_OK);
    /* step times alike (the reduction ends together), own work differs */
    board_rank r[4] = {rank_rec(3, 500, 100, 1), rank_rec(3, 500, 300, 1),
                       rank_rec(3, 501, 300, 1), rank_rec(3, 502, 50, 1)};
    assert_int_equal(board_post_ranks(b, r, 4), MT_OK);
    board_ranks br;
    assert_int_equal(board_get_ranks(b, &br), MT_OK);
    assert_int_equal(br.n, 4);
    assert_int_equal(br.slowest, 1);
    for (int i = 0; i < 4; i++) assert_int_equal(br.r[i].rank, i);
    board_ranks_free(&br);
    /* the records of a world of 4 are 4 */
    assert_int_equal(board_post_ranks(b, r, 3), MT_EINVAL);
    board_destroy(b);
}

static void expert_loads_are_a_copy_of_the_latest_post(void **state)
{
    (void)state;
    board *b;
    assert_int_equal(board_create(&b, 1), MT_OK);
    board_experts e;
    assert_int_equal(board_get_experts(b, &e), MT_OK);
    assert_int_equal(e.step, 0);
    board_experts_free(&e);
    int layer[2] = {1, 3};
    int64_t load[2 * 4] = {1, 2, 3, 4, 10, 0, 0, 6};
    float bias[2 * 4] = {0.5f, -0.5f, 0, 0, 0.25f, 0, 0, -0.25f};
    board_experts p = {.run_id = 1, .step = 5, .n_layers = 2, .n_experts = 4, .have_bias = 1,
                       .layer = layer, .load = load, .bias = bias};
    assert_int_equal(board_post_experts(b, &p), MT_OK);
    load[0] = 999; /* the post was copied */
    assert_int_equal(board_get_experts(b, &e), MT_OK);
    assert_int_equal(e.step, 5);
    assert_int_equal(e.n_layers, 2);
    assert_int_equal(e.layer[1], 3);
    assert_int_equal(e.load[0], 1);
    assert_int_equal(e.load[7], 6);
    assert_true(e.have_bias && e.bias[4] == 0.25f);
    board_experts_free(&e);
    /* a later post replaces it, whatever its shape; no bias this time */
    int layer3[3] = {1, 2, 3};
    int64_t load3[3 * 8];
    for (int i = 0; i < 24; i++) load3[i] = i;
    board_experts q = {.run_id = 1, .step = 6, .n_layers = 3, .n_experts = 8, .layer = layer3,
                       .load = load3};
    assert_int_equal(board_post_experts(b, &q), MT_OK);
    assert_int_equal(board_get_experts(b, &e), MT_OK);
    assert_int_equal(e.step, 6);
    assert_int_equal(e.n_layers * e.n_experts, 24);
    assert_int_equal(e.load[23], 23);
    assert_false(e.have_bias);
    board_experts_free(&e);
    board_new_run(b, 2);
    assert_int_equal(board_get_experts(b, &e), MT_OK);
    assert_int_equal(e.step, 0);
    assert_int_equal(e.run_id, 2);
    board_experts_free(&e);
    board_destroy(b);
}

static svc_ckpt ckpt_at(const char *path, int64_t step)
{
    svc_ckpt c;
    memset(&c, 0, sizeof c);
    c.valid = 1;
    c.step = step;
    snprintf(c.path, sizeof c.path, "%s", path);
    return c;
}

static void save_records_join_a_listing_by_path(void **state)
{
    (void)state;
    board *b;
    assert_int_equal(board_create(&b, 1), MT_OK);
    svc_ckpt s = ckpt_at("/w/ck/step_00000004", 4);
    s.write_ms = 812.5;
    s.stall_ms = 12.25;
    s.have_layout = 1;
    s.layout.dp = 2;
    snprintf(s.verify, sizeof s.verify, "running");
    board_note_save(b, &s);
    board_set_verify(b, "/w/ck/step_00000004", "ok");
    board_set_verify(b, "/w/ck/step_00000099", "ok"); /* not saved here: ignored */
    svc_ckpt list[2] = {ckpt_at("/w/ck/step_00000002", 2), ckpt_at("/w/ck/step_00000004", 4)};
    board_fill_saves(b, list, 2);
    assert_true(list[0].write_ms == 0 && !list[0].verify[0] && !list[0].have_layout);
    assert_true(list[1].write_ms == 812.5 && list[1].stall_ms == 12.25);
    assert_string_equal(list[1].verify, "ok");
    assert_true(list[1].have_layout && list[1].layout.dp == 2);
    /* the newest BOARD_SAVES are remembered */
    for (int i = 0; i < BOARD_SAVES + 1; i++) {
        char p[64];
        snprintf(p, sizeof p, "/w/ck/step_%08d", 100 + i);
        svc_ckpt c = ckpt_at(p, 100 + i);
        c.write_ms = i + 1;
        board_note_save(b, &c);
    }
    svc_ckpt old = ckpt_at("/w/ck/step_00000100", 100), last = ckpt_at("/w/ck/step_00000164", 164);
    board_fill_saves(b, &old, 1);
    board_fill_saves(b, &last, 1);
    assert_true(old.write_ms == 0);
    assert_true(last.write_ms == BOARD_SAVES + 1);
    board_destroy(b);
}

/* ---- what the pages make of it ------------------------------------------------------ */

typedef struct fixture {
    char root[1024];
    metrics_hub *hub;
    control *ctl;
    service sv;
} fixture;

static void fixture_open(fixture *f, int world)
{
    char tmp[1024], wd[1100];
    mt_test_tmpdir(tmp, sizeof tmp, "test_board");
    snprintf(wd, sizeof wd, "%s/wd", tmp);
    assert_int_equal(wd_open(wd, f->root, sizeof f->root), MT_OK);
    assert_int_equal(hub_create(&f->hub, 16), MT_OK);
    control_opts o = {.workdir = f->root, .rank = 0, .world = world, .hub = f->hub};
    assert_int_equal(control_create(&f->ctl, &o), MT_OK);
    assert_int_equal(service_init(&f->sv, f->ctl, f->hub, f->root), MT_OK);
    assert_non_null(control_board(f->ctl));
}

static void fixture_close(fixture *f)
{
    service_cleanup(&f->sv);
    control_destroy(f->ctl);
    hub_destroy(f->hub);
}

static void post_experts(board *b, int n_layers, int n_experts)
{
    int *layer = calloc((size_t)n_layers, sizeof *layer);
    int64_t *load = calloc((size_t)n_layers * n_experts, sizeof *load);
    float *bias = calloc((size_t)n_layers * n_experts, sizeof *bias);
    for (int l = 0; l < n_layers; l++) layer[l] = l + 1;
    for (int i = 0; i < n_layers * n_experts; i++) {
        load[i] = 10 + i;
        bias[i] = 0.007f;
    }
    board_experts e = {.run_id = 1, .step = 9, .n_layers = n_layers, .n_experts = n_experts,
                       .have_bias = 1, .layer = layer, .load = load, .bias = bias};
    assert_int_equal(board_post_experts(b, &e), MT_OK);
    free(layer);
    free(load);
    free(bias);
}

static void metrics_page_has_per_rank_series_and_capped_per_expert_ones(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, 2);
    board *b = control_board(f.ctl);
    board_rank r[2] = {rank_rec(9, 400, 100, 5000), rank_rec(9, 401, 250, 7000)};
    assert_int_equal(board_post_ranks(b, r, 2), MT_OK);
    post_experts(b, 2, 8);
    char *page;
    size_t len;
    assert_int_equal(prom_render(&f.sv, &page, &len), MT_OK);
    assert_contains(page, "moetrain_rank_compute_duration_seconds{rank=\"1\"} 0.25\n");
    assert_contains(page, "moetrain_rank_memory_peak_bytes{rank=\"0\"} 10000\n");
    assert_contains(page, "moetrain_slowest_rank 1\n");
    assert_null(strstr(page, "moetrain_rank_pipeline_idle_ratio")); /* no pipeline */
    assert_contains(page, "moetrain_expert_series_capped 0\n");
    assert_contains(page, "moetrain_expert_tokens{layer=\"2\",expert=\"7\"} 25\n");
    assert_contains(page, "moetrain_router_bias{layer=\"1\",expert=\"0\"}");
    free(page);
    /* 5 layers x 256 experts = 1280 series each: past the cap, left out */
    post_experts(b, 5, 256);
    assert_int_equal(prom_render(&f.sv, &page, &len), MT_OK);
    assert_contains(page, "moetrain_expert_series_capped 1\n");
    assert_null(strstr(page, "moetrain_expert_tokens{"));
    assert_null(strstr(page, "moetrain_router_bias{"));
    free(page);
    /* pipeline stages: each rank's measured idle next to its stage's prediction */
    for (int i = 0; i < 2; i++) {
        r[i].pp_size = 2;
        r[i].pp_stage = i;
        r[i].pp_idle = 0.25 * (i + 1);
        r[i].pp_bubble = 0.125;
        r[i].pp_bubble_measured = 0.0625 * (i + 1);
    }
    assert_int_equal(board_post_ranks(b, r, 2), MT_OK);
    assert_int_equal(prom_render(&f.sv, &page, &len), MT_OK);
    assert_contains(page, "moetrain_rank_pipeline_idle_ratio{rank=\"1\",stage=\"1\"} 0.5\n");
    assert_contains(page, "moetrain_rank_pipeline_predicted_idle_ratio{rank=\"0\",stage=\"0\"} "
                          "0.125\n");
    assert_contains(page, "moetrain_rank_pipeline_measured_cost_idle_ratio{rank=\"1\",stage=\"1\"} "
                          "0.125\n");
    free(page);
    fixture_close(&f);
}

static void dashboard_json_has_ranks_and_the_expert_heat_map(void **state)
{
    (void)state;
    fixture f;
    fixture_open(&f, 2);
    board *b = control_board(f.ctl);
    dash_access acc = {.mode = "loopback", .allowed = 1, .why = ""};
    char *s;
    size_t len;
    /* before any step: empty ranks, no slowest, no layers */
    assert_int_equal(dash_status_json(&f.sv, &acc, &s, &len), MT_OK);
    json_t *v = json_loads(s, 0, NULL);
    assert_non_null(v);
    assert_int_equal(json_array_size(json_object_get(v, "rank_stats")), 0);
    assert_true(json_is_null(json_object_get(v, "slowest_rank")));
    json_decref(v);
    free(s);
    assert_int_equal(dash_experts_json(&f.sv, &s, &len), MT_OK);
    v = json_loads(s, 0, NULL);
    assert_int_equal(json_integer_value(json_object_get(v, "step")), 0);
    assert_int_equal(json_array_size(json_object_get(v, "layers")), 0);
    json_decref(v);
    free(s);

    board_rank r[2] = {rank_rec(9, 400, 300, 5000), rank_rec(9, 401, 250, 7000)};
    assert_int_equal(board_post_ranks(b, r, 2), MT_OK);
    post_experts(b, 2, 8);
    assert_int_equal(dash_status_json(&f.sv, &acc, &s, &len), MT_OK);
    v = json_loads(s, 0, NULL);
    json_t *rs = json_object_get(v, "rank_stats");
    assert_int_equal(json_array_size(rs), 2);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(rs, 1), "mem_in_use")), 7000);
    assert_int_equal(json_integer_value(json_object_get(v, "slowest_rank")), 0);
    json_decref(v);
    free(s);
    assert_int_equal(dash_experts_json(&f.sv, &s, &len), MT_OK);
    v = json_loads(s, 0, NULL);
    assert_non_null(v);
    assert_int_equal(json_integer_value(json_object_get(v, "step")), 9);
    assert_int_equal(json_integer_value(json_object_get(v, "experts")), 8);
    json_t *l1 = json_array_get(json_object_get(v, "layers"), 1);
    assert_int_equal(json_integer_value(json_object_get(l1, "layer")), 2);
    assert_int_equal(json_array_size(json_object_get(l1, "load")), 8);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(l1, "load"), 0)), 18);
    assert_true(json_real_value(json_object_get(l1, "mean")) == 21.5);
    /* a float bias as its shortest decimal */
    assert_contains(s, "\"bias\":[0.007,");
    json_decref(v);
    free(s);
    fixture_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(gather_over_a_world_of_one_posts_its_record),
        cmocka_unit_test(slowest_rank_has_the_longest_own_work_lowest_on_ties),
        cmocka_unit_test(expert_loads_are_a_copy_of_the_latest_post),
        cmocka_unit_test(save_records_join_a_listing_by_path),
        cmocka_unit_test(metrics_page_has_per_rank_series_and_capped_per_expert_ones),
        cmocka_unit_test(dashboard_json_has_ranks_and_the_expert_heat_map),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
