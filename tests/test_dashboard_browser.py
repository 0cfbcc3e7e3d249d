#!/usr/bin/python3
"""test_dashboard_browser.py - the dashboard in a real browser.

Debian's chromium, headless, driven through chromedriver's WebDriver HTTP
API (plain urllib: no npm, no Python package), opens the page of a
moetraind that runs the tiny job with a token, and checks:

  - the page shows the live run: state RUNNING, the charts fill;
  - without the token the page is read-only (buttons disabled), with it
    entered in the page the controls work;
  - Pause in the page pauses the job: the page shows PAUSED, and so does
    gRPC (the moetrain CLI's GetStatus);
  - the charts then hold every step the job ran, once each (points ==
    steps == the step gRPC reports, no duplicate, no gap);
  - the numbers the page shows for that step are the metrics stream's (the
    same step read from /events, and /metrics);
  - the layer x expert map holds the paused step's loads (/api/experts),
    the ranks table rank 0's memory as gRPC reports it;
  - the page fits a phone's width (no horizontal scrolling);
  - Resume and Stop (with its confirmation) work from the page; the final
    checkpoint is listed with its save time, then as verified;
  - no script error and no Content-Security-Policy violation happened;
and saves screenshots (desktop and phone) under the build folder.

Exit status 77 (ctest: skipped) when chromium or chromedriver is not
installed: a machine without a browser reports the test skipped, never
passed. deploy/setup.sh installs both.

    test_dashboard_browser.py BUILD_DIR SOURCE_DIR SCRATCH_DIR
"""
import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

BUILD, SOURCE, TMP = sys.argv[1:4]
TOKEN = "browser-token-0123456789abcdef"
SHOTS = os.path.join(BUILD, "tests")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
if not CHROMIUM or not DRIVER:
    print("SKIP: no %s (Debian packages chromium and chromium-driver; deploy/setup.sh "
          "installs them)" % " and no ".join(
              n for n, p in (("chromium", CHROMIUM), ("chromedriver", DRIVER)) if not p))
    sys.exit(77)

shutil.rmtree(TMP, ignore_errors=True)
os.makedirs(TMP)
os.makedirs(SHOTS, exist_ok=True)
procs = []
checks = 0


session = None  # the WebDriver session, once there is one


def cleanup():
    # Close the browser through its driver first: a driver killed outright
    # leaves chromium running, orphaned.
    if session:
        try:
            urllib.request.urlopen(urllib.request.Request(
                WD + "/session/" + session, method="DELETE"), timeout=30).read()
        except Exception:  # noqa: BLE001  (it may be what failed)
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def fail(what):
    print("FAIL:", what, file=sys.stderr)
    try:
        shot("dashboard-failure.png")
    except Exception:  # noqa: BLE001  (the browser may be what failed)
        pass
    cleanup()
    log = os.path.join(TMP, "daemon.log")
    if os.path.exists(log):
        with open(log) as f:
            sys.stderr.write("---- daemon log\n" + f.read()[-3000:])
    sys.exit(1)


def ok(cond, what):
    global checks
    if not cond:
        fail(what)
    checks += 1
    print("ok -", what)


def wait_for(fn, what, timeout=60.0, every=0.2):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    fail("%s (waited %.0f s; last: %r)" % (what, timeout, last))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- the daemon ---------------------------------------------------------------------

subprocess.run([os.path.join(BUILD, "engine", "moetrain-data"), "synth", "--output",
                os.path.join(TMP, "data", "syn"), "--vocab", "64", "--tokens", "200000",
                "--seed", "3"], check=True, stdout=subprocess.DEVNULL)
with open(os.path.join(TMP, "token"), "w") as f:
    f.write(TOKEN + "\n")
os.chmod(os.path.join(TMP, "token"), 0o600)
ready = os.path.join(TMP, "ready")
env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
daemon = subprocess.Popen(
    [os.path.join(BUILD, "service", "moetraind"), "--listen", "127.0.0.1:0", "--http",
     "127.0.0.1:0", "--workdir", os.path.join(TMP, "wd"), "--ready-file", ready,
     "--token-file", os.path.join(TMP, "token"), "--threads", "1",
     "--job", os.path.join(SOURCE, "deploy", "examples", "tiny-cpu.json"),
     "--set", "data.path=" + os.path.join(TMP, "data", "syn"), "--set", "train.steps=100000",
     "--set", "batch.seq_len=32", "--set", "data.valid_interval=5",
     "--set", "train.log_interval=10", "--set", "name=browser-job"],
    stdout=open(os.path.join(TMP, "daemon.log"), "w"), stderr=subprocess.STDOUT, env=env)
procs.append(daemon)
wait_for(lambda: os.path.exists(ready) or daemon.poll() is not None, "moetraind ready", 60)
if daemon.poll() is not None:
    fail("moetraind exited at start")
addr = dict(line.strip().split("=", 1) for line in open(ready) if "=" in line)
HTTP, GRPC = addr["http"], addr["grpc"]
BASE = "http://" + HTTP


def grpc_status():
    out = subprocess.run([os.path.join(BUILD, "service", "moetrain"), "--server", GRPC,
                          "--timeout", "30", "status", "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def http_get(path):
    return urllib.request.urlopen(BASE + path, timeout=30).read().decode()


def sse_step(step):
    """The step event of `step` as the metrics stream (/events) sends it."""
    req = urllib.request.Request(BASE + "/events?from_step=%d" % step)
    with urllib.request.urlopen(req, timeout=30) as r:
        event = None
        for raw in r:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "step":
                ev = json.loads(line[6:])
                if ev["step"]["step"] == step:
                    return ev["step"]
                if ev["step"]["step"] > step:
                    break
    fail("step %d not in the metrics stream" % step)


def prom_value(name):
    for line in http_get("/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    fail("%s not in /metrics" % name)


# ---- the browser -------------------------------------------------------------------

dport = free_port()
driver = subprocess.Popen([DRIVER, "--port=%d" % dport, "--log-path=" + os.path.join(TMP, "chromedriver.log")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
procs.append(driver)
WD = "http://127.0.0.1:%d" % dport


def wd(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(WD + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read().decode() or "{}").get("value")
    except urllib.error.HTTPError as e:
        fail("WebDriver %s %s: %s" % (method, path, e.read().decode()[:500]))


def wd_try(method, path, body=None):
    """The value, or None when the driver answers an error (no alert...)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(WD + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read().decode() or "{}").get("value")
    except urllib.error.HTTPError:
        return None


def driver_up():
    try:
        urllib.request.urlopen(WD + "/status", timeout=2)
        return True
    except OSError:
        return False


wait_for(driver_up, "chromedriver answers", 30)
caps = {"capabilities": {"alwaysMatch": {
    "browserName": "chrome",
    "goog:loggingPrefs": {"browser": "ALL"},
    "goog:chromeOptions": {"binary": CHROMIUM, "args": [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--window-size=1280,1000", "--user-data-dir=" + os.path.join(TMP, "profile")]}}}}
session = wd("POST", "/session", caps)["sessionId"]
S = "/session/" + session
ELEM = "element-6066-11e4-a52e-4f735466cecf"


def js(script, *args):
    return wd("POST", S + "/execute/sync", {"script": script, "args": list(args)})


def el(css):
    return wd("POST", S + "/element", {"using": "css selector", "value": css})[ELEM]


def click(css):
    wd("POST", S + "/element/%s/click" % el(css), {})


def attr(css, name):
    return js("const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
              css, name)


def text(css):
    return js("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", css)


def disabled(css):
    return js("return document.querySelector(arguments[0]).disabled;", css)


def shot(name):
    png = base64.b64decode(wd("GET", S + "/screenshot"))
    path = os.path.join(SHOTS, name)
    with open(path, "wb") as f:
        f.write(png)
    return path


def page_state():
    return attr("#state", "data-state")


wd("POST", S + "/url", {"url": BASE + "/"})

# the live run
wait_for(lambda: page_state() == "RUNNING", "the page shows the job RUNNING", 60)
wait_for(lambda: int(attr("#c-loss", "data-points") or 0) >= 10, "the loss chart fills", 120)
ok(True, "the page shows the live run: state RUNNING, %s steps in the loss chart"
   % attr("#c-loss", "data-points"))
ok(attr("#conn", "data-conn") == "live", "the event stream is live")
ok(text("#job") == "browser-job", "the job name is shown")

# read-only without the token
wait_for(lambda: "read-only" in (text("#access") or ""), "the page says read-only without the token")
ok(all(disabled(b) for b in ("#btn-pause", "#btn-resume", "#btn-save", "#btn-stop")),
   "without the token every control is disabled (read-only)")
code = None
try:
    urllib.request.urlopen(urllib.request.Request(BASE + "/api/pause", data=b"", method="POST",
                                                  headers={"X-Moetrain-Control": "1"}), timeout=30)
except urllib.error.HTTPError as e:
    code = e.code
ok(code == 401, "a control POST without the token is refused (401), got %s" % code)

# the token, entered once in the page
wd("POST", S + "/element/%s/value" % el("#token"), {"text": TOKEN})
click("#token-use")
wait_for(lambda: not disabled("#btn-pause"), "Pause is enabled once the token is entered")
ok("controls enabled" in text("#access"), "with the token the page says the controls are enabled")
ok(TOKEN not in js("return performance.getEntriesByType('resource').map(e => e.name).join(' ') + location.href;"),
   "the token appears in no URL the page loaded")

# pause from the page: the page and gRPC agree
click("#btn-pause")
wait_for(lambda: page_state() == "PAUSED", "the page shows PAUSED after Pause", 60)
st = wait_for(lambda: (lambda s: s if s["state"] == "JOB_STATE_PAUSED" else None)(grpc_status()),
              "gRPC GetStatus says PAUSED", 30)
step = int(st["step"])
ok(True, "Pause in the page: the page and gRPC both say PAUSED (at step %d)" % step)

# every step once, and the page's numbers are the stream's
wait_for(lambda: int(attr("#step", "data-step") or 0) == step, "the page's step is gRPC's (%d)" % step, 30)
wait_for(lambda: int(attr("#c-loss", "data-last-step") or 0) == step,
         "the charts reach step %d" % step, 30)
for cid in ("#c-loss", "#c-lr", "#c-gnorm", "#c-tps", "#c-tflops", "#c-mem"):
    pts = int(attr(cid, "data-points"))
    ok(pts == step, "chart %s holds %d points for %d steps (each step once)" % (cid, pts, step))
d = js("return {dup: mtDashboard.duplicates, gaps: mtDashboard.gaps, n: mtDashboard.points()};")
ok(d["dup"] == 0 and d["gaps"] == 0, "no step arrived twice and no event was lost (%r)" % d)
ok(int(attr("#heat", "data-steps")) == min(step, 240), "the heat map holds the recent steps")

# the layer x expert map of the last step and the ranks table (latest-only snapshots)
ex = json.loads(http_get("/api/experts"))
wait_for(lambda: int(attr("#experts", "data-step") or 0) == ex["step"],
         "the expert map shows the loads of step %d" % ex["step"], 30)
ok(ex["step"] == step and attr("#experts", "data-layers") == str(len(ex["layers"])) == "2"
   and attr("#experts", "data-experts") == "8",
   "the expert map is 2 MoE layers x 8 experts of the paused step %d" % step)
mem = st["rankStats"][0]["memInUse"]
wait_for(lambda: attr("#ranks tbody tr", "data-mem") == str(mem),
         "the ranks table shows rank 0's memory in use as gRPC does (%s bytes)" % mem, 30)
ok(js("return document.querySelectorAll('#ranks tbody tr').length;") == 1, "one rank, one row")

m = sse_step(step)
for tile, key in (("#t-loss", "loss"), ("#t-lr", "lr"), ("#t-gnorm", "grad_norm"),
                  ("#t-tps", "tokens_per_s"), ("#t-tflops", "tflops")):
    shown = float(attr(tile, "data-value"))
    ok(shown == m[key], "%s shows %s = %r, the metrics stream's value for step %d" % (tile, key, shown, step))
    vis = float(text(tile))
    ok(abs(vis - m[key]) <= 1e-3 * abs(m[key]), "%s's text %r rounds %r" % (tile, text(tile), m[key]))
ok(abs(float(attr("#t-loss", "data-value")) - prom_value("moetrain_loss")) <= 1e-8 * abs(m["loss"]),
   "the loss shown agrees with /metrics' moetrain_loss")
ok(float(attr("#t-skipped", "data-value")) == m["skipped_total"], "skipped steps shown = the stream's")

# the whole page in one picture: a window as tall as the page
h = js("return document.documentElement.scrollHeight;")
wd("POST", S + "/window/rect", {"width": 1280, "height": min(4000, h + 140)})
time.sleep(1.0)
path = shot("dashboard.png")
ok(os.path.getsize(path) > 10000, "desktop screenshot saved: %s (%d bytes)" % (path, os.path.getsize(path)))

# a phone
wd("POST", S + "/window/rect", {"width": 390, "height": 844})
WIDTH = "return [document.documentElement.scrollWidth, window.innerWidth];"
# the charts follow the window after a short debounce: give them time
deadline = time.time() + 10
w = js(WIDTH)
while w[0] > w[1] + 1 and time.time() < deadline:
    time.sleep(0.2)
    w = js(WIDTH)
if w[0] > w[1] + 1:
    wide = js("""return [...document.querySelectorAll('body *')].filter(e =>
        e.getBoundingClientRect().right > window.innerWidth + 1 ||
        e.scrollWidth > e.clientWidth + 1).slice(0, 8).map(e =>
        e.tagName + '#' + e.id + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right));""")
    fail("on a phone-sized window the page scrolls sideways (%d > %d): %r" % (w[0], w[1], wide))
ok(True, "on a phone-sized window the page does not scroll sideways (%d <= %d)" % tuple(w))
path = shot("dashboard-phone.png")
ok(os.path.getsize(path) > 5000, "phone screenshot saved: %s" % path)
wd("POST", S + "/window/rect", {"width": 1280, "height": 1000})

# resume, then stop with the confirmation
click("#btn-resume")
wait_for(lambda: page_state() == "RUNNING", "the page shows RUNNING after Resume", 60)
wait_for(lambda: int(grpc_status()["step"]) > step, "the job advances after Resume", 60)
ok(True, "Resume in the page: the job runs on")
click("#btn-stop")
msg = wait_for(lambda: wd_try("GET", S + "/alert/text"), "the Stop confirmation dialog", 10)
ok("Stop browser-job" in msg, "Stop asks for confirmation first: %r" % msg)
wd("POST", S + "/alert/accept", {})
wait_for(lambda: page_state() == "IDLE", "the page shows IDLE after Stop", 60)
st = grpc_status()
ok(st["state"] == "JOB_STATE_IDLE" and st.get("outcome") == "stopped",
   "Stop in the page: gRPC says IDLE, outcome stopped")
wait_for(lambda: "done at step" in (text("#cmd-result") or ""), "the page reports the stop's result")
wait_for(lambda: js("return document.querySelectorAll('#ckpts tbody tr td').length;") >= 5,
         "the final checkpoint is listed", 30)
ok(True, "the checkpoint list shows the final checkpoint: %r" % text("#ckpts tbody tr"))
wait_for(lambda: attr("#ckpts tbody tr td[data-verify]", "data-verify") == "ok",
         "the final checkpoint is listed as verified", 30)
ok(True, "the final checkpoint's save time and verify result are listed: %r" % text("#ckpts tbody tr"))

# nothing went wrong in the page
errs = js("return mtDashboard.errors;")
ok(errs == [], "no script error and no CSP violation in the page: %r" % errs)
try:
    logs = wd_try("POST", S + "/se/log", {"type": "browser"}) or []
except Exception:  # noqa: BLE001
    logs = []
severe = [entry["message"] for entry in logs if entry.get("level") == "SEVERE"]
ok(severe == [], "no SEVERE message in the browser console: %r" % severe[:3])

wd("DELETE", S)
driver.terminate()
driver.wait()
daemon.send_signal(signal.SIGTERM)
ok(daemon.wait(timeout=60) == 0, "moetraind exits 0 on SIGTERM")
print("test_dashboard_browser: %d checks passed (%s)" % (checks, subprocess.run(
    [CHROMIUM, "--version"], capture_output=True, text=True).stdout.strip()))
