/* test_dashboard_units.c - the dashboard's text formats without a server:
 * Last-Event-ID parsing, the Server-Sent Events frames of hub events, the
 * ring of recent log lines and its mt_log tap, the JSON of log lines and of
 * control answers. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <math.h>

#include "base/mt_log.h"
#include "base/mt_status.h"
#include "service/dash_json.h"
#include "service/log_ring.h"
#include "test_util.h"

static void event_id_of_this_daemon_gives_the_seq(void **state)
{
    (void)state;
    uint64_t seq = 0;
    assert_int_equal(dash_parse_event_id("a1b2c3-42", "a1b2c3", &seq), 1);
    assert_int_equal(seq, 42);
    assert_int_equal(dash_parse_event_id("a1b2c3-0", "a1b2c3", &seq), 1);
    assert_int_equal(seq, 0);
}

static void foreign_or_malformed_event_ids_are_refused(void **state)
{
    (void)state;
    uint64_t seq = 7;
    const char *bad[] = {"ffffff-42",   /* another daemon */
                         "a1b2c3d-42",  /* our epoch is only a prefix of its */
                         "a1b2c3-",     "a1b2c3-x", "a1b2c3-4x", "a1b2c3--4", "a1b2c3-+4",
                         "a1b2c3-18446744073709551616", /* 2^64 */
                         "a1b2c3", "42", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (dash_parse_event_id(bad[i], "a1b2c3", &seq) != 0) {
            fprintf(stderr, "accepted %s\n", bad[i]);
            fail();
        }
    }
    assert_int_equal(dash_parse_event_id(NULL, "a1b2c3", &seq), 0);
    assert_int_equal(seq, 7); /* untouched */
}

/* Splits an SSE frame into its field lines; checks it ends in a blank line
 * and returns the data line's JSON. */
static json_t *frame_data(const char *f, size_t len, const char *want_id, const char *want_event)
{
    assert_int_equal(strlen(f), len);
    assert_true(len > 2 && f[len - 1] == '\n' && f[len - 2] == '\n');
    char *copy = strndup(f, len - 2);
    const char *id = NULL, *event = NULL, *data = NULL;
    int lines = 0;
    for (char *save, *l = strtok_r(copy, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        lines++;
        if (!strncmp(l, "id: ", 4)) id = l + 4;
        else if (!strncmp(l, "event: ", 7)) event = l + 7;
        else if (!strncmp(l, "data: ", 6)) data = l + 6;
        else if (strncmp(l, "retry: ", 7)) fail_msg("unexpected line %s", l);
    }
    if (want_id) assert_string_equal(id, want_id);
    else assert_null(id);
    assert_string_equal(event, want_event);
    assert_non_null(data);
    json_error_t err;
    json_t *v = json_loads(data, 0, &err);
    if (!v) fail_msg("data is not JSON (%s): %s", err.text, data);
    assert_true(lines == (want_id ? 3 : 2) || !strncmp(f, "retry: ", 7));
    free(copy);
    return v;
}

static void step_event_frame_has_id_event_and_one_json_data_line(void **state)
{
    (void)state;
    /* a job name with a quote and a newline must not break the frame */
    hub_event *e = hub_event_new(3, "job \"x\"\nend", HUB_STEP);
    e->seq = 17;
    e->u.step.step = 5;
    e->u.step.total_steps = 100;
    e->u.step.loss = 2.5;
    e->u.step.valid_loss = NAN;
    e->u.step.mfu = INFINITY;
    e->u.step.n_moe = 2;
    e->u.step.moe_layer[0] = 1;
    e->u.step.moe_layer[1] = 2;
    e->u.step.load_max[1] = 3.25;
    char *f;
    size_t n;
    assert_int_equal(dash_event_frame("ep0", e, &f, &n), MT_OK);
    json_t *v = frame_data(f, n, "ep0-17", "step");
    assert_int_equal(json_integer_value(json_object_get(v, "seq")), 17);
    assert_int_equal(json_integer_value(json_object_get(v, "run_id")), 3);
    assert_string_equal(json_string_value(json_object_get(v, "job")), "job \"x\"\nend");
    json_t *m = json_object_get(v, "step");
    assert_int_equal(json_integer_value(json_object_get(m, "step")), 5);
    assert_true(json_real_value(json_object_get(m, "loss")) == 2.5);
    /* JSON has no NaN or Inf: unmeasured and non-finite values are null */
    assert_true(json_is_null(json_object_get(m, "valid_loss")));
    assert_true(json_is_null(json_object_get(m, "mfu")));
    json_t *load = json_object_get(m, "expert_load");
    assert_int_equal(json_array_size(load), 2);
    assert_true(json_real_value(json_object_get(json_array_get(load, 1), "max")) == 3.25);
    json_decref(v);
    free(f);
    free(e);
}

static void state_and_checkpoint_frames_carry_their_records(void **state)
{
    (void)state;
    hub_event *e = hub_event_new(1, "j", HUB_STATE);
    e->seq = 2;
    e->u.state.state = SVC_PAUSED;
    e->u.state.step = 9;
    snprintf(e->u.state.message, sizeof e->u.state.message, "paused at step 9");
    char *f;
    size_t n;
    assert_int_equal(dash_event_frame("ep", e, &f, &n), MT_OK);
    json_t *v = frame_data(f, n, "ep-2", "state");
    assert_string_equal(json_string_value(json_object_get(v, "state")), "PAUSED");
    assert_int_equal(json_integer_value(json_object_get(v, "step")), 9);
    json_decref(v);
    free(f);
    free(e);

    e = hub_event_new(1, "j", HUB_CHECKPOINT);
    e->seq = 3;
    e->u.ckpt.valid = 1;
    e->u.ckpt.step = 9;
    e->u.ckpt.bytes = 12345;
    snprintf(e->u.ckpt.name, sizeof e->u.ckpt.name, "step_00000009");
    assert_int_equal(dash_event_frame("ep", e, &f, &n), MT_OK);
    v = frame_data(f, n, "ep-3", "checkpoint");
    json_t *c = json_object_get(v, "checkpoint");
    assert_string_equal(json_string_value(json_object_get(c, "name")), "step_00000009");
    assert_int_equal(json_integer_value(json_object_get(c, "bytes")), 12345);
    assert_true(json_is_null(json_object_get(c, "layout")));
    json_decref(v);
    free(f);
    free(e);
}

static void hello_and_gap_frames_have_no_id(void **state)
{
    (void)state;
    char *f;
    size_t n;
    assert_int_equal(dash_hello_frame("ep", 1, 44, &f, &n), MT_OK);
    /* no id: they must not move the browser's resume point */
    assert_true(!strncmp(f, "retry: ", 7));
    json_t *v = frame_data(f, n, NULL, "hello");
    assert_true(json_is_true(json_object_get(v, "resumed")));
    assert_int_equal(json_integer_value(json_object_get(v, "head")), 44);
    assert_string_equal(json_string_value(json_object_get(v, "epoch")), "ep");
    json_decref(v);
    free(f);
    assert_int_equal(dash_gap_frame(30, 31, &f, &n), MT_OK);
    v = frame_data(f, n, NULL, "gap");
    assert_int_equal(json_integer_value(json_object_get(v, "missed")), 30);
    assert_int_equal(json_integer_value(json_object_get(v, "next")), 31);
    json_decref(v);
    free(f);
}

static void log_ring_keeps_the_last_lines_numbered(void **state)
{
    (void)state;
    log_ring *r;
    assert_int_equal(log_ring_create(&r), MT_OK);
    log_line *out = malloc(LOG_RING_LINES * sizeof *out);
    uint64_t next;
    assert_int_equal(log_ring_read(r, 0, out, LOG_RING_LINES, &next), 0);
    assert_int_equal(next, 1);
    char text[32];
    for (int i = 1; i <= LOG_RING_LINES + 44; i++) {
        int k = snprintf(text, sizeof text, "line %d", i);
        log_ring_add(r, MT_LOG_INFO, text, (size_t)k);
    }
    /* the oldest 44 fell out: a reader from the start gets 45.. in order */
    int n = log_ring_read(r, 0, out, LOG_RING_LINES, &next);
    assert_int_equal(n, LOG_RING_LINES);
    assert_int_equal(out[0].seq, 45);
    assert_string_equal(out[0].text, "line 45");
    assert_int_equal(out[n - 1].seq, LOG_RING_LINES + 44);
    assert_int_equal(next, LOG_RING_LINES + 45);
    /* a reader that saw up to seq 298 gets only what came after */
    n = log_ring_read(r, LOG_RING_LINES + 42, out, LOG_RING_LINES, &next);
    assert_int_equal(n, 2);
    assert_string_equal(out[1].text, "line 300");
    /* a long line is cut, not overflowing */
    char *big = malloc(4000);
    memset(big, 'x', 4000);
    log_ring_add(r, MT_LOG_WARN, big, 4000);
    n = log_ring_read(r, next - 1, out, LOG_RING_LINES, &next);
    assert_int_equal(n, 1);
    assert_int_equal(strlen(out[0].text), LOG_RING_LINE_CAP - 1);
    assert_int_equal(out[0].level, MT_LOG_WARN);
    free(big);
    free(out);
    log_ring_destroy(r);
}

static void log_tap_copies_written_lines_until_detached(void **state)
{
    (void)state;
    log_ring *r;
    assert_int_equal(log_ring_create(&r), MT_OK);
    log_ring_attach(r);
    MT_LOGW("tapped %d", 1);
    MT_LOGD("below the level: not written, not tapped");
    log_ring_detach(r);
    MT_LOGW("after detach");
    log_line out[4];
    uint64_t next;
    int n = log_ring_read(r, 0, out, 4, &next);
    assert_int_equal(n, 1);
    assert_int_equal(out[0].level, MT_LOG_WARN);
    assert_contains(out[0].text, "] tapped 1");
    assert_true(out[0].text[strlen(out[0].text) - 1] != '\n');
    log_ring_destroy(r);
}

static void logs_json_survives_bytes_that_are_not_utf8(void **state)
{
    (void)state;
    log_ring *r;
    assert_int_equal(log_ring_create(&r), MT_OK);
    const char *bad = "path /data/\xff\xfe bad";
    log_ring_add(r, MT_LOG_ERROR, bad, strlen(bad));
    log_ring_add(r, MT_LOG_INFO, "ok", 2);
    char *s;
    size_t n;
    assert_int_equal(dash_logs_json(r, 0, &s, &n), MT_OK);
    json_t *v = json_loads(s, 0, NULL);
    assert_non_null(v);
    json_t *lines = json_object_get(v, "lines");
    assert_int_equal(json_array_size(lines), 2);
    json_t *l0 = json_array_get(lines, 0);
    assert_string_equal(json_string_value(json_object_get(l0, "level")), "error");
    assert_string_equal(json_string_value(json_object_get(l0, "text")), "path /data/?? bad");
    assert_int_equal(json_integer_value(json_object_get(v, "next")), 3);
    json_decref(v);
    free(s);
    log_ring_destroy(r);
}

static void command_json_says_refused_queued_or_done(void **state)
{
    (void)state;
    char *s;
    size_t n;
    assert_int_equal(dash_command_json("pause", MT_ESTATE, "already paused", NULL, &s, &n), MT_OK);
    assert_string_equal(s, "{\"command\":\"pause\",\"ok\":false,\"error\":\"already paused\"}");
    free(s);
    assert_int_equal(dash_command_json("save", 0, NULL, NULL, &s, &n), MT_OK);
    assert_string_equal(s, "{\"command\":\"save\",\"ok\":true,\"queued\":true}");
    free(s);
    ctl_result res;
    memset(&res, 0, sizeof res);
    res.step = 12;
    res.state = SVC_RUNNING;
    assert_int_equal(dash_command_json("resume", 0, NULL, &res, &s, &n), MT_OK);
    assert_string_equal(s, "{\"command\":\"resume\",\"ok\":true,\"queued\":false,\"step\":12,"
                           "\"state\":\"RUNNING\",\"checkpoint\":null}");
    free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(event_id_of_this_daemon_gives_the_seq),
        cmocka_unit_test(foreign_or_malformed_event_ids_are_refused),
        cmocka_unit_test(step_event_frame_has_id_event_and_one_json_data_line),
        cmocka_unit_test(state_and_checkpoint_frames_carry_their_records),
        cmocka_unit_test(hello_and_gap_frames_have_no_id),
        cmocka_unit_test(log_ring_keeps_the_last_lines_numbered),
        cmocka_unit_test(log_tap_copies_written_lines_until_detached),
        cmocka_unit_test(logs_json_survives_bytes_that_are_not_utf8),
        cmocka_unit_test(command_json_says_refused_queued_or_done),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
