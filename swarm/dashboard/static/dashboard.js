// The GEPO Swarm dashboard: polls /api/state and draws it. No library, no CDN: charts are SVG drawn
// here. Every string a peer wrote (peer ids, models, fetch sources...) enters the page through
// textContent / createTextNode only, never as markup.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const CHARTS = [
    {id: "reward", title: "Reward and accuracy", keys: ["reward_mean", "accuracy"]},
    // every --eval-every versions only: its points are joined across the steps between
    {id: "eval", title: "Held-out pass@1", keys: ["eval_pass_at_1"], joinGaps: true},
    {id: "loss", title: "Loss", keys: ["loss", "policy_loss"]},
    {id: "kl", title: "KL between sampler and learner", keys: ["kl_sampler_learner", "kl_learner_sampler", "kl_penalty"]},
    {id: "is_var", title: "Importance-weight variance", keys: ["is_weight_var"]},
    {id: "clip", title: "Clip fraction", keys: ["clip_frac"]},
    {id: "staleness", title: "Staleness of the groups used (versions)", keys: ["staleness_mean", "staleness_max"]},
    {id: "groups", title: "Groups used per step", keys: ["groups"]},
    {id: "refused", title: "Groups dropped / refused, total by reason", prefixes: ["dropped/", "inbox_refused/"]},
    {id: "grad", title: "Gradient norm", keys: ["grad_norm"]},
  ];
  let pollMs = 1500;

  // --- DOM helpers: text only

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (name === "class") node.className = value;
      else node.setAttribute(name, String(value));  // only title and data-* attributes: never event handlers
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attrs, textValue) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
    if (textValue !== undefined) node.textContent = String(textValue);
    return node;
  }

  function tip(node, textValue) {  // an SVG tooltip, as text
    node.appendChild(svg("title", {}, textValue));
    return node;
  }

  function short(id) {
    id = String(id);
    return id.length > 14 ? "\u2026" + id.slice(-12) : id;
  }

  function num(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "-";
    if (Math.abs(x) >= 1000 || Number.isInteger(x)) return String(Math.round(x * 10) / 10);
    return Number(x).toPrecision(digits || 3);
  }

  function seconds(s) {
    if (s === null || s === undefined) return "-";
    if (Math.abs(s) < 60) return s.toFixed(1) + " s";
    if (Math.abs(s) < 3600) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function megabytes(n) {
    return (n / 1e6).toFixed(2) + " MB";
  }

  function clock(t) {
    return new Date(t * 1000).toLocaleTimeString();
  }

  // --- summary, error

  function renderSummary(state) {
    const ann = state.announcement;
    const parts = [
      `run ${state.run_id} (${state.transport})`,
      `newest version ${state.newest_version === null ? "-" : state.newest_version}`,
      ann ? `announced by ${short(ann.peer_id)}, hash ${String(ann.hash).slice(0, 12)}, temperature ${ann.temperature}` : "no announcement yet",
      ann && ann.lora_r ? `LoRA run, r=${ann.lora_r}, base ${String(ann.base_hash).slice(0, 12)}` : (ann ? "full fine-tuning" : ""),
      `${state.peers.length} peer(s)`,
      state.now ? `updated ${clock(state.now)}` : "waiting for the first reading",
    ];
    const summary = document.getElementById("summary");
    summary.replaceChildren(el("span", {}, parts.filter(Boolean).join(" \u00b7 ")));
    summary.appendChild(el("div", {class: "note"}, `announcements counted from ${state.announcements_from}; joined through ${state.joined_through.join(", ")}`));
    const error = document.getElementById("error");
    if (state.error) {
      error.hidden = false;
      error.replaceChildren(el("span", {}, `${state.error} (since ${clock(state.error_since)})`));
    } else {
      error.hidden = true;
      error.replaceChildren();
    }
  }

  // --- peer table

  function renderPeers(state) {
    const columns = ["role", "peer", "model", "version", "lag", "rollouts/s", "tokens/s", "reached", "last fetch",
                     "heartbeat", "software", "run dir"];
    const head = el("tr", {}, ...columns.map((c) => el("th", {}, c)));
    const rows = state.peers.map((p) => {
      const fetch = p.last_fetch;
      const reached = p.reached.address ? `${p.reached.address}: ${p.reached.how}` : p.reached.how;
      const lagClass = p.lag === null ? "" : p.lag > 8 ? "bad" : p.lag > 2 ? "warn" : "ok";
      return el("tr", {"data-peer": p.peer_id, "data-role": p.role},
        el("td", {}, p.role),
        el("td", {class: "mono id"}, p.peer_id),
        el("td", {class: "mono model"}, p.model || "-"),
        el("td", {}, p.version),
        el("td", {class: lagClass}, p.lag === null ? "-" : p.lag),
        el("td", {}, num(p.rollouts_per_s)),
        el("td", {}, num(p.tokens_per_s)),
        el("td", {class: "small"}, reached),
        el("td", {class: "small"}, fetch ? `v${fetch.version} from ${short(fetch.source)}: ${megabytes(fetch.bytes)} in ${fetch.seconds.toFixed(2)} s` : "-"),
        el("td", {class: p.last_heartbeat_s > 30 ? "bad" : ""}, `${seconds(p.last_heartbeat_s)} ago`),
        el("td", {class: "mono"}, p.software),
        el("td", {class: "mono"}, p.run_dir || ""));
    });
    const table = el("table", {class: "peers"}, el("thead", {}, head), el("tbody", {}, ...rows));
    document.getElementById("peers").replaceChildren(rows.length ? table : el("div", {class: "note"}, "no peer in the run (yet)"));
    const departed = state.departed.map((d) => `${d.role} ${d.peer_id} (last seen ${clock(d.last_seen)})`);
    document.getElementById("departed").replaceChildren(departed.length ? el("span", {}, "left: " + departed.join(", ")) : el("span"));
  }

  // --- line charts

  function lineChart(id, title, xs, series, xLabel, joinGaps) {
    const W = 380, H = 190, L = 52, R = 10, T = 10, B = 30;
    const points = Math.max(0, ...series.map((s) => s.values.filter((v) => v !== null).length));
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": id, "data-points": points});
    const ys = series.flatMap((s) => s.values.filter((v) => v !== null));
    const xv = xs.filter((x) => x !== null);
    let [x0, x1] = [Math.min(...xv), Math.max(...xv)];
    let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
    if (!Number.isFinite(x0)) [x0, x1] = [0, 1];
    if (!Number.isFinite(y0)) [y0, y1] = [0, 1];
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    root.appendChild(svg("rect", {x: L, y: T, width: W - L - R, height: H - T - B, class: "plot"}));
    for (const f of [0, 0.5, 1]) {
      const y = y0 + f * (y1 - y0);
      root.appendChild(svg("line", {x1: L, x2: W - R, y1: py(y), y2: py(y), class: "grid"}));
      root.appendChild(svg("text", {x: L - 4, y: py(y) + 4, "text-anchor": "end", class: "tick"}, num(y, 3)));
    }
    root.appendChild(svg("text", {x: L, y: H - 12, "text-anchor": "start", class: "tick"}, num(x0, 4)));
    root.appendChild(svg("text", {x: W - R, y: H - 12, "text-anchor": "end", class: "tick"}, num(x1, 4)));
    root.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle", class: "tick"}, xLabel));
    series.forEach((s, k) => {
      let path = "";
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null || xs[i] === null) { if (!joinGaps) pen = false; return; }
        path += `${pen ? "L" : "M"}${px(xs[i]).toFixed(1)},${py(v).toFixed(1)}`;
        pen = true;
      });
      if (path) root.appendChild(tip(svg("path", {d: path, fill: "none", stroke: COLORS[k % COLORS.length], "stroke-width": 1.6}), s.name));
      const last = s.values.length - 1;
      if (last >= 0 && s.values[last] !== null && xs[last] !== null) {
        root.appendChild(svg("circle", {cx: px(xs[last]), cy: py(s.values[last]), r: 2.5, fill: COLORS[k % COLORS.length]}));
      }
    });
    const legend = el("div", {class: "legend"}, ...series.map((s, k) => {
      const swatch = el("span", {class: "swatch"});
      swatch.style.background = COLORS[k % COLORS.length];
      const lastValue = [...s.values].reverse().find((v) => v !== null);
      return el("span", {}, swatch, `${s.name} ${lastValue === undefined ? "" : "(" + num(lastValue) + ")"}`);
    }));
    return el("div", {class: "chart"}, el("div", {class: "chart-title"}, title), root, legend);
  }

  function renderCurves(state) {
    const box = document.getElementById("curves");
    const charts = [];
    const steps = state.steps;
    if (steps) {
      const byName = new Map(steps.series.map((s) => [s.name, s.values]));
      for (const chart of CHARTS) {
        const names = chart.keys ? chart.keys.filter((k) => byName.has(k))
          : steps.series.map((s) => s.name).filter((n) => chart.prefixes.some((p) => n.startsWith(p)));
        if (!names.length) continue;
        charts.push(lineChart(chart.id, chart.title, steps.step, names.map((n) => ({name: n, values: byName.get(n)})), "learner step",
                              chart.joinGaps));
      }
      const hist = steps.series.filter((s) => s.name.startsWith("staleness_hist/"));
      if (hist.length) charts.push(stalenessHistogram(steps.step, hist));
    }
    const obs = state.observed;
    if (obs) {
      const t = obs.time.map((x) => x - state.now);
      charts.push(lineChart("observed_version", "Learner version (its records, as seen)", t,
        [{name: "version", values: obs.learner_version}], "seconds before now"));
      charts.push(lineChart("observed_groups", "Groups the learner used (total, its records)", t,
        [{name: "groups used", values: obs.groups_used}], "seconds before now"));
    }
    const note = steps ? `${steps.count} step(s) read from the learner's steps.jsonl`
      : "No learner run directory given (swarm dashboard --run-dir DIR on the learner's machine): only what its records say is drawn.";
    document.getElementById("curves-note").replaceChildren(el("span", {}, note));
    box.replaceChildren(...charts);
  }

  // --- heat-maps

  function heat(value, top) {
    if (value === null || value === undefined) return null;
    const f = top > 0 ? Math.min(1, Math.max(0, value / top)) : 0;
    return `hsl(${Math.round(120 - 120 * f)}, 70%, ${Math.round(88 - 50 * f)}%)`;
  }

  function heatMap(id, rows, columns, top, labelOf, tipOf, xLabels) {
    const cellW = Math.max(6, Math.min(18, Math.floor(640 / Math.max(columns, 1)))), cellH = 18, L = 120, T = 4;
    const W = Math.max(L + cellW * columns + 10, 340), H = T + cellH * rows.length + 34;
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-heatmap": id, "data-rows": rows.length});
    rows.forEach((row, r) => {
      root.appendChild(tip(svg("text", {x: L - 6, y: T + r * cellH + 13, "text-anchor": "end", class: "tick mono"}, labelOf(row)), row.peer_id || row.name));
      row.cells.forEach((v, c) => {
        const color = heat(v, top);
        const cell = svg("rect", {x: L + c * cellW, y: T + r * cellH, width: cellW - 1, height: cellH - 1,
                                  fill: color || "none", class: color ? "cell" : "cell empty"});
        root.appendChild(tipOf ? tip(cell, tipOf(row, c, v)) : cell);
      });
    });
    const y = T + cellH * rows.length + 14;
    root.appendChild(svg("text", {x: L, y, "text-anchor": "start", class: "tick"}, xLabels[0]));
    root.appendChild(svg("text", {x: L + cellW * columns, y, "text-anchor": "end", class: "tick"}, xLabels[1]));
    root.appendChild(svg("text", {x: L, y: y + 14, "text-anchor": "start", class: "tick"}, xLabels[2] || ""));
    return root;
  }

  function stalenessHistogram(stepsX, hist) {
    const cols = Math.min(stepsX.length, 80);
    const per = stepsX.length / cols;
    const rows = hist.map((s) => {
      const cells = [];
      for (let c = 0; c < cols; c++) {
        let total = null;
        for (let i = Math.floor(c * per); i < Math.floor((c + 1) * per); i++) {
          if (s.values[i] !== null) total = (total || 0) + s.values[i];
        }
        cells.push(total);
      }
      return {name: s.name.slice("staleness_hist/".length), cells};
    });
    const top = Math.max(1, ...rows.flatMap((r) => r.cells.filter((v) => v !== null)));
    const map = heatMap("staleness_hist", rows, cols, top, (r) => `${r.name} behind`,
      (r, c, v) => `${v === null ? 0 : v} group(s) ${r.name} versions stale, steps ${num(stepsX[Math.floor(c * per)])}+`,
      [`step ${num(stepsX[0])}`, `step ${num(stepsX[stepsX.length - 1])}`, "groups used, by staleness (all samplers)"]);
    return el("div", {class: "chart"}, el("div", {class: "chart-title"}, "Staleness of the groups used, by step"), map);
  }

  function renderLag(state) {
    const box = document.getElementById("lag");
    const lag = state.lag;
    if (!lag || !lag.rows.length) {
      box.replaceChildren(el("div", {class: "note"}, "no sampler seen yet"));
      return;
    }
    const names = runDirNames(state);
    const map = heatMap("lag", lag.rows, lag.columns, Math.max(lag.max, 1), (r) => names.get(r.peer_id) || short(r.peer_id),
      (r, c, v) => `${r.peer_id}: ${v === null ? "no data" : v + " version(s) behind"} at ${clock(lag.start + c * lag.bucket_s)}`,
      [clock(lag.start), clock(lag.start + lag.columns * lag.bucket_s), `${seconds(lag.bucket_s)} per column; darkest: ${lag.max} behind`]);
    box.replaceChildren(map);
  }

  function runDirNames(state) {  // peer id -> its run directory's name, where one was given
    return new Map(state.run_dirs.filter((d) => d.peer_id).map((d) => [d.peer_id, d.name]));
  }

  // --- propagation

  function renderPropagation(state) {
    const box = document.getElementById("propagation");
    const prop = state.propagation;
    if (!prop || !prop.peers.length) {
      box.replaceChildren(el("div", {class: "note"}, "no version has spread to a sampler since the dashboard started"));
      return;
    }
    const names = runDirNames(state);
    const head = el("tr", {}, el("th", {}, "version"), el("th", {}, "announced"),
      ...prop.peers.map((p) => el("th", {class: "mono", title: p}, names.get(p) || short(p))));
    const newerHeld = prop.peers.map(() => false);  // versions come newest first: one after a held one was skipped
    const rows = prop.versions.map((v) => el("tr", {"data-version": v.version},
      el("td", {}, v.version),
      el("td", {}, v.announced_at === null ? "before" : clock(v.announced_at)),
      ...v.cells.map((c, k) => {
        let label = newerHeld[k] ? "skipped" : "-";
        newerHeld[k] = newerHeld[k] || c.held || c.used || c.before;
        if (c.before) label = "before";
        else if (c.used_s !== null) label = `held +${c.held_s === null ? "?" : c.held_s.toFixed(1)} s, used +${c.used_s.toFixed(1)} s`;
        else if (c.held_s !== null) label = `held +${c.held_s.toFixed(1)} s`;
        else if (c.used) label = "used";
        else if (c.held) label = "held";
        const cell = el("td", {class: "small"}, label);
        const color = heat(c.used_s !== null ? c.used_s : c.held_s, 60);
        if (color) cell.style.background = color;
        return cell;
      })));
    box.replaceChildren(el("table", {class: "propagation"}, el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  // --- polling

  function render(state) {
    pollMs = Math.max(500, (state.poll_s || 1.5) * 1000);
    renderSummary(state);
    renderPeers(state);
    renderCurves(state);
    renderLag(state);
    renderPropagation(state);
    document.body.setAttribute("data-polls", state.polls);
  }

  async function poll() {
    try {
      const response = await fetch("/api/state", {cache: "no-store"});
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
    } catch (err) {
      const error = document.getElementById("error");
      error.hidden = false;
      error.replaceChildren(el("span", {}, `the dashboard server does not answer (${err.message}); retrying`));
    }
    setTimeout(poll, pollMs);
  }

  poll();
})();
