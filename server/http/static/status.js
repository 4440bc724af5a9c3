// Sluice's status page: reads /status.json every second and plots it with uPlot.
// No build step, no network beyond this server. When Sluice has API keys, the
// key is asked for once, kept in sessionStorage (this tab only) and sent as an
// Authorization header - never in a URL.
"use strict";

(() => {
  const KEY_STORE = "sluice.apiKey";
  const REFRESH_MS = 1000;
  const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const STATE_COLOURS = { ok: "#2ca02c", shedding: "#ff7f0e", critical: "#d62728",
    draining: "#9467bd", starting: "#7f7f7f" };

  // One entry per plot: the columns of /status.json it draws, [key, label].
  // A series whose column is absent or all empty is left out (no NVML, no held
  // backlog yet); `keyed` adds a series per key of a keyed column (refusal
  // reasons, callers); `onlyWithData` hides the plot until it has one.
  const CHARTS = [
    { id: "requests", title: "Requests", unit: "req/s", series: [["req_s", "finished"]] },
    { id: "tokens", title: "Tokens", unit: "tokens/s",
      series: [["prompt_tok_s", "prompt"], ["gen_tok_s", "generated"]] },
    { id: "queue", title: "Queue depth", unit: "requests",
      series: [["queued", "queued in Sluice"], ["backlog", "backlog held"],
        ["engine_running", "running in engine"], ["engine_waiting", "waiting in engine"]] },
    { id: "ttft", title: "Time to first token", unit: "ms",
      series: [["ttft_p50_ms", "p50"], ["ttft_p95_ms", "p95"]] },
    { id: "batches", title: "Released batch size", unit: "generations",
      series: [["batch_mean", "mean"], ["batch_max", "max"]] },
    { id: "kv", title: "KV-cache use", unit: "%", series: [["kv_pct", "KV cache"]], max: 100 },
    // The held backlog's cost (batching/room.py): engine steps that left budget and
    // a slot unused while Sluice held work that would have fit, and which rule
    // held work for how much of each second.
    { id: "steps", title: "Engine steps beside a held backlog", unit: "steps/s",
      series: [["steps_held_s", "steps"], ["underfed_s", "under-fed"]] },
    { id: "held", title: "Why the backlog waits", unit: "% of the time", series: [],
      keyed: "held_pct", onlyWithData: true, max: 100 },
    // Data-parallel ranks only (vLLM's --data-parallel-size): with one rank the
    // plots above are that rank's, and these stay hidden.
    { id: "rank-queue", title: "Engine queue per rank", unit: "requests", series: [],
      keyed: "rank_queue", onlyWithData: true },
    { id: "rank-kv", title: "KV-cache use per rank", unit: "%", series: [],
      keyed: "rank_kv_pct", onlyWithData: true, max: 100 },
    // Prefix placement (batching/prefix.py): where releases went and why, and
    // how much of each rank's prompts its prefix cache held.
    { id: "rank-placed", title: "Placements per rank", unit: "generations/s", series: [],
      keyed: "rank_placed_s", onlyWithData: true },
    { id: "rank-hits", title: "Prefix-cache hits per rank", unit: "% of prompt tokens",
      series: [], keyed: "rank_hit_pct", onlyWithData: true, max: 100 },
    // The prefix-warm order (docs/queue.md): releases made for warmth, the engine's
    // prefix-cache hits, and the longest any request was passed over.
    { id: "warm", title: "Released for a warm prefix", unit: "generations/s",
      series: [["warm_s", "released for warmth"]], onlyWithData: true },
    { id: "prefix-hits", title: "Prefix-cache hits", unit: "% of prompt tokens",
      series: [["prefix_hit_pct", "hits"]], onlyWithData: true, max: 100 },
    { id: "passed", title: "Longest passed over for warmth", unit: "s",
      series: [["passed_max_s", "longest"]], onlyWithData: true },
    // Several models (--models) only: each model's own numbers.
    { id: "model-req", title: "Requests per model", unit: "req/s", series: [],
      keyed: "model_req_s", onlyWithData: true },
    { id: "model-queue", title: "Running per model", unit: "requests", series: [],
      keyed: "model_running", onlyWithData: true },
    { id: "model-kv", title: "KV-cache use per model", unit: "%", series: [],
      keyed: "model_kv_pct", onlyWithData: true, max: 100 },
    // The Batch API (docs/bulk.md): lines done, and their share of the tokens.
    { id: "bulk-running", title: "Batches running", unit: "batches",
      series: [["batches_running", "running"]], onlyWithData: true },
    { id: "bulk", title: "Batch lines", unit: "lines/s", series: [["batch_lines_s", "done"]],
      onlyWithData: true },
    { id: "bulk-share", title: "Batch work's share of the tokens", unit: "%",
      series: [["batch_share_pct", "batch lines"]], onlyWithData: true, max: 100 },
    { id: "memory", title: "Free memory", unit: "GiB", scale: 1 / 1024, thresholds: true,
      series: [["gpu_free_mib", "free VRAM"], ["host_available_mib", "host available"]] },
    { id: "refusals", title: "Refusals by reason", unit: "req/s",
      series: [["refusals_s", "all"]], keyed: "refusals_by_reason" },
    { id: "callers", title: "Service per caller", unit: "tokens/s", series: [],
      keyed: "callers", onlyWithData: true },
    // The usage ledger (docs/operations.md, Usage): each caller's share of the
    // engine's step time.
    { id: "caller-engine", title: "Engine time per caller", unit: "engine s/s", series: [],
      keyed: "caller_engine_s", onlyWithData: true },
    { id: "adapters", title: "Requests per adapter", unit: "req/s", series: [],
      keyed: "adapters", onlyWithData: true },
    // Interactive first (docs/queue.md): background work left out of the engine's
    // steps for interactive work, and the step an interactive turn shares.
    { id: "background", title: "Background work held back", unit: "requests/s",
      series: [["background_held_s", "held (interactive waiting or prefilling)"],
               ["background_capped_s", "capped (step budget)"]], onlyWithData: true },
    { id: "step-class", title: "Engine step", unit: "ms",
      series: [["step_present_ms", "interactive work present"],
               ["step_absent_ms", "background only"]], onlyWithData: true },
  ];

  const $ = (id) => document.getElementById(id);
  const charts = new Map(); // id -> {plot, signature, section}
  // What the browser test reads: per plot the series drawn and their points.
  const probe = { updates: 0, charts: {}, marks: 0, error: null };
  window.sluiceStatus = probe;
  let latest = null;

  function fmt(v) {
    if (v == null || !isFinite(v)) return "–";
    const a = Math.abs(v);
    if (a >= 1000) return Math.round(v).toLocaleString("en");
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    return a === 0 ? "0" : v.toFixed(3);
  }

  function fmtDuration(s) {
    s = Math.max(0, Math.floor(s));
    const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24;
    const m = Math.floor(s / 60) % 60, sec = s % 60;
    if (d) return `${d} d ${h} h`;
    if (h) return `${h} h ${String(m).padStart(2, "0")} min`;
    if (m) return `${m} min ${String(sec).padStart(2, "0")} s`;
    return `${sec} s`;
  }

  // -- drawing helpers (uPlot draw hooks) ------------------------------------

  function drawMarks(u) {
    if (!latest) return;
    const { ctx, bbox } = u;
    const [lo, hi] = [u.scales.x.min, u.scales.x.max];
    ctx.save();
    ctx.font = `${Math.round(10 * devicePixelRatio)}px system-ui, sans-serif`;
    ctx.textAlign = "left"; // uPlot leaves the axes' alignment behind
    ctx.textBaseline = "alphabetic";
    ctx.lineWidth = 1.5 * devicePixelRatio;
    ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
    let drawn = 0;
    for (const m of latest.marks) {
      if (m.t < lo || m.t > hi) continue;
      const x = Math.round(u.valToPos(m.t, "x", true));
      const colour = STATE_COLOURS[m.state] || "#555";
      ctx.strokeStyle = colour;
      ctx.fillStyle = colour;
      ctx.beginPath();
      ctx.moveTo(x, bbox.top);
      ctx.lineTo(x, bbox.top + bbox.height);
      ctx.stroke();
      // Alternate two rows, so that the labels of close changes do not overprint.
      const row = 11 + 12 * (drawn % 2);
      ctx.fillText(m.state, x + 3 * devicePixelRatio, bbox.top + row * devicePixelRatio);
      drawn += 1;
    }
    ctx.restore();
    probe.marks = Math.max(probe.marks, drawn);
  }

  // The watchdog's memory thresholds as dashed lines, for the signals drawn:
  // "shed" labelled above its line, "critical" below, so close lines stay legible.
  function drawThresholds(u) {
    const t = latest && latest.info && latest.info.thresholds;
    if (!t) return;
    const { ctx, bbox } = u;
    const present = new Set(u.series.slice(1).map((s) => s.label));
    const lines = new Map(); // "kind|GiB" -> [kind, GiB, [signals]]
    const add = (kind, mib, signal) => {
      if (mib == null) return;
      const k = `${kind}|${mib}`;
      if (!lines.has(k)) lines.set(k, [kind, mib / 1024, []]);
      lines.get(k)[2].push(signal);
    };
    if (present.has("free VRAM")) {
      add("shed", t.gpu_shed_free_mib, "VRAM");
      add("critical", t.gpu_critical_free_mib, "VRAM");
    }
    if (present.has("host available")) {
      add("shed", t.host_shed_available_mib, "host");
      add("critical", t.host_critical_available_mib, "host");
    }
    const px = devicePixelRatio;
    ctx.save();
    ctx.font = `${Math.round(10 * px)}px system-ui, sans-serif`;
    ctx.textAlign = "right";
    ctx.textBaseline = "alphabetic";
    ctx.lineWidth = px;
    ctx.setLineDash([6 * px, 4 * px]);
    for (const [kind, gib, signals] of lines.values()) {
      const y = Math.round(u.valToPos(gib, "y", true));
      if (y < bbox.top || y > bbox.top + bbox.height) continue;
      ctx.strokeStyle = ctx.fillStyle = kind === "shed" ? "#ff7f0e" : "#d62728";
      ctx.beginPath();
      ctx.moveTo(bbox.left, y);
      ctx.lineTo(bbox.left + bbox.width, y);
      ctx.stroke();
      const label = `${kind} < ${fmt(gib)} GiB (${signals.join(", ")})`;
      const dy = kind === "shed" ? -3 * px : 11 * px;
      ctx.fillText(label, bbox.left + bbox.width - 4 * px, y + dy);
    }
    ctx.restore();
  }

  function noteDrawn(id) {
    return (u) => {
      const series = u.series.slice(1).map((s) => s.label);
      const points = u.data.slice(1).map((col) => col.filter((v) => v != null).length);
      probe.charts[id] = { series, points, drawn: (probe.charts[id]?.drawn || 0) + 1 };
    };
  }

  // -- building the plots ----------------------------------------------------

  function columnsFor(def, series) {
    const scale = def.scale || 1;
    const out = [];
    const present = (col) => Array.isArray(col) && col.some((v) => v != null);
    for (const [key, label] of def.series) {
      if (present(series[key])) out.push([label, series[key]]);
    }
    if (def.keyed) {
      for (const [key, col] of Object.entries(series[def.keyed] || {})) {
        if (present(col)) out.push([key, col]);
      }
    }
    return out.map(([label, col]) => [label, scale === 1 ? col : col.map((v) => (v == null ? null : v * scale))]);
  }

  function section(def) {
    const el = document.createElement("section");
    el.id = `chart-${def.id}`;
    const h = document.createElement("h2");
    h.textContent = def.title + " ";
    const small = document.createElement("small");
    small.textContent = def.unit;
    h.append(small);
    el.append(h);
    $("charts").append(el);
    return el;
  }

  function makePlot(def, el, cols, xs) {
    const width = Math.max(300, el.clientWidth - 12);
    const series = [{}].concat(cols.map(([label], i) => ({
      label,
      stroke: COLOURS[i % COLOURS.length],
      width: 1.5,
      points: { show: false },
      value: (u, v) => fmt(v),
    })));
    const opts = {
      width,
      height: 200,
      series,
      scales: {
        x: { time: true },
        y: { range: (u, lo, hi) => [0, def.max || (hi > 0 ? hi * 1.1 : 1)] },
      },
      axes: [{}, { size: 56, values: (u, vals) => vals.map(fmt) }],
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      hooks: { draw: [drawMarks].concat(def.thresholds ? [drawThresholds] : [], [noteDrawn(def.id)]) },
    };
    return new uPlot(opts, [xs].concat(cols.map(([, col]) => col)), el);
  }

  function render(doc) {
    latest = doc;
    const info = doc.info || {};
    $("model").textContent = info.model || "–";
    $("engine").textContent = info.engine || "–";
    $("version").textContent = info.version || "–";
    $("uptime").textContent = fmtDuration(doc.uptime_s);
    const state = $("state");
    state.textContent = doc.state;
    state.className = `state ${doc.state}`;
    $("reason").textContent = doc.reason || "";
    $("cost").textContent = doc.cost_us ? `Sampling costs ${fmt(doc.cost_us.mean)} µs a second.` : "";
    renderModels(doc.models || []);
    renderUsage(doc.usage || []);
    const xs = doc.series.t;
    for (const def of CHARTS) {
      const cols = columnsFor(def, doc.series);
      let entry = charts.get(def.id);
      if (def.onlyWithData && cols.length === 0) {
        if (entry) entry.section.hidden = true;
        continue;
      }
      if (!entry) {
        entry = { section: section(def), plot: null, signature: null };
        charts.set(def.id, entry);
      }
      entry.section.hidden = false;
      const signature = cols.map(([label]) => label).join("\u0000");
      const data = [xs].concat(cols.map(([, col]) => col));
      if (entry.plot && entry.signature === signature) {
        entry.plot.setData(data);
      } else {
        if (entry.plot) entry.plot.destroy();
        entry.plot = makePlot(def, entry.section, cols, xs);
        entry.signature = signature;
      }
      // The legend shows the latest values unless the pointer is over the plot.
      if (entry.plot.cursor.left == null || entry.plot.cursor.left < 0) {
        entry.plot.setLegend({ idx: xs.length - 1 });
      }
    }
    probe.updates += 1;
  }

  // Each caller's last hour and last day (the usage ledger, read every 10 s).
  function renderUsage(rows) {
    const table = $("usage");
    table.hidden = rows.length === 0;
    const body = table.tBodies[0];
    body.replaceChildren();
    for (const u of rows) {
      const row = body.insertRow();
      const cells = [u.caller, u.hour_requests, u.hour_tokens, fmt(u.hour_engine_s),
        u.day_requests, u.day_tokens, fmt(u.day_engine_s)];
      for (const v of cells) row.insertCell().textContent = String(v);
    }
    probe.usage = rows.length;
  }

  // Several models (--models): one row per model, its state and its loads.
  function renderModels(models) {
    const table = $("models");
    table.hidden = models.length === 0;
    const body = table.tBodies[0];
    body.replaceChildren();
    for (const m of models) {
      const row = body.insertRow();
      const cells = [m.name, m.state, m.kind, m.load, m.loads, m.unloads, m.failures,
        m.load_s == null ? "–" : `${fmt(m.load_s)} s`, m.held, m.deaths,
        m.died_at == null ? "–" : `${new Date(m.died_at * 1000).toLocaleTimeString()}: ${m.death}` +
          (m.back_in_s == null ? "" : `, back in ${fmt(m.back_in_s)} s`),
        m.error || ""];
      for (const v of cells) row.insertCell().textContent = String(v);
    }
    probe.models = models.length;
  }

  // -- fetching ---------------------------------------------------------------

  function askForKey(error) {
    const form = $("key-form");
    form.hidden = false;
    $("key-error").textContent = error;
    $("key").focus();
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault(); // the key never travels in a form submission or URL
    sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    $("key").value = "";
    $("key-form").hidden = true;
    refresh();
  });

  let timer = null;
  let waitingForKey = false;

  // Network trouble is shown on the page and retried; a bug in rendering is
  // not caught here, so it reaches the console (the browser test fails on it).
  async function load() {
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    let resp;
    try {
      resp = await fetch("status.json", { headers, cache: "no-store" });
    } catch (err) {
      $("message").textContent = `Sluice does not answer (${err.message}); retrying.`;
      probe.error = String(err.message);
      return;
    }
    if (resp.status === 401) {
      if (key) sessionStorage.removeItem(KEY_STORE);
      waitingForKey = true;
      probe.error = "key needed";
      askForKey(key ? "That key was refused." : "");
      return;
    }
    if (!resp.ok) {
      $("message").textContent = `status.json answered HTTP ${resp.status}; retrying.`;
      probe.error = `HTTP ${resp.status}`;
      return;
    }
    render(await resp.json());
    $("message").textContent = "";
    probe.error = null;
  }

  async function refresh() {
    clearTimeout(timer);
    waitingForKey = false;
    try {
      await load();
    } finally {
      if (!waitingForKey) timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  window.addEventListener("resize", () => {
    for (const { plot, section: el } of charts.values()) {
      if (plot) plot.setSize({ width: Math.max(300, el.clientWidth - 12), height: 200 });
    }
  });

  refresh();
})();
