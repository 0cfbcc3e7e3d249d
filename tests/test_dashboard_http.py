#!/usr/bin/python3
"""test_dashboard_http.py - the dashboard's HTTP side without a browser.

Two moetraind run the tiny job: one with a token, one without (and a
16-event metrics ring). Checked:

  /events (Server-Sent Events)
  - a new stream starts with `hello` (not resumed) and replays the current
    job from its start: its first state event, then steps 1, 2, 3, ...;
  - a stream resumed with Last-Event-ID (or ?last_event_id=) continues at
    the next event: across the two connections every step arrives exactly
    once, in order;
  - the step events carry the values the JSONL sink wrote for those steps;
  - ?from_step=N starts the job's steps at N;
  - an id of another daemon (epoch) or a malformed one starts afresh;
  - a stream that fell out of the ring gets a `gap` with the count lost,
    then continues with the oldest kept event, and /metrics counts them;
  - SIGTERM ends open streams, and the daemon exits 0.
  the controls (POST /api/...)
  - need X-Moetrain-Control: 1, the token in the Authorization header (not
    in the URL), and no foreign Origin; then pause / resume / save work and
    gRPC sees the same state; an illegal one is 409 with the reason;
  - without a token, only a loopback Host is accepted;
  /api/status, /api/checkpoints, /api/logs, /, /assets: their contents.

    test_dashboard_http.py BUILD_DIR SOURCE_DIR SCRATCH_DIR
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

BUILD, SOURCE, TMP = sys.argv[1:4]
TOKEN = "events-token-0123456789abcdef"
shutil.rmtree(TMP, ignore_errors=True)
os.makedirs(TMP)
procs = []
checks = 0


def fail(what):
    print("FAIL:", what, file=sys.stderr)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for name in ("a", "b"):
        log = os.path.join(TMP, name, "daemon.log")
        if os.path.exists(log):
            with open(log) as f:
                sys.stderr.write("---- daemon %s log\n%s" % (name, f.read()[-2000:]))
    sys.exit(1)


def ok(cond, what):
    global checks
    if not cond:
        fail(what)
    checks += 1
    print("ok -", what)


def wait_for(fn, what, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    fail(what + " (waited %.0f s)" % timeout)


subprocess.run([os.path.join(BUILD, "engine", "moetrain-data"), "synth", "--output",
                os.path.join(TMP, "data", "syn"), "--vocab", "64", "--tokens", "200000",
                "--seed", "4"], check=True, stdout=subprocess.DEVNULL)
with open(os.path.join(TMP, "token"), "w") as f:
    f.write(TOKEN + "\n")
os.chmod(os.path.join(TMP, "token"), 0o600)


def start_daemon(name, extra):
    d = os.path.join(TMP, name)
    os.makedirs(d)
    ready = os.path.join(d, "ready")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
    p = subprocess.Popen(
        [os.path.join(BUILD, "service", "moetraind"), "--listen", "127.0.0.1:0", "--http",
         "127.0.0.1:0", "--workdir", os.path.join(d, "wd"), "--ready-file", ready,
         "--threads", "1", "--job", os.path.join(SOURCE, "deploy", "examples", "tiny-cpu.json"),
         "--set", "data.path=" + os.path.join(TMP, "data", "syn"),
         "--set", "train.steps=100000", "--set", "batch.seq_len=32",
         "--set", "data.valid_interval=0", "--set", "train.log_interval=1000",
         "--set", "name=job-" + name] + extra,
        stdout=open(os.path.join(d, "daemon.log"), "w"), stderr=subprocess.STDOUT, env=env)
    procs.append(p)
    wait_for(lambda: os.path.exists(ready) or p.poll() is not None, "moetraind %s ready" % name)
    if p.poll() is not None:
        fail("moetraind %s exited at start" % name)
    addr = dict(line.strip().split("=", 1) for line in open(ready) if "=" in line)
    return p, "http://" + addr["http"], addr["grpc"]


jsonl = os.path.join(TMP, "a.jsonl")
da, A, grpc_a = start_daemon("a", ["--token-file", os.path.join(TMP, "token"),
                                   "--metrics-jsonl", jsonl])
db, B, _ = start_daemon("b", ["--metrics-ring", "16"])


class Stream:
    """A Server-Sent Events reader: next() gives (id, event, data dict)."""

    def __init__(self, url, headers=None):
        self.r = urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                        timeout=30)
        ok(self.r.headers.get("Content-Type", "").startswith("text/event-stream"),
           "%s is an event stream" % url.split("/", 3)[-1])

    def next(self):
        eid, event, data = None, None, None
        while True:
            raw = self.r.readline()
            if not raw:
                return None
            line = raw.decode().rstrip("\n")
            if line == "":
                if data is not None:
                    return eid, event, json.loads(data)
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(": ")
            if field == "id":
                eid = value
            elif field == "event":
                event = value
            elif field == "data":
                data = value

    def close(self):
        self.r.close()


def steps_until(s, last_step):
    """Reads step events until `last_step`; returns [(id, step)], and checks
    only state/checkpoint/step events come."""
    out = []
    while True:
        eid, event, data = s.next()
        if event == "step":
            out.append((eid, data["step"]["step"], data))
            if data["step"]["step"] >= last_step:
                return out
        elif event not in ("state", "checkpoint"):
            fail("unexpected event %s %r" % (event, data))


def status(base, headers=None):
    r = urllib.request.urlopen(urllib.request.Request(base + "/api/status", headers=headers or {}),
                               timeout=30)
    return json.loads(r.read().decode())


# ---- replay from the start, then resume after the last id ----------------------------

s = Stream(A + "/events")
eid, event, hello = s.next()
ok(event == "hello" and hello["resumed"] is False and eid is None,
   "a new stream begins with hello, not resumed, without an id")
epoch = hello["epoch"]
eid, event, first = s.next()
ok(event == "state" and first["state"] == "RUNNING" and first["seq"] == 1
   and eid == "%s-1" % epoch, "then the job's first event (seq 1, started), id EPOCH-SEQ")
got = steps_until(s, 5)
ok([st for _, st, _ in got] == [1, 2, 3, 4, 5], "then steps 1, 2, 3, 4, 5 in order")
last_id = got[-1][0]
s.close()

wait_for(lambda: status(A)["step"] >= 12, "job a passes step 12")
s = Stream(A + "/events", {"Last-Event-ID": last_id})
eid, event, hello = s.next()
ok(event == "hello" and hello["resumed"] is True, "a stream with our Last-Event-ID is resumed")
more = steps_until(s, 12)
ok(int(more[0][0].split("-")[1]) == int(last_id.split("-")[1]) + 1,
   "the resumed stream starts at the event after Last-Event-ID")
all_steps = [st for _, st, _ in got] + [st for _, st, _ in more]
ok(all_steps == list(range(1, 13)), "across the reconnect every step 1..12 came exactly once")
s.close()

s = Stream(A + "/events?last_event_id=" + more[-1][0])
eid, event, hello = s.next()
nxt = steps_until(s, 13)
ok(hello["resumed"] is True and nxt[0][1] == 13, "?last_event_id= resumes the same way")
s.close()

with open(jsonl) as f:
    rows = {r["step"]: r for r in map(json.loads, f)}
same = all(data["step"][k] == rows[st][k] for _, st, data in got + more
           for k in ("loss", "lr", "grad_norm", "tokens", "mtp_loss", "expert_load"))
ok(same, "step events hold the JSONL sink's values for the same steps")

s = Stream(A + "/events?from_step=7")
s.next()
first_step = steps_until(s, 7)
ok([st for _, st, _ in first_step] == [7], "?from_step=7 skips the job's steps before 7")
s.close()

for bad in ("0123456789ab-3", epoch + "-x", "garbage"):
    s = Stream(A + "/events", {"Last-Event-ID": bad})
    _, _, hello = s.next()
    _, event, ev = s.next()
    ok(hello["resumed"] is False and ev["seq"] == 1,
       "Last-Event-ID %r (another daemon, or malformed) replays from the start" % bad)
    s.close()

# ---- falling out of the ring ------------------------------------------------------------

wait_for(lambda: status(B)["step"] >= 30, "job b passes step 30")
missed0 = [float(l.split()[1]) for l in urllib.request.urlopen(B + "/metrics").read().decode()
           .splitlines() if l.startswith("moetrain_metrics_missed_events_total ")][0]
s = Stream(B + "/events")
_, _, hb = s.next()
s.close()
s = Stream(B + "/events", {"Last-Event-ID": hb["epoch"] + "-1"})
_, _, hello = s.next()
eid, event, gap = s.next()
ok(event == "gap" and eid is None and gap["missed"] > 0,
   "a stream resumed after an event the 16-event ring dropped gets a gap (%d lost)" % gap["missed"])
eid, event, ev = s.next()
ok(ev["seq"] == gap["next"] == 2 + gap["missed"],
   "and continues with the oldest kept event (seq %d)" % ev["seq"])
s.close()
missed1 = [float(l.split()[1]) for l in urllib.request.urlopen(B + "/metrics").read().decode()
           .splitlines() if l.startswith("moetrain_metrics_missed_events_total ")][0]
ok(missed1 - missed0 == gap["missed"], "/metrics counts the events the stream missed")

# ---- the controls ---------------------------------------------------------------------


def post(base, path, headers):
    req = urllib.request.Request(base + path, data=b"", method="POST", headers=headers)
    try:
        r = urllib.request.urlopen(req, timeout=120)
        return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


X = {"X-Moetrain-Control": "1"}
AUTH = {"Authorization": "Bearer " + TOKEN}
code, body = post(A, "/api/pause", AUTH)
ok(code == 403 and "X-Moetrain-Control" in body, "a control POST without X-Moetrain-Control: 403")
code, _ = post(A, "/api/pause", X)
ok(code == 401, "without the token: 401")
code, _ = post(A, "/api/pause", dict(X, Authorization="Bearer wrong-token-0123456789"))
ok(code == 401, "with a wrong token: 401")
code, _ = post(A, "/api/pause?token=" + TOKEN, X)
ok(code == 401, "the token in the URL is not accepted: 401")
code, _ = post(A, "/api/pause", dict(X, Origin="http://evil.example", **AUTH))
ok(code == 403, "from a page of another origin, even with the token: 403")
ok(status(A)["control"] == {"mode": "token", "allowed": False,
                            "why": "the daemon has a token: enter it to use the controls"},
   "/api/status tells a caller without the token that it is read-only")
ok(status(A, AUTH)["control"]["allowed"] is True, "and one with the token that it may")

code, body = post(A, "/api/pause", dict(X, **AUTH))
j = json.loads(body)
ok(code == 200 and j["ok"] and j["state"] == "PAUSED", "pause with the token: 200, PAUSED at step %s" % j.get("step"))
cli = subprocess.run([os.path.join(BUILD, "service", "moetrain"), "--server", grpc_a, "status",
                      "--json"], capture_output=True, text=True, check=True)
ok(json.loads(cli.stdout)["state"] == "JOB_STATE_PAUSED", "gRPC GetStatus agrees: PAUSED")
code, body = post(A, "/api/pause", dict(X, **AUTH))
ok(code == 409 and "already paused" in json.loads(body)["error"],
   "pause when paused: 409 with the reason")
code, body = post(A, "/api/save", dict(X, **AUTH))
saved = json.loads(body)["checkpoint"]
ok(code == 200 and saved["step"] == j["step"], "save: 200 with the checkpoint (%s)" % saved["name"])
ck = json.loads(urllib.request.urlopen(A + "/api/checkpoints").read().decode())
ok([c["name"] for c in ck["checkpoints"]] == [saved["name"]] and ck["checkpoints"][0]["bytes"] > 0,
   "/api/checkpoints lists it with its size")
code, body = post(A, "/api/resume", dict(X, **AUTH))
ok(code == 200 and json.loads(body)["state"] == "RUNNING", "resume: 200, RUNNING")
code, _ = post(A, "/api/launch", dict(X, **AUTH))
ok(code == 404, "an unknown control: 404")

code, body = post(B, "/api/pause", dict(X, Host="evil.example"))
ok(code == 403 and "loopback" in body, "no token: a request naming a foreign Host is refused")
code, body = post(B, "/api/pause", X)
ok(code == 200 and json.loads(body)["state"] == "PAUSED", "no token: a loopback request may pause")
ok(status(B)["control"]["mode"] == "loopback", "/api/status says the mode is loopback")

# ---- the rest of /api and the files ----------------------------------------------------

lg = json.loads(urllib.request.urlopen(A + "/api/logs").read().decode())
seqs = [l["seq"] for l in lg["lines"]]
ok(seqs == sorted(seqs) and lg["next"] == seqs[-1] + 1 and any("paused" in l["text"] for l in lg["lines"]),
   "/api/logs gives the recent lines in order (the pause among them)")
lg2 = json.loads(urllib.request.urlopen(A + "/api/logs?after=%d" % seqs[-2]).read().decode())
ok([l["seq"] for l in lg2["lines"]][:1] == [seqs[-1]], "?after=N gives only the lines after N")

r = urllib.request.urlopen(A + "/")
page = r.read().decode()
ok("default-src 'self'" in r.headers["Content-Security-Policy"] and "<title>moetrain</title>" in page,
   "GET / serves the page with a same-origin-only CSP")
for path, ctype in (("/assets/dashboard.js", "text/javascript"), ("/assets/uPlot.iife.min.js", "text/javascript"),
                    ("/assets/uPlot.min.css", "text/css"), ("/assets/dashboard.css", "text/css")):
    r = urllib.request.urlopen(A + path)
    ok(r.headers["Content-Type"].startswith(ctype) and len(r.read()) > 1000,
       "%s is served as %s" % (path, ctype))
try:
    urllib.request.urlopen(A + "/assets/nothing.js")
    code = 200
except urllib.error.HTTPError as e:
    code = e.code
ok(code == 404, "an unknown file: 404")
try:
    urllib.request.urlopen(urllib.request.Request(A + "/", data=b"x", method="PUT"))
    code = 200
except urllib.error.HTTPError as e:
    code = e.code
ok(code == 405, "PUT: 405")

# ---- shutdown ends the streams -----------------------------------------------------------

s = Stream(A + "/events?from_step=1000000")
s.next()
t0 = time.time()
da.send_signal(signal.SIGTERM)
while s.next() is not None:
    pass
ok(time.time() - t0 < 30, "SIGTERM ends an open event stream (%.1f s)" % (time.time() - t0))
ok(da.wait(timeout=60) == 0, "daemon a exits 0")
db.send_signal(signal.SIGTERM)
ok(db.wait(timeout=60) == 0, "daemon b exits 0")
print("test_dashboard_http: %d checks passed" % checks)
