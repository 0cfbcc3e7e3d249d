/* dashboard.js - the code of moetraind's page (service/web/README.md).
 *
 * Data comes from three places of the daemon's HTTP endpoint:
 *   /events       Server-Sent Events of the metrics hub: every step's
 *                 metrics, state changes, checkpoints, reshards. A new page
 *                 gets the current job's whole retained history first, then
 *                 live events; the browser resumes a broken stream with
 *                 Last-Event-ID, so each event arrives once (a step seen
 *                 twice is counted in mtDashboard.duplicates, and ignored).
 *   /api/status   polled: state, progress, layout, every rank's last step
 *                 (step time, own work, memory; the slowest named), whether
 *                 the controls may be used by this page (token / loopback).
 *   /api/experts  polled: the last step's tokens per expert and router bias
 *                 of every MoE layer (the layer x expert heat map).
 *   /api/logs, /api/checkpoints   polled: recent log lines, checkpoints
 *                 (with each save's time and verify result).
 * Controls are POSTs with the token in the Authorization header (kept in
 * sessionStorage for this tab, never put in a URL).
 */
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const TOKEN_KEY = "moetrain-token";
  const HEAT_STEPS = 240;       // steps shown in the expert-load heat map
  const ETA_WINDOW = 20;        // steps averaged for the ETA
  const LOG_KEEP = 300;         // lines kept in the log list

  /* What tests (and curious people) can read: window.mtDashboard. */
  const dash = {
    errors: [], duplicates: 0, gaps: 0, missed: 0, run: 0, connects: 0,
    points: () => S.step.length,
  };
  window.mtDashboard = dash;
  const noteError = (what) => { dash.errors.push(String(what)); };
  window.addEventListener("error", (e) => noteError(e.message || e));
  window.addEventListener("unhandledrejection", (e) => noteError(e.reason));
  document.addEventListener("securitypolicyviolation",
    (e) => noteError("CSP: " + e.violatedDirective + " " + e.blockedURI));

  /* ---- the series ---------------------------------------------------------------- */

  let S;       // column arrays, one entry per step
  let heat;    // recent steps' expert load: {step, layers[], max[], min[], cv[]}
  let lastStepMs;
  function resetData() {
    S = { step: [], loss: [], valid: [], mtp: [], lr: [], gnorm: [], tps: [], tflops: [], mfu: [],
          mem: [], peak: [], skipped: [] };
    heat = [];
    lastStepMs = [];
  }
  resetData();

  const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);

  function fmt(v, digits) {
    if (v === null || v === undefined || !isFinite(v)) return "—";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-4)) return v.toExponential(digits - 1).replace(/\.?0+e/, "e");
    return Number(v.toPrecision(digits)).toString();
  }
  function fmtBytes(b) {
    if (!isFinite(b) || b <= 0) return "—";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return b.toFixed(b < 10 ? 2 : 1) + " " + u[i];
  }
  function fmtDuration(s) {
    if (!isFinite(s) || s < 0) return "—";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    return h ? h + "h " + String(m).padStart(2, "0") + "m" : m ? m + "m " + String(r).padStart(2, "0") + "s" : r + "s";
  }
  function setTile(id, v, text) {
    const el = $(id);
    el.textContent = text;
    el.dataset.value = v === null || v === undefined ? "" : String(v);
    el.title = text;
  }

  /* ---- charts (uPlot) -------------------------------------------------------------- */

  const charts = {};
  const C = { blue: "#2f6fde", green: "#1f9d55", orange: "#d98e04", red: "#d64545", grey: "#8a93a6",
              purple: "#7b4bd6" };
  const line = (label, stroke, extra) => Object.assign(
    { label, stroke, width: 1.5, points: { show: false }, value: (u, v) => fmt(v, 5) }, extra || {});

  const chartDefs = {
    "c-loss": () => ({
      scales: { x: { time: false }, y: $("loss-log").checked ? { distr: 3, log: 10 } : {} },
      series: [{ label: "step" }, line("train", C.blue),
               line("valid", C.orange, { spanGaps: true, points: { show: true, size: 5 } }),
               line("mtp", C.purple)],
      cols: () => {
        const pos = (a) => ($("loss-log").checked ? a.map((v) => (v > 0 ? v : null)) : a);
        return [S.step, pos(S.loss), pos(S.valid), pos(S.mtp)];
      },
    }),
    "c-lr": () => ({ series: [{ label: "step" }, line("lr", C.green)], cols: () => [S.step, S.lr] }),
    "c-gnorm": () => ({ series: [{ label: "step" }, line("grad norm", C.red)], cols: () => [S.step, S.gnorm] }),
    "c-tps": () => ({ series: [{ label: "step" }, line("tokens/s", C.blue)], cols: () => [S.step, S.tps] }),
    "c-tflops": () => ({
      scales: { mfu: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.2 : 1] } },
      series: [{ label: "step" }, line("TFLOPS/GPU", C.green),
               line("MFU", C.orange, { scale: "mfu", value: (u, v) => (v === null ? "—" : (100 * v).toFixed(1) + "%") })],
      axes: [{}, {}, { scale: "mfu", side: 1, grid: { show: false },
                       values: (u, vs) => vs.map((v) => (100 * v).toFixed(0) + "%") }],
      cols: () => [S.step, S.tflops, S.mfu],
    }),
    "c-mem": () => ({
      scales: { n: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.2)] } },
      series: [{ label: "step" }, line("in use", C.blue), line("peak", C.grey, { dash: [4, 3] }),
               line("skipped (total)", C.red, { scale: "n", value: (u, v) => (v === null ? "—" : String(v)) })],
      axes: [{}, {}, { scale: "n", side: 1, grid: { show: false } }],
      cols: () => [S.step, S.mem, S.peak, S.skipped],
    }),
  };

  function chartSize(el) {
    const w = Math.max(200, el.clientWidth || 300);
    return { width: w, height: Math.round(Math.min(260, Math.max(170, w * 0.42))) };
  }

  // y tick labels with the fewest digits (3 or more) that keep neighbours
  // apart: 0.0015 next to 0.002, not 0.002 twice
  const yTicks = (u, vs) => {
    for (let d = 3; d < 8; d++) {
      const t = vs.map((v) => fmt(v, d));
      if (new Set(t).size === t.length) return t;
    }
    return vs.map((v) => fmt(v, 8));
  };

  function makeChart(id) {
    const el = $(id);
    if (charts[id]) { charts[id].u.destroy(); el.textContent = ""; }
    const def = chartDefs[id]();
    const axes = def.axes || [{}, {}];
    // y axis as wide as its longest label: ticks and gap (15 px) plus about
    // 7.5 px a character of the 12 px axis font
    const fit = (u, vals) => (vals ? Math.max(40, 22 + 7.5 * Math.max(...vals.map((v) => String(v).length))) : 40);
    axes[1] = Object.assign({ size: fit, values: yTicks }, axes[1]);
    const opts = Object.assign(chartSize(el), {
      scales: Object.assign({ x: { time: false } }, def.scales || {}),
      series: def.series,
      axes,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
    });
    charts[id] = { u: new uPlot(opts, def.cols(), el), cols: def.cols };
  }

  let drawPending = false;
  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    setTimeout(draw, 200);
  }
  function draw() {
    drawPending = false;
    for (const id in charts) {
      charts[id].u.setData(charts[id].cols());
      const el = $(id);
      el.dataset.points = String(S.step.length);
      el.dataset.lastStep = String(S.step.length ? S.step[S.step.length - 1] : 0);
    }
    drawHeat();
  }

  /* ---- the expert-load heat map ------------------------------------------------------- */

  function heatColor(kind, v, hi) {
    // white at balance, toward red for overload (max, cv), toward blue for starvation (min)
    let t, rgb;
    if (kind === "min") { t = Math.min(1, Math.max(0, 1 - v)); rgb = [47, 111, 222]; }
    else if (kind === "max") { t = Math.min(1, Math.max(0, (v - 1) / Math.max(1e-9, hi - 1))); rgb = [214, 69, 69]; }
    else { t = Math.min(1, Math.max(0, v / Math.max(1e-9, hi))); rgb = [214, 69, 69]; }
    const mix = (c) => Math.round(255 + (c - 255) * t);
    return "rgb(" + mix(rgb[0]) + "," + mix(rgb[1]) + "," + mix(rgb[2]) + ")";
  }

  function drawHeat() {
    const cv = $("heat");
    const kind = $("heat-kind").value;
    const n = heat.length;
    cv.dataset.steps = String(n);
    const layers = n ? heat[n - 1].layers : [];
    const rows = Math.max(1, layers.length);
    const dpr = window.devicePixelRatio || 1;
    const cssW = Math.max(200, cv.parentElement.clientWidth);
    const rowH = Math.max(6, Math.min(24, Math.floor(240 / rows)));
    const cssH = rows * rowH + 18;
    cv.style.height = cssH + "px";
    cv.width = Math.round(cssW * dpr);
    cv.height = Math.round(cssH * dpr);
    const g = cv.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    g.font = "10px system-ui, sans-serif";
    g.fillStyle = "#69738a";
    if (!n || !layers.length) {
      g.fillText("no MoE layers reported yet", 4, 14);
      $("heat-legend").textContent = "";
      return;
    }
    // columns at least as wide as 1/40 of the map, so a young run is visible
    const left = 34, w = cssW - left, colW = w / Math.min(HEAT_STEPS, Math.max(n, 40));
    let hi = kind === "max" ? 2 : kind === "cv" ? 0.5 : 1;
    for (const h of heat) for (const v of h[kind]) if (v !== null && v > hi) hi = v;
    const x0 = left;
    for (let c = 0; c < n; c++) {
      const h = heat[c];
      for (let r = 0; r < h.layers.length && r < rows; r++) {
        const v = h[kind][r];
        g.fillStyle = v === null ? "#eee" : heatColor(kind, v, hi);
        g.fillRect(x0 + c * colW, r * rowH, Math.ceil(colW), rowH - 1);
      }
    }
    g.fillStyle = "#69738a";
    for (let r = 0; r < rows; r++) if (rowH >= 9 || r % 4 === 0) g.fillText("L" + layers[r], 2, r * rowH + rowH - 2);
    g.fillText("step " + heat[0].step, x0, cssH - 4);
    const lastLabel = "step " + heat[n - 1].step;
    const lx = Math.max(x0 + 60, x0 + n * colW - g.measureText(lastLabel).width);
    if (n > 1) g.fillText(lastLabel, lx, cssH - 4);
    const desc = { max: "most loaded expert / mean load: white = balanced (1), red = " + fmt(hi, 3) + "x",
                   min: "least loaded expert / mean load: white = balanced (1), blue = starved (0)",
                   cv: "coefficient of variation of the experts' loads: white = 0, red = " + fmt(hi, 3) };
    $("heat-legend").textContent = desc[kind] + ". Rows: MoE layers; columns: the last " + n + " steps.";
  }

  /* ---- the layer x expert map of the last step (/api/experts) --------------------------- */

  let experts = null;   // last /api/experts answer with layers

  function expertColor(kind, v, hi) {
    // load / mean: white at balance, red toward the most loaded, blue toward idle;
    // bias: green raised (the router favours it), purple lowered
    let t, rgb;
    if (kind === "load") {
      if (v >= 1) { t = Math.min(1, (v - 1) / Math.max(1e-9, hi - 1)); rgb = [214, 69, 69]; }
      else { t = Math.min(1, Math.max(0, 1 - v)); rgb = [47, 111, 222]; }
    } else {
      t = Math.min(1, Math.abs(v) / Math.max(1e-12, hi));
      rgb = v >= 0 ? [31, 157, 85] : [123, 75, 214];
    }
    const mix = (c) => Math.round(255 + (c - 255) * t);
    return "rgb(" + mix(rgb[0]) + "," + mix(rgb[1]) + "," + mix(rgb[2]) + ")";
  }

  // the value drawn in a cell: tokens over the layer's mean, or the bias
  function expertValue(kind, ly, x) {
    if (kind === "bias") return ly.bias ? ly.bias[x] : null;
    return ly.mean > 0 ? ly.load[x] / ly.mean : null;
  }

  let expertGeom = null; // where the cells are, for the tooltip
  function drawExperts() {
    const cv = $("experts");
    const kindSel = $("experts-kind");
    const e = experts;
    const layers = e ? e.layers : [];
    const E = e ? e.experts : 0;
    cv.dataset.step = String(e ? e.step : 0);
    cv.dataset.layers = String(layers.length);
    cv.dataset.experts = String(E);
    kindSel.disabled = !(e && e.have_bias);
    if (kindSel.disabled) kindSel.value = "load";
    const kind = kindSel.value;
    const dpr = window.devicePixelRatio || 1;
    const cssW = Math.max(200, cv.parentElement.clientWidth);
    const rows = Math.max(1, layers.length);
    const rowH = Math.max(5, Math.min(22, Math.floor(300 / rows)));
    const cssH = rows * rowH + 16;
    cv.style.height = cssH + "px";
    cv.width = Math.round(cssW * dpr);
    cv.height = Math.round(cssH * dpr);
    const g = cv.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    g.font = "10px system-ui, sans-serif";
    g.fillStyle = "#69738a";
    expertGeom = null;
    if (!layers.length || !E) {
      g.fillText("no expert loads yet", 4, 14);
      $("experts-legend").textContent = "";
      return;
    }
    const left = 34, colW = (cssW - left) / E;
    let hi = kind === "load" ? 2 : 1e-6;
    for (const ly of layers)
      for (let x = 0; x < E; x++) {
        const v = expertValue(kind, ly, x);
        if (v === null) continue;
        if (kind === "load" && v > hi) hi = v;
        if (kind === "bias" && Math.abs(v) > hi) hi = Math.abs(v);
      }
    for (let r = 0; r < layers.length; r++)
      for (let x = 0; x < E; x++) {
        const v = expertValue(kind, layers[r], x);
        g.fillStyle = v === null ? "#eee" : expertColor(kind, v, hi);
        g.fillRect(left + x * colW, r * rowH, Math.max(1, Math.ceil(colW) - (colW > 4 ? 1 : 0)), rowH - 1);
      }
    g.fillStyle = "#69738a";
    for (let r = 0; r < layers.length; r++)
      if (rowH >= 9 || r % 4 === 0) g.fillText("L" + layers[r].layer, 2, r * rowH + rowH - 2);
    g.fillText("expert 0", left, cssH - 3);
    const lastLabel = "expert " + (E - 1);
    if (E > 1) g.fillText(lastLabel, Math.max(left + 60, cssW - g.measureText(lastLabel).width), cssH - 3);
    expertGeom = { left, colW, rowH, E };
    $("experts-legend").textContent = (kind === "load"
      ? "tokens routed to each expert over the layer's mean: white = balanced (1), red = " + fmt(hi, 3) +
        "x, blue = idle (0)"
      : "router bias after the step (aux-loss-free balancing): green raised, purple lowered, darkest = " +
        fmt(hi, 3)) + ". Step " + e.step + "; rows: MoE layers, columns: the " + E + " routed experts.";
  }

  function expertTooltip(ev) {
    const cv = $("experts");
    if (!expertGeom || !experts) { cv.title = ""; return; }
    const rc = cv.getBoundingClientRect();
    const x = Math.floor((ev.clientX - rc.left - expertGeom.left) / expertGeom.colW);
    const r = Math.floor((ev.clientY - rc.top) / expertGeom.rowH);
    const ly = experts.layers[r];
    if (!ly || x < 0 || x >= expertGeom.E) { cv.title = ""; return; }
    cv.title = "layer " + ly.layer + ", expert " + x + ": " + ly.load[x] + " tokens (" +
      fmt(ly.mean > 0 ? ly.load[x] / ly.mean : NaN, 3) + " x mean)" +
      (ly.bias ? ", bias " + fmt(ly.bias[x], 4) : "");
  }

  let expertsKey = "";
  async function refreshExperts() {
    try {
      const r = await fetch("/api/experts", { cache: "no-store" });
      if (!r.ok) return;
      const j = await r.json();
      const key = j.run_id + ":" + j.step;
      if (key === expertsKey) return;
      expertsKey = key;
      experts = j.step > 0 ? j : null;
      drawExperts();
    } catch (e) { /* away */ }
  }

  /* ---- every rank's last step (from /api/status) ----------------------------------------- */

  function fmtMs(ms) { return num(ms) === null ? "—" : fmt(ms, 4) + " ms"; }

  function showRanks(s) {
    const body = document.querySelector("#ranks tbody");
    const rs = s.rank_stats || [];
    body.textContent = "";
    let top = 0;
    for (const r of rs) top = Math.max(top, r.mem_peak);
    for (const r of rs) {
      const tr = document.createElement("tr");
      tr.dataset.rank = String(r.rank);
      tr.dataset.mem = String(r.mem_in_use);
      const slowest = rs.length > 1 && r.rank === s.slowest_rank;
      if (slowest) tr.className = "slowest";
      const cells = [String(r.rank), String(r.step), fmtMs(r.step_ms), fmtMs(r.compute_ms), null,
                     fmtBytes(r.mem_peak), slowest ? "slowest" : ""];
      for (const c of cells) {
        const td = document.createElement("td");
        if (c === null) { // memory: the number and a bar against the highest peak
          td.textContent = fmtBytes(r.mem_in_use);
          const bar = document.createElement("div"), fill = document.createElement("div");
          bar.className = "membar";
          fill.style.width = (top > 0 ? (100 * r.mem_in_use) / top : 0).toFixed(1) + "%";
          bar.appendChild(fill);
          td.appendChild(bar);
        } else {
          td.textContent = c;
        }
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    $("ranks-note").textContent = rs.length
      ? "own work: the time until the rank's gradients are ready for the data-parallel reduction; " +
        "the other ranks wait for the slowest there, so their step times are alike."
      : "no step yet";
  }

  /* ---- progress and tiles --------------------------------------------------------------- */

  let status = null;          // last /api/status
  let shownStep = 0, totalSteps = 0, curState = "";

  function showProgress(step, total) {
    shownStep = step;
    if (total) totalSteps = total;
    $("step").textContent = String(step);
    $("step").dataset.step = String(step);
    $("total").textContent = String(totalSteps);
    const p = totalSteps ? Math.min(1, step / totalSteps) : 0;
    $("pct").textContent = (100 * p).toFixed(1) + "%";
    $("pbar-fill").style.width = (100 * p).toFixed(2) + "%";
    let eta = "—";
    if (curState === "RUNNING" && lastStepMs.length && totalSteps > step) {
      const ms = lastStepMs.reduce((a, b) => a + b, 0) / lastStepMs.length;
      eta = fmtDuration(((totalSteps - step) * ms) / 1000);
    } else if (totalSteps && step >= totalSteps) {
      eta = "done";
    }
    $("eta").textContent = eta;
  }

  function showTiles(m, validLoss) {
    setTile("t-loss", num(m.loss), fmt(num(m.loss), 5));
    const vl = num(validLoss);
    setTile("t-valid", vl, fmt(vl, 5));
    setTile("t-lr", num(m.lr), fmt(num(m.lr), 4));
    setTile("t-gnorm", num(m.grad_norm), fmt(num(m.grad_norm), 4));
    setTile("t-tps", num(m.tokens_per_s), fmt(num(m.tokens_per_s), 4));
    setTile("t-tflops", num(m.tflops), fmt(num(m.tflops), 4));
    setTile("t-mfu", num(m.mfu), num(m.mfu) === null ? "—" : (100 * m.mfu).toFixed(1) + "%");
    setTile("t-ms", num(m.step_ms), num(m.step_ms) === null ? "—" : fmt(m.step_ms, 4) + " ms");
    setTile("t-mem", m.mem_in_use, fmtBytes(m.mem_in_use));
    $("t-mem-peak").textContent = "peak " + fmtBytes(m.mem_peak);
    setTile("t-skipped", m.skipped_total, String(m.skipped_total));
    $("tokens").textContent = Number(m.tokens).toLocaleString("en-US");
  }

  /* ---- events ------------------------------------------------------------------------ */

  let lastValid = null;
  const runsSeen = new Set(); // runs whose state events this page has seen

  /* A fresh replay (a new page, or a restarted daemon): the charts start
   * over. Log lines come from /api/logs, not the stream: they start over
   * only with another daemon (its lines are numbered from 1 again). */
  let epoch = "", lastEventSeq = 0;
  function resetAll(newEpoch) {
    resetData();
    lastValid = null;
    if (newEpoch !== epoch) {
      if (epoch) { $("log").textContent = ""; logAfter = 0; }
      epoch = newEpoch;
      lastEventSeq = 0;
    }
    scheduleDraw();
  }
  /* state / checkpoint / reshard events go to the log list once each, even
   * when a replay brings them again */
  function eventLog(ev, level, text) {
    if (ev.seq <= lastEventSeq) return;
    lastEventSeq = ev.seq;
    addLog(level, text);
  }

  function onStep(ev) {
    const m = ev.step;
    if (ev.run_id !== dash.run) {
      if (dash.run !== 0) resetData();
      dash.run = ev.run_id;
      lastValid = null;
      shownStep = 0;
    }
    const n = S.step.length;
    if (n && m.step <= S.step[n - 1]) { dash.duplicates++; return; }
    // a run's first event is its "started" state change: without one the
    // ring no longer held the run's beginning
    if (!n && m.step > 1 && !runsSeen.has(ev.run_id))
      addLog("warn", "the charts start at step " + m.step + ": the daemon keeps only its last " +
             "events (moetraind --metrics-ring N keeps more)");
    S.step.push(m.step);
    S.loss.push(num(m.loss));
    S.valid.push(num(m.valid_loss));
    S.mtp.push(m.mtp_loss > 0 ? m.mtp_loss : null);
    S.lr.push(num(m.lr));
    S.gnorm.push(num(m.grad_norm));
    S.tps.push(num(m.tokens_per_s));
    S.tflops.push(num(m.tflops));
    S.mfu.push(num(m.mfu));
    S.mem.push(m.mem_in_use / 2 ** 20);
    S.peak.push(m.mem_peak / 2 ** 20);
    S.skipped.push(m.skipped_total);
    if (num(m.valid_loss) !== null) lastValid = m.valid_loss;
    if (num(m.step_ms) !== null) {
      lastStepMs.push(m.step_ms);
      if (lastStepMs.length > ETA_WINDOW) lastStepMs.shift();
    }
    const el = m.expert_load || [];
    heat.push({ step: m.step, layers: el.map((l) => l.layer), max: el.map((l) => num(l.max)),
                min: el.map((l) => num(l.min)), cv: el.map((l) => num(l.cv)) });
    if (heat.length > HEAT_STEPS) heat.shift();
    showTiles(m, lastValid);
    $("job").textContent = ev.job;
    if (m.step >= shownStep) showProgress(m.step, m.total_steps);
    scheduleDraw();
  }

  function addLog(level, text) {
    const li = document.createElement("li");
    li.dataset.level = level;
    li.textContent = text;
    const list = $("log");
    list.appendChild(li);
    while (list.children.length > LOG_KEEP) list.removeChild(list.firstChild);
    list.scrollTop = list.scrollHeight;
  }

  function setState(st) {
    curState = st;
    $("state").textContent = st || "…";
    $("state").dataset.state = st || "";
    updateButtons();
  }

  let es = null, lastId = "";
  function connect() {
    const url = "/events" + (lastId ? "?last_event_id=" + encodeURIComponent(lastId) : "");
    es = new EventSource(url);
    const conn = (s) => { $("conn").dataset.conn = s; $("conn").textContent = s; };
    const track = (e) => { if (e.lastEventId) lastId = e.lastEventId; };
    es.addEventListener("hello", (e) => {
      const h = JSON.parse(e.data);
      dash.connects++;
      if (!h.resumed) resetAll(h.epoch);
      conn("live");
    });
    es.addEventListener("step", (e) => { track(e); onStep(JSON.parse(e.data)); });
    es.addEventListener("state", (e) => {
      track(e);
      const ev = JSON.parse(e.data);
      runsSeen.add(ev.run_id);
      eventLog(ev, "event", "[" + ev.job + "] " + ev.state + " at step " + ev.step + ": " + ev.message);
      setState(ev.state);
    });
    es.addEventListener("checkpoint", (e) => {
      track(e);
      const ev = JSON.parse(e.data), c = ev.checkpoint;
      if (c) eventLog(ev, "event", "checkpoint " + c.name + " (step " + c.step + ", " + fmtBytes(c.bytes) + ")");
      refreshCheckpoints();
      setTimeout(refreshCheckpoints, 3000); // its verify result comes a little later
    });
    es.addEventListener("reshard", (e) => {
      track(e);
      const ev = JSON.parse(e.data), r = ev.reshard;
      eventLog(ev, "event", "reshard " + r.source + " -> " + r.target + ": " + Math.round(100 * r.progress) + "% " + r.message);
    });
    es.addEventListener("gap", (e) => {
      const g = JSON.parse(e.data);
      dash.gaps++;
      dash.missed += g.missed;
      addLog("warn", g.missed + " older events were no longer kept by the daemon (its --metrics-ring)");
    });
    es.onerror = () => {
      conn(es.readyState === EventSource.CLOSED ? "down" : "reconnecting");
      if (es.readyState === EventSource.CLOSED) { es.close(); setTimeout(connect, 3000); }
    };
  }

  /* ---- polling ----------------------------------------------------------------------- */

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";
  const authHeaders = () => (token() ? { Authorization: "Bearer " + token() } : {});

  async function refreshStatus() {
    try {
      const r = await fetch("/api/status", { headers: authHeaders(), cache: "no-store" });
      if (!r.ok) throw new Error("status " + r.status);
      status = await r.json();
    } catch (e) {
      $("access").textContent = "the daemon does not answer";
      return;
    }
    const s = status;
    setState(s.state);
    $("job").textContent = s.job || "no job";
    if (s.layout) {
      const l = s.layout;
      $("layout").textContent = s.backend + " x" + s.ranks + " · tp" + l.tp + " pp" + l.pp + " ep" + l.ep +
        " etp" + l.etp + " dp" + l.dp + (l.pp > 1 ? " " + l.schedule : "");
    } else {
      $("layout").textContent = s.ranks + " rank(s)";
    }
    if (s.run_id !== dash.run || s.step >= shownStep) showProgress(s.step, s.total_steps);
    const err = s.error;
    $("error").hidden = !err;
    $("error").textContent = err;
    if (s.outcome && s.state === "IDLE") $("eta").textContent = s.outcome;
    $("version").textContent = "moetrain " + s.version + " · up " + fmtDuration(s.uptime_s);
    const c = s.control;
    $("access").textContent = c.allowed
      ? (c.mode === "token" ? "controls enabled (token)" : "controls enabled (loopback, no token set)")
      : "read-only: " + c.why;
    $("token-form").hidden = c.mode !== "token";
    showRanks(s);
    updateButtons();
  }

  function updateButtons() {
    const ok = !!(status && status.control.allowed) && !busy;
    const st = curState;
    $("btn-pause").disabled = !(ok && st === "RUNNING");
    $("btn-resume").disabled = !(ok && st === "PAUSED");
    $("btn-save").disabled = !(ok && (st === "RUNNING" || st === "PAUSED"));
    $("btn-stop").disabled = !(ok && (st === "RUNNING" || st === "PAUSED"));
  }

  let logAfter = 0;
  async function refreshLogs() {
    try {
      const r = await fetch("/api/logs?after=" + logAfter, { cache: "no-store" });
      if (!r.ok) return;
      const j = await r.json();
      for (const l of j.lines) addLog(l.level, l.text);
      logAfter = j.next - 1;
    } catch (e) { /* the daemon is away; the status line says so */ }
  }

  async function refreshCheckpoints() {
    const body = document.querySelector("#ckpts tbody");
    try {
      const r = await fetch("/api/checkpoints", { cache: "no-store" });
      if (!r.ok) { body.textContent = ""; $("ckpt-dir").textContent = "no job yet"; return; }
      const j = await r.json();
      $("ckpt-dir").textContent = j.directory;
      body.textContent = "";
      for (const c of j.checkpoints.slice().reverse()) {
        const tr = document.createElement("tr");
        const l = c.layout;
        const saved = num(c.write_ms) === null ? "—"
          : fmtMs(c.write_ms) + " (stall " + fmtMs(c.stall_ms) + ")";
        const cells = [c.name, String(c.step), fmtBytes(c.bytes),
                       l ? "tp" + l.tp + " pp" + l.pp + " ep" + l.ep + " dp" + l.dp : "",
                       saved, c.verify || "—", c.committed ? "committed" : "partial"];
        cells.forEach((t, i) => {
          const td = document.createElement("td");
          td.textContent = t;
          if (i === 5 && c.verify) { td.dataset.verify = c.verify; td.title = c.verify; }
          tr.appendChild(td);
        });
        body.appendChild(tr);
      }
      if (!j.checkpoints.length) {
        const tr = document.createElement("tr");
        const td = document.createElement("td");
        td.colSpan = 7;
        td.textContent = "none yet";
        tr.appendChild(td);
        body.appendChild(tr);
      }
    } catch (e) { /* away */ }
  }

  /* ---- controls ------------------------------------------------------------------------- */

  let busy = false;
  async function command(name, query) {
    busy = true;
    updateButtons();
    const out = $("cmd-result");
    out.dataset.ok = "";
    out.textContent = name + "…";
    try {
      const r = await fetch("/api/" + name + (query || ""), {
        method: "POST", cache: "no-store",
        headers: Object.assign({ "X-Moetrain-Control": "1" }, authHeaders()),
      });
      const text = await r.text();
      let j = null;
      try { j = JSON.parse(text); } catch (e) { /* a plain-text refusal */ }
      if (j && j.ok) {
        out.dataset.ok = "true";
        out.textContent = j.queued ? name + ": queued for the next step boundary"
          : name + ": done at step " + j.step + " (" + j.state + ")" +
            (j.checkpoint ? ", checkpoint " + j.checkpoint.name : "");
      } else {
        out.dataset.ok = "false";
        out.textContent = name + " refused (" + r.status + "): " + (j ? j.error : text.trim());
      }
    } catch (e) {
      out.dataset.ok = "false";
      out.textContent = name + ": " + e;
    }
    busy = false;
    await refreshStatus();
    refreshCheckpoints();
  }

  function wire() {
    $("btn-pause").addEventListener("click", () => command("pause"));
    $("btn-resume").addEventListener("click", () => command("resume"));
    $("btn-save").addEventListener("click", () => command("save"));
    $("btn-stop").addEventListener("click", () => {
      const save = $("stop-save").checked;
      const job = status ? status.job : "the job";
      if (window.confirm("Stop " + job + " at the next step boundary" +
                         (save ? ", saving a final checkpoint" : " without saving") + "?"))
        command("stop", save ? "?save=1" : "");
    });
    $("token-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const t = $("token").value.trim();
      if (t) sessionStorage.setItem(TOKEN_KEY, t);
      $("token").value = "";
      refreshStatus();
    });
    $("token-forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); refreshStatus(); });
    $("loss-log").addEventListener("change", () => { makeChart("c-loss"); draw(); });
    $("heat-kind").addEventListener("change", drawHeat);
    $("experts-kind").addEventListener("change", drawExperts);
    $("experts").addEventListener("mousemove", expertTooltip);
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        for (const id in charts) charts[id].u.setSize(chartSize($(id)));
        drawHeat();
        drawExperts();
      }, 150);
    });
  }

  function start() {
    if (typeof uPlot === "undefined") { noteError("uPlot did not load"); return; }
    for (const id in chartDefs) makeChart(id);
    wire();
    refreshStatus();
    refreshCheckpoints();
    refreshLogs();
    refreshExperts();
    connect();
    setInterval(refreshStatus, 2000);
    setInterval(refreshExperts, 2000);
    setInterval(refreshLogs, 2000);
    setInterval(refreshCheckpoints, 15000);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
