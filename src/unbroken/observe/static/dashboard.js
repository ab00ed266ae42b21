// The dashboard: polls the coordinator's JSON APIs once a second (every 5 s while the tab is
// hidden) and updates the page in place. Events and curves are fetched incrementally
// (/api/events?since=SEQ, /api/history?since_step=S), so a long job costs the same per poll
// as a short one. Plain JS, no build step; uPlot is the only dependency (vendored).
// Everything that comes from the network is set as text, never parsed as HTML: node names
// and event reasons come from the nodes.
"use strict";

(() => {
  const POLL_MS = 1000;
  const HIDDEN_POLL_MS = 5000;
  const FETCH_TIMEOUT_MS = 5000; // a frozen coordinator shows as disconnected, not as a stuck page
  const MAX_EVENTS = 500; // rows kept on the page
  const MAX_POINTS = 20000; // chart points kept on the page
  const TOKEN_KEY = "unbroken.operator-token";
  let ALARMS = new Set(); // event kinds marked in red: unbroken.events.ALARMS, from /api/state
  const MARKERS = { failure: "#dc2626", join: "#16a34a" }; // event kinds drawn on the charts

  const $ = (id) => document.getElementById(id);
  const view = {
    coordinator: null, // coordinator_id: a new one (restart) starts the page afresh
    seq: null, // last event seq shown
    step: -1, // last history step plotted
    curve: { step: [], loss: [], rate: [], members: [] },
    marks: [], // [step, kind] of failures and joins
    rows: new Map(), // member id -> <tr>
    batch: 0,
    lastEpochSeq: 0,
    lastFailureSeq: 0,
    topology: "",
  };

  // ------------------------------------------------------------------ formatting

  function el(tag, attrs = {}, text = "") {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text) e.textContent = text;
    return e;
  }

  function svg(tag, attrs = {}, text = "") {
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
    if (text) e.textContent = text;
    return e;
  }

  function bytes(n) {
    if (!n) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return `${n.toFixed(n < 10 && i ? 1 : 0)} ${units[i]}`;
  }

  function num(x, digits = 1) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return x >= 1000 ? Math.round(x).toLocaleString("en") : x.toFixed(digits);
  }

  function ms(seconds) {
    if (!seconds) return "–";
    return seconds < 0.01 ? `${(seconds * 1000).toFixed(2)} ms` : `${(seconds * 1000).toFixed(0)} ms`;
  }

  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
  }

  function text(id, value) {
    const e = $(id);
    if (e.textContent !== value) e.textContent = value;
  }

  // ------------------------------------------------------------------ polling

  async function getJSON(path) {
    const r = await fetch(path, { cache: "no-store", signal: AbortSignal.timeout(FETCH_TIMEOUT_MS) });
    if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
    return r.json();
  }

  async function poll() {
    try {
      const state = await getJSON("/api/state");
      ALARMS = new Set(state.alarms || []);
      if (state.coordinator_id !== view.coordinator) restart(state);
      // First look: the newest page only (a full page means the next poll pages on).
      const newest = state.events.length ? state.events[state.events.length - 1].seq : 0;
      const since = view.seq === null ? Math.max(-1, newest - MAX_EVENTS) : view.seq;
      const [events, history] = await Promise.all([
        getJSON(`/api/events?since=${since}&limit=${MAX_EVENTS}`),
        getJSON(`/api/history?since_step=${view.step}&nodes=0`),
      ]);
      addEvents(events);
      addPoints(history.points);
      showHeader(state, history);
      showMembers(state);
      showTopology(state);
      showRecoveries(state.recoveries);
      $("updated").textContent = `updated ${clock(Date.now() / 1000)}`;
    } catch (err) {
      setStatus("disconnected", `no answer from the coordinator: ${err.message || err}`);
    }
    setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  function restart(state) {
    // First load, or a restarted coordinator (its event seq and history start over).
    view.coordinator = state.coordinator_id;
    view.seq = null;
    view.step = -1;
    view.curve = { step: [], loss: [], rate: [], members: [] };
    view.marks = [];
    view.lastEpochSeq = view.lastFailureSeq = 0;
    $("events").tBodies[0].replaceChildren();
  }

  function setStatus(status, title = "") {
    const b = $("status");
    if (b.dataset.status !== status) {
      b.dataset.status = status;
      b.textContent = status;
    }
    b.title = title;
  }

  // ------------------------------------------------------------------ header

  function showHeader(state, history) {
    const plan = state.plan || {};
    view.batch = plan.batch_size || 0;
    text("job", state.job || "(no job yet)");
    document.title = `${state.job || "unbroken"} · step ${state.step}`;
    text("step", state.num_steps ? `${state.step} / ${state.num_steps}` : String(state.step));
    text("epoch", String(state.epoch));
    const extras = [plan.codec && plan.codec !== "none" ? plan.codec : "", plan.aggregate && plan.aggregate !== "mean" ? plan.aggregate : ""];
    text("mode", [plan.mode || "sync", ...extras].filter(Boolean).join(" · "));
    text("rate", num(history.step_rate, 2));
    const c = view.curve;
    const recent = c.rate.slice(-10).sort((a, b) => a - b); // the median of the last 10 steps
    text("samples", recent.length ? num(recent[Math.floor(recent.length / 2)], 0) : "–");
    const active = state.members.filter((m) => m.rank !== null).length;
    text("count", `${active} in epoch · ${state.members.length} connected`);
    text("recovery-count", String((state.recoveries || []).length));
    const lead = state.leadership || {};
    const standbys = lead.standbys || [];
    if (!lead.role || lead.role === "single") text("leader", "single coordinator");
    else text("leader", `${lead.leader || "electing…"} · term ${lead.term} · ${standbys.length} standby`);
    $("leader").title = standbys.length ? `standbys: ${standbys.join(", ")}` : "";
    if (lead.role === "standby") setStatus("standby", `this coordinator stands by; the leader is ${lead.leader || "being elected"}`);
    else if (state.finished) setStatus("finished");
    else if (state.recovering) setStatus("recovering", "the coordinator restarted and rebuilds its view from the nodes");
    else if (view.lastFailureSeq > view.lastEpochSeq) setStatus("re-forming", "a member failed: the next epoch is being formed");
    else if (!state.epoch) setStatus("waiting", "waiting for enough nodes to start");
    else setStatus("training");
  }

  // ------------------------------------------------------------------ members

  const COLUMNS = ["name", "device", "zone", "role", "share", "rate", "memory", "state", "step", "seen", "actions"];

  function showMembers(state) {
    const body = $("members").tBodies[0];
    const leaders = zoneLeaders(state.members);
    const seen = new Set();
    for (const m of state.members) {
      seen.add(m.id);
      let tr = view.rows.get(m.id);
      if (!tr) {
        tr = el("tr", { "data-node": m.name, "data-id": m.id });
        for (const col of COLUMNS) tr.appendChild(el("td", { class: `c-${col}` }));
        tr.lastChild.append(action(m.name, "drain"), action(m.name, "kill"));
        view.rows.set(m.id, tr);
        body.appendChild(tr);
      }
      const caps = m.capabilities || {};
      const cells = tr.children;
      const set = (i, value, title) => {
        if (cells[i].textContent !== value) cells[i].textContent = value;
        if (title !== undefined) cells[i].title = title;
      };
      const compute = m.compute_s && m.compute_s[0];
      const trains = m.rank !== null && m.share > 0;
      set(0, m.name, `${m.id} on ${m.host || "?"} (pid ${m.pid})`);
      set(1, caps.device_name ? `${caps.device} · ${caps.device_name}` : caps.device || "–", caps.device_name || "");
      set(2, leaders.has(m.id) ? `${m.zone} ★` : m.zone, leaders.has(m.id) ? "zone leader" : "");
      set(3, m.role || "–", m.preference !== "auto" ? `pinned: ${m.preference}` : "");
      set(4, trains && view.batch ? `${m.share} (${Math.round((100 * m.share) / view.batch)}%)` : String(m.share));
      set(5, trains && compute ? num(m.share / compute, 0) : "–", compute ? `last compute ${ms(compute)}` : "");
      set(6, caps.memory_total ? `${bytes(caps.memory_used)} / ${bytes(caps.memory_total)}` : bytes(caps.memory_used));
      const flags = [m.quarantined ? "quarantined" : "", m.refused_gradients ? `${m.refused_gradients} refused` : ""];
      set(7, [m.state, ...flags].filter(Boolean).join(" · "));
      set(8, String(m.step));
      set(9, `${m.last_seen_s.toFixed(1)} s ago`);
      tr.classList.toggle("stale", m.last_seen_s > 1.5);
      tr.classList.toggle("bad", Boolean(m.quarantined || m.refused_gradients));
      tr.classList.toggle("idle", m.rank === null);
    }
    for (const [id, tr] of view.rows) {
      if (!seen.has(id)) { tr.remove(); view.rows.delete(id); }
    }
  }

  function zoneLeaders(members) {
    // The first member of each zone in rank order leads it (unbroken/sched/zones.py Zones).
    const best = new Map();
    for (const m of members) {
      if (m.rank === null) continue;
      const b = best.get(m.zone);
      if (!b || m.rank < b.rank) best.set(m.zone, m);
    }
    return new Set([...best.values()].map((m) => m.id));
  }

  function action(name, what) {
    const b = el("button", { type: "button", class: `act ${what}`, "data-action": what }, what);
    b.title = what === "kill" ? `SIGKILL ${name} (the group recovers without it)` : `let ${name} leave after its next step`;
    b.addEventListener("click", () => act(name, what));
    return b;
  }

  async function act(name, what) {
    if (what === "kill" && !window.confirm(`Kill ${name}? (SIGKILL; the others carry on)`)) return;
    const out = $("action-status");
    const headers = {};
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    out.className = "muted";
    out.textContent = `${what} ${name}…`;
    try {
      const r = await fetch(`/api/nodes/${encodeURIComponent(name)}/${what}`, {
        method: "POST", headers, signal: AbortSignal.timeout(FETCH_TIMEOUT_MS),
      });
      const body = await r.text();
      out.className = r.ok ? "ok" : "error";
      out.textContent = r.ok ? `${what} sent to ${name}` : `${what} ${name}: ${r.status} ${body}`;
    } catch (err) {
      out.className = "error";
      out.textContent = `${what} ${name}: ${err.message || err}`;
    }
  }

  function setupToken() {
    const input = $("token");
    const note = () => { $("token-note").textContent = sessionStorage.getItem(TOKEN_KEY) ? "kept in this tab only" : "none kept"; };
    const keep = () => {
      if (input.value) sessionStorage.setItem(TOKEN_KEY, input.value);
      input.value = "";
      note();
    };
    $("token-save").addEventListener("click", keep);
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") keep(); });
    $("token-forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); input.value = ""; note(); });
    note();
  }

  // ------------------------------------------------------------------ topology

  function showTopology(state) {
    // The coordinator on top; one band per zone below it, hanging from a trunk (the control
    // plane: each node's heartbeat goes to the coordinator), each zone's leader first. The
    // dashed line through the leaders is the exchange between zones.
    const box = $("topology");
    const members = state.members;
    const leaders = zoneLeaders(members);
    const byRank = [...members].sort((a, b) => (a.rank ?? 1e9) - (b.rank ?? 1e9) || a.name.localeCompare(b.name));
    const zones = [...new Set(members.map((m) => m.zone))].sort().map((z) => [z, byRank.filter((m) => m.zone === z)]);
    const width = Math.max(box.clientWidth || 400, 300);
    const key = JSON.stringify([width, zones.map(([z, group]) => [z, group.map((m) => [m.id, m.rank, rttOf(m), m.state])])]);
    if (key === view.topology) return;
    view.topology = key;

    const NODE_W = 118, NODE_H = 38, GAP = 8, PAD = 10, HEAD = 42, TRUNK = 16, X0 = 36, SPACE = 22;
    const zoneW = width - X0 - 2;
    const cols = Math.max(1, Math.floor((zoneW - 2 * PAD + GAP) / (NODE_W + GAP)));
    const under = [], over = []; // drawn below the zone boxes (lines), and above them
    let y = 50;
    let trunkEnd = 36;
    const leaderAt = [];
    for (const [zone, group] of zones) {
      const rows = Math.max(1, Math.ceil(group.length / cols));
      const h = HEAD + rows * (NODE_H + GAP) - GAP + PAD;
      const rtts = group.map(rttOf).filter((r) => r > 0).sort((a, b) => a - b);
      const median = rtts.length ? rtts[Math.floor(rtts.length / 2)] : 0;
      trunkEnd = y + 18;
      under.push(svg("line", { x1: TRUNK, y1: trunkEnd, x2: X0, y2: trunkEnd, class: "link" }));
      over.push(svg("rect", { x: X0, y, width: zoneW, height: h, rx: 8, class: "zone" }));
      over.push(svg("text", { x: X0 + PAD, y: y + 17, class: "zone-label" }, `zone ${zone} · ${group.length} node${group.length === 1 ? "" : "s"}`));
      over.push(svg("text", { x: X0 + PAD, y: y + 33, class: "link-label" }, `RTT to coordinator ${ms(median)} (median of its nodes)`));
      group.forEach((m, j) => {
        const nx = X0 + PAD + (j % cols) * (NODE_W + GAP);
        const ny = y + HEAD + Math.floor(j / cols) * (NODE_H + GAP);
        const lead = leaders.has(m.id);
        if (lead) leaderAt.push([nx + NODE_W / 2, ny + NODE_H / 2]);
        const g = svg("g", { class: `node${m.rank === null ? " idle" : ""}${lead ? " leader" : ""}`, "data-node": m.name });
        g.appendChild(svg("title", {}, `${m.name}: ${m.state}, ${m.role || "no role"}, RTT to coordinator ${ms(rttOf(m))}`));
        g.appendChild(svg("rect", { x: nx, y: ny, width: NODE_W, height: NODE_H, rx: 5 }));
        const name = m.name.length > 13 ? `${m.name.slice(0, 12)}…` : m.name;
        g.appendChild(svg("text", { x: nx + 7, y: ny + 15, class: "node-name" }, `${lead ? "★ " : ""}${name}`));
        g.appendChild(svg("text", { x: nx + 7, y: ny + 30, class: "node-detail" }, `${m.role || m.state} · ${ms(rttOf(m))}`));
        over.push(g);
      });
      y += h + SPACE;
    }
    for (let k = 1; k < leaderAt.length; k++) {
      const [[x1, y1], [x2, y2]] = [leaderAt[k - 1], leaderAt[k]];
      under.push(svg("line", { x1, y1, x2, y2, class: "exchange" }));
    }
    const out = svg("svg", { width, height: Math.max(y - SPACE + 4, 90), role: "img", "aria-label": "zones and nodes" });
    out.appendChild(svg("line", { x1: TRUNK, y1: 34, x2: TRUNK, y2: trunkEnd, class: "link" }));
    out.append(...under, ...over);
    out.appendChild(svg("rect", { x: 2, y: 4, width: 130, height: 30, rx: 6, class: "coord" }));
    out.appendChild(svg("text", { x: 67, y: 24, class: "coord-label" }, "coordinator"));
    box.replaceChildren(out);
  }

  function rttOf(m) {
    return (m.capabilities && m.capabilities.rtt_s) || 0;
  }

  // ------------------------------------------------------------------ events

  function addEvents(page) {
    const body = $("events").tBodies[0];
    const events = page.events;
    if (!events.length) return;
    const frag = document.createDocumentFragment();
    for (let k = events.length - 1; k >= 0; k--) { // newest first
      const e = events[k];
      const anomaly = ALARMS.has(e.kind);
      const tr = el("tr", { "data-kind": e.kind, "data-seq": String(e.seq), class: anomaly ? "anomaly" : "" });
      if (e.node) tr.dataset.node = e.node;
      tr.append(
        el("td", { class: "time" }, clock(e.time)),
        el("td", {}, ""),
        el("td", {}, e.node || ""),
        el("td", { class: "num" }, String(e.epoch)),
        el("td", { class: "num" }, String(e.step)),
        el("td", { class: "reason", title: e.reason }), // clamped to three lines; all of it on hover
      );
      tr.lastChild.appendChild(el("div", {}, e.reason));
      tr.children[1].appendChild(el("span", { class: `kind k-${e.kind}` }, e.kind));
      frag.appendChild(tr);
      if (e.kind === "epoch") view.lastEpochSeq = Math.max(view.lastEpochSeq, e.seq);
      if (e.kind === "failure") view.lastFailureSeq = Math.max(view.lastFailureSeq, e.seq);
      if (e.kind in MARKERS) view.marks.push([e.step, e.kind]);
    }
    body.insertBefore(frag, body.firstChild);
    while (body.rows.length > MAX_EVENTS) body.deleteRow(-1);
    if (view.marks.length > MAX_EVENTS) view.marks.splice(0, view.marks.length - MAX_EVENTS);
    view.seq = events[events.length - 1].seq;
  }

  function showRecoveries(recoveries) {
    const list = $("recoveries");
    const shown = (recoveries || []).slice(-3).reverse();
    const key = JSON.stringify(shown.map((r) => [r.detected_at, r.step]));
    if (list.dataset.key === key) return;
    list.dataset.key = key;
    list.replaceChildren(...shown.map((r) => el(
      "li", { class: "recovery" },
      `recovered in ${r.duration_s.toFixed(2)} s (failure → next commit, step ${r.step}): ${r.cause}`,
    )));
  }

  // ------------------------------------------------------------------ charts

  function markers() {
    // Vertical lines at the steps of failures and joins.
    return {
      hooks: {
        draw: [(u) => {
          const ctx = u.ctx;
          const { top, height } = u.bbox;
          ctx.save();
          ctx.lineWidth = 1.5 * devicePixelRatio;
          ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
          for (const [step, kind] of view.marks) {
            if (step < u.scales.x.min || step > u.scales.x.max) continue;
            const x = Math.round(u.valToPos(step, "x", true));
            ctx.strokeStyle = MARKERS[kind];
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, top + height);
            ctx.stroke();
          }
          ctx.restore();
        }],
      },
    };
  }

  function makeChart(id, series, axes, scales = {}) {
    const box = $(id);
    const opts = {
      width: Math.max(box.clientWidth, 280),
      height: 220,
      scales: { x: { time: false }, ...scales },
      series: [{ label: "step", value: (u, v) => (v === null ? "–" : String(v)) }, ...series],
      axes: [{ label: "step", labelSize: 18, size: 34 }, ...axes],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      plugins: [markers()],
    };
    const chart = new uPlot(opts, [[], ...series.map(() => [])], box);
    new ResizeObserver(() => chart.setSize({ width: Math.max(box.clientWidth, 280), height: 220 })).observe(box);
    return chart;
  }

  const charts = {};

  function setupCharts() {
    charts.loss = makeChart("loss-chart", [
      { label: "loss", stroke: "#2563eb", width: 1.5, value: (u, v) => (v === null ? "–" : v.toPrecision(4)) },
    ], [{ label: "loss", size: 56, labelSize: 18 }]);
    charts.throughput = makeChart("throughput-chart", [
      { label: "samples/s", stroke: "#7c3aed", width: 1.5, scale: "y", value: (u, v) => num(v, 0) },
      { label: "members", stroke: "#9ca3af", width: 1, scale: "m", paths: uPlot.paths.stepped({ align: 1 }), value: (u, v) => (v === null ? "–" : String(v)) },
    ], [
      { label: "samples/s", size: 56, labelSize: 18, scale: "y" },
      { label: "members", scale: "m", side: 1, size: 40, labelSize: 18, grid: { show: false }, incrs: [1, 2, 5, 10] },
    ], { m: { range: (u, lo, hi) => [0, Math.max(hi + 1, 2)] } });
  }

  function addPoints(points) {
    const c = view.curve;
    if (points.length) {
      for (const p of points) {
        c.step.push(p.step);
        c.loss.push(p.loss);
        c.rate.push(p.samples_per_s);
        c.members.push(p.members);
      }
      view.step = points[points.length - 1].step;
      const extra = c.step.length - MAX_POINTS;
      if (extra > 0) for (const k of Object.keys(c)) c[k].splice(0, extra);
    }
    // Redraw also without new points: markers may have arrived.
    charts.loss.setData([c.step, c.loss]);
    charts.throughput.setData([c.step, c.rate, c.members]);
    $("loss-chart").dataset.points = String(c.step.length);
    $("throughput-chart").dataset.points = String(c.step.length);
  }

  // ------------------------------------------------------------------ start

  document.addEventListener("visibilitychange", () => { if (!document.hidden) view.topology = ""; });
  $("anomalies-only").addEventListener("change", (e) => document.body.classList.toggle("anomalies-only", e.target.checked));
  setupToken();
  setupCharts();
  poll();
})();
