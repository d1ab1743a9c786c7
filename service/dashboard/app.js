// cmtune dashboard: plain JavaScript over the REST API (no external assets).
"use strict";

const TOKEN_KEY = "cmtune-token";
const REFRESH_MS = 2000;
const main = document.getElementById("main");
let timer = null;

// ---- helpers ----------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1e3).toFixed(3)} ms`);
const x = (v) => (v === null || v === undefined ? "–" : `${v.toFixed(2)}×`);
const mib = (b) => (b === null || b === undefined ? "–" : `${(b / 2 ** 20).toFixed(1)} MiB`);
// Keys, ids and savings come from the API (problem_key, hardware_key, decomposition_id, saved_s_*):
// the page never re-derives them.
const stateBadge = (state) => el("span", { class: `state ${state}` }, state);
// A software stack in words, as the service writes it (collective_matmul.planning.problem.Software): what is known of it.
function stack(software) {
  if (!software) return "any stack";
  const parts = [["jax", software.jax], ["jaxlib", software.jaxlib]].filter(([, v]) => v).map(([k, v]) => `${k} ${v}`);
  if (software.platform_version) parts.push(software.platform_version);
  if (software.flags) parts.push(`flags ${software.flags}`);
  return parts.join(", ") || "an unnamed stack";
}
function ago(iso) {
  const seconds = (Date.now() - new Date(iso).getTime()) / 1000;
  return seconds < 90 ? `${seconds.toFixed(0)} s ago` : `${(seconds / 60).toFixed(0)} min ago`;
}

async function api(path) {
  const token = localStorage.getItem(TOKEN_KEY);
  const response = await fetch(path, { headers: token ? { Authorization: `Bearer ${token}` } : {} });
  if (response.status === 401 || response.status === 403) throw new AuthError((await response.json()).detail);
  if (!response.ok) throw new Error(`${response.status}: ${(await response.json()).detail || response.statusText}`);
  return response.json();
}
class AuthError extends Error {}

function tokenForm(message) {
  stop();
  main.replaceChildren(
    el("h1", {}, "Sign in"),
    el("p", { class: "muted" }, message || "Paste a reader token (cmtune token create --role reader)."),
    el("form", { id: "token-form", onsubmit: (event) => {
      event.preventDefault();
      localStorage.setItem(TOKEN_KEY, event.target.token.value.trim());
      route();
    } }, el("input", { name: "token", size: 60, placeholder: "cmt_…", autocomplete: "off" }), " ",
       el("button", { type: "submit" }, "Open")),
  );
}

function live(render) {
  // Render now and every REFRESH_MS without reloading the page.
  stop();
  const tick = async () => {
    try {
      await render();
      document.getElementById("live").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
    } catch (error) {
      if (error instanceof AuthError) return tokenForm(error.message);
      document.getElementById("live").textContent = `update failed: ${error.message}`;
    }
  };
  tick();
  timer = setInterval(tick, REFRESH_MS);
}
function stop() { if (timer) clearInterval(timer); timer = null; }

function go(path) { history.pushState({}, "", path); route(); }

// Sortable, filterable table: columns = [{key, label, num, value(row), render(row)}].
function dataTable(id, columns, rows, { onclick, filter } = {}) {
  const state = dataTable.state[id] || (dataTable.state[id] = { key: null, dir: 1, filter: "" });
  let shown = rows.filter((row) => !state.filter || (filter ? filter(row) : JSON.stringify(row))
    .toLowerCase().includes(state.filter.toLowerCase()));
  if (state.key) {
    const column = columns.find((c) => c.key === state.key);
    shown = [...shown].sort((a, b) => {
      const va = column.value(a), vb = column.value(b);
      if (va === vb) return 0;
      if (va === null || va === undefined) return 1;
      if (vb === null || vb === undefined) return -1;
      return (va < vb ? -1 : 1) * state.dir;
    });
  }
  const head = el("tr", {}, columns.map((c) => el("th", {
    class: `sortable${c.num ? " num" : ""}${state.key === c.key ? (state.dir > 0 ? " sorted-asc" : " sorted-desc") : ""}`,
    "data-key": c.key,
    onclick: () => { state.dir = state.key === c.key ? -state.dir : 1; state.key = c.key; route(true); },
  }, c.label)));
  const body = shown.map((row) => el("tr", onclick ? { class: "clickable", onclick: () => onclick(row) } : {},
    columns.map((c) => el("td", { class: c.num ? "num" : c.wrap ? "wrap" : "" }, c.render ? c.render(row) : c.value(row) ?? "–"))));
  const search = el("input", { type: "search", placeholder: "filter…", value: state.filter, id: `${id}-filter`,
    oninput: (event) => { state.filter = event.target.value; route(true); } });
  return el("div", {}, el("div", { class: "toolbar" }, search, el("span", { class: "muted" }, `${shown.length} of ${rows.length}`)),
    el("div", { class: "scroll" }, el("table", { id }, el("thead", {}, head), el("tbody", {}, body))));
}
dataTable.state = {};

function keepFocus(fn) {
  // Re-rendering replaces the filter box: keep its focus and caret.
  const active = document.activeElement;
  const id = active && active.id, position = active && active.selectionStart;
  fn();
  if (id) { const again = document.getElementById(id); if (again) { again.focus(); try { again.setSelectionRange(position, position); } catch (e) {} } }
}

// ---- SVG plots --------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  node.append(...children.flat().filter(Boolean));
  return node;
}
function axes(width, height, pad, xs, ys, xLabel, yLabel) {
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [0, Math.max(...ys) * 1.1 || 1];
  const sx = (v) => pad + ((v - x0) / (x1 - x0 || 1)) * (width - 2 * pad);
  const sy = (v) => height - pad - ((v - y0) / (y1 - y0)) * (height - 2 * pad);
  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => y0 + f * (y1 - y0));
  const group = svg("g", {},
    svg("line", { x1: pad, y1: height - pad, x2: width - pad, y2: height - pad, stroke: "#999" }),
    svg("line", { x1: pad, y1: pad, x2: pad, y2: height - pad, stroke: "#999" }),
    ticks.map((t) => svg("text", { x: 4, y: sy(t) + 4 }, `${(t * 1e3).toFixed(2)}`)),
    svg("text", { x: width / 2, y: height - 4, "text-anchor": "middle" }, xLabel),
    svg("text", { x: 4, y: 12 }, yLabel));
  return { sx, sy, group };
}

function trialPlot(trials) {
  const done = trials.filter((t) => t.kind === "search" && t.median_s !== null);
  const width = 520, height = 260, pad = 40;
  if (!done.length) return el("p", { class: "muted" }, "No finished trial yet.");
  const baseline = done.map((t) => t.baseline_s).sort((a, b) => a - b)[Math.floor(done.length / 2)];
  const { sx, sy, group } = axes(width, height, pad, [0, ...done.map((t) => t.number)],
    [...done.map((t) => t.median_s), baseline], "trial number", "time (ms)");
  let best = Infinity;
  const steps = done.map((t) => { best = Math.min(best, t.median_s); return [t.number, best]; });
  const path = steps.map(([n, b], i) => `${i ? "L" : "M"}${sx(n)},${sy(b)}`).join(" ");
  return svg("svg", { viewBox: `0 0 ${width} ${height}`, id: "trial-plot", role: "img" }, group,
    svg("line", { x1: pad, x2: width - pad, y1: sy(baseline), y2: sy(baseline), stroke: "#b91c1c",
                  "stroke-dasharray": "4 3", class: "baseline-line" }),
    svg("text", { x: width - pad, y: sy(baseline) - 4, "text-anchor": "end" }, `baseline ${ms(baseline)}`),
    svg("path", { d: path, fill: "none", stroke: "#15803d", "stroke-width": 2, class: "best-line" }),
    done.map((t) => svg("circle", { cx: sx(t.number), cy: sy(t.median_s), r: 4, fill: "#2563eb",
                                    class: "trial-point" }, svg("title", {}, `#${t.number} ${t.decomposition_id}: ${ms(t.median_s)}`))));
}

function fieldPlot(trials) {
  const done = trials.filter((t) => t.kind === "search" && t.median_s !== null && t.decompositions[0].method === "ring");
  const width = 520, height = 260, pad = 40;
  if (!done.length) return el("p", { class: "muted" }, "No finished ring trial yet.");
  const chunks = [...new Set(done.map((t) => t.decompositions[0].chunks))].sort((a, b) => a - b);
  const { sx, sy, group } = axes(width, height, pad, [-0.5, chunks.length - 0.5], done.map((t) => t.median_s),
    "chunks", "time (ms)");
  const colors = { unidirectional: "#2563eb", bidirectional: "#d97706" };
  return svg("svg", { viewBox: `0 0 ${width} ${height}`, id: "field-plot", role: "img" }, group,
    chunks.map((c, i) => svg("text", { x: sx(i), y: height - pad + 14, "text-anchor": "middle" }, String(c))),
    done.map((t) => {
      const d = t.decompositions[0];
      const offset = d.direction === "bidirectional" ? 0.12 : -0.12;
      return svg("circle", { cx: sx(chunks.indexOf(d.chunks) + offset), cy: sy(t.median_s), r: 4,
                             fill: colors[d.direction], class: "field-point" }, svg("title", {}, `${t.decomposition_id}: ${ms(t.median_s)}`));
    }));
}

// One problem's bounds as a picture: compute, communication, the bound, the baseline and the tuned time as
// horizontal bars on one time scale, with their numbers, the hidden fraction and the reason (all from the API).
const pct = (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`);
function boundsPicture(c, title) {
  const rows = [
    ["compute", "the local matmul alone", c.compute_s],
    ["communication", "the collective alone", c.communication_s],
    ["bound", "max(compute, communication)", c.bound_s],
    ["baseline", "the baseline op", c.baseline_s],
    ["tuned", c.decomposition_id || "tuned", c.time_s],
  ].filter(([, , seconds]) => seconds !== null && seconds !== undefined);
  const width = 520, label = 110, value = 90, row = 22, bars = width - label - value;
  const scale = Math.max(...rows.map(([, , seconds]) => seconds)) || 1;
  const picture = svg("svg", { viewBox: `0 0 ${width} ${rows.length * row + 4}`, class: "bounds-bars", role: "img" },
    rows.map(([name, what, seconds], i) => {
      const y = i * row + 2, w = Math.max(1, (seconds / scale) * bars);
      return svg("g", { class: `bounds-row ${name}` },
        svg("text", { x: 0, y: y + 14 }, name),
        svg("rect", { x: label, y, width: w.toFixed(2), height: row - 6, rx: 2, class: `bound-bar bar-${name}`,
                      "data-seconds": seconds }, svg("title", {}, `${name} (${what}): ${ms(seconds)}`)),
        svg("text", { x: label + w + 4, y: y + 14, class: "bounds-value" }, ms(seconds)));
    }));
  const measured = c.compute_s !== null && c.compute_s !== undefined;
  // the bounds have their own rounds: say so where their baseline differs from the confirmation round's
  const drift = measured && Math.abs(c.bounds_baseline_s - c.baseline_s) > 0.01 * c.baseline_s
    ? ` Compute, communication and the bound were timed beside a baseline of ${ms(c.bounds_baseline_s)}; the baseline and tuned bars are the confirmation round's (the hidden fraction compares each with its own).`
    : "";
  return el("figure", { class: "bounds" },
    title ? el("div", { class: "bounds-title" }, title) : null,
    measured ? picture : el("p", { class: "muted" }, "No bounds measured."),
    el("figcaption", {},
      el("strong", { class: "hidden-fraction" }, `hidden: ${pct(c.hidden_fraction)}`), " · ",
      el("span", { class: "reason" }, c.reason || "–"),
      el("span", { class: "muted" }, drift)));
}

// ---- pages ------------------------------------------------------------------------------------

async function overview() {
  const [studies, workers, models] = await Promise.all([api("/v1/studies?limit=500"), api("/v1/workers"),
                                                        api("/v1/submissions")]);
  const online = workers.filter((w) => w.online).length;
  const reconfirms = studies.items.filter((s) => s.reconfirm);
  const outcomes = {};
  for (const s of reconfirms) outcomes[s.outcome] = (outcomes[s.outcome] || 0) + 1;
  const columns = [
    { key: "id", label: "study", num: true, value: (s) => s.id, render: (s) => el("a", { href: `/ui/studies/${s.id}` }, `#${s.id}`) },
    { key: "state", label: "state", value: (s) => s.state, render: (s) => stateBadge(s.state) },
    { key: "problem", label: "problem (or step of a model)",
      value: (s) => (s.reconfirm ? `${s.problem_key} (re-confirmation on ${stack(s.software)})`
        : s.software ? `${s.problem_key} (on ${stack(s.software)})` : s.problem_key) },
    { key: "hardware", label: "hardware", value: (s) => s.hardware_key },
    { key: "progress", label: "progress (trials)", value: (s) => s.trials_done / s.trials_budget,
      render: (s) => el("span", { class: "progress" }, el("span", { class: "bar" }, el("span", { style: `width:${Math.min(100, 100 * s.trials_done / s.trials_budget)}%` })),
        `${s.trials_done} / ${s.trials_budget}${s.trials_running ? ` (+${s.trials_running} running)` : ""}`) },
    { key: "best", label: "best speedup", num: true, value: (s) => (s.tuned ? s.tuned.speedup : s.best ? s.best.speedup : null),
      render: (s) => { const v = s.tuned ? s.tuned.speedup : s.best ? s.best.speedup : null; return el("span", { class: v > 1 ? "good" : "" }, x(v)); } },
  ];
  keepFocus(() => main.replaceChildren(
    el("h1", {}, "Studies"),
    el("div", { class: "cards" },
      el("div", { class: "card" }, el("div", { class: "muted" }, "studies"), el("div", { class: "value", id: "study-count" }, studies.total)),
      el("div", { class: "card" }, el("div", { class: "muted" }, "running"), el("div", { class: "value" }, studies.items.filter((s) => s.state === "running").length)),
      el("div", { class: "card" }, el("div", { class: "muted" }, "completed"), el("div", { class: "value" }, studies.items.filter((s) => s.state === "completed").length)),
      el("div", { class: "card" }, el("div", { class: "muted" }, "workers online"), el("div", { class: "value", id: "workers-online" }, online))),
    dataTable("studies", columns, studies.items, { onclick: (s) => go(`/ui/studies/${s.id}`), filter: (s) => `${s.state} ${s.problem_key} ${s.hardware_key}` }),
    ...(reconfirms.length ? [  // what a worker of a new software stack queued: re-confirmed, replaced or waiting
      el("h2", {}, "Re-confirmations on a new software stack"),
      el("p", { id: "reconfirm-counts", class: "muted" },
        ["re-confirmed", "replaced", "waiting", "failed", "cancelled"].filter((o) => outcomes[o]).map((o) => `${outcomes[o]} ${o}`).join(" · ")),
      el("ul", { id: "reconfirmations" }, reconfirms.map((s) => el("li", {},
        el("a", { href: `/ui/studies/${s.id}` }, `#${s.id}`), ` ${s.problem_key}: ${s.reconfirm.decomposition_id} measured on `,
        `${stack(s.reconfirm.config.software)}, on ${stack(s.software)} `, stateBadge(s.outcome),
        s.tuned && s.outcome !== "waiting" ? ` ${s.tuned_decomposition_id} · ${x(s.tuned.speedup)}` : "")))] : []),
    ...(models.length ? [el("h2", {}, "Submitted models"),
      el("ul", { id: "models" }, models.map((m) => el("li", {},
        el("a", { href: `/ui/submissions/${m.id}` }, `${m.name} on ${Object.entries(m.mesh.axes).map(([k, v]) => `${k}=${v}`).join(",")}`),
        el("span", { class: "muted" }, ` · ${m.problems} problems · ${m.hardware_key}`))))] : []),
  ));
}

function stepTrial(t) {
  // a round of the step search names its variants (the step as written aside); an older step trial times the menu
  const named = (t.variants || []).filter((n) => n !== "as-written");
  return named.length ? `step: ${named.join(", ")}` : "step: the standard menu";
}

async function studyPage(id) {
  const [study, trials] = await Promise.all([api(`/v1/studies/${id}`), api(`/v1/studies/${id}/trials`)]);
  const columns = [
    { key: "number", label: "#", num: true, value: (t) => t.number },
    { key: "decomposition", label: "decomposition", value: (t) => (t.kind === "confirm" ? `confirmation of ${t.decompositions.length}` : t.kind === "step" ? stepTrial(t) : t.decomposition_id) },
    { key: "state", label: "state", value: (t) => t.status && t.state === "completed" ? t.status : t.state, render: (t) => stateBadge(t.status && t.state === "completed" ? (t.status === "ok" ? "completed" : "failed") : t.state) },
    { key: "median", label: "median", num: true, value: (t) => t.median_s, render: (t) => ms(t.median_s) },
    { key: "iqr", label: "spread (IQR)", num: true, value: (t) => t.iqr_s, render: (t) => ms(t.iqr_s) },
    { key: "baseline", label: "baseline", num: true, value: (t) => t.baseline_s, render: (t) => ms(t.baseline_s) },
    { key: "ratio", label: "ratio to baseline", num: true, value: (t) => t.ratio, render: (t) => (t.ratio ? t.ratio.toFixed(3) : "–") },
    { key: "speedup", label: "speedup", num: true, value: (t) => t.speedup, render: (t) => el("span", { class: t.speedup > 1 ? "good" : "" }, x(t.speedup)) },
    { key: "worker", label: "worker", num: true, value: (t) => t.worker_id },
    { key: "message", label: "error", value: (t) => t.message || "" },
  ];
  const tuned = study.tuned;
  keepFocus(() => main.replaceChildren(
    el("h1", {}, `Study #${study.id} `, stateBadge(study.state)),
    el("div", { class: "kv" },
      el("span", { class: "muted" }, "problem"), el("span", { id: "study-problem" }, study.problem_key),
      el("span", { class: "muted" }, "hardware"), el("span", {}, study.hardware_key),
      el("span", { class: "muted" }, "progress"), el("span", {}, `${study.trials_done} of ${study.trials_budget} trials (space ${study.space_size})`),
      el("span", { class: "muted" }, "best so far"), el("span", {}, study.best ? `${study.best.decomposition_id} · ${x(study.best.speedup)}` : "–"),
      el("span", { class: "muted" }, "tuned config"), el("span", { id: "tuned" }, tuned ? `${study.tuned_decomposition_id} · ${ms(tuned.time_s)} vs baseline ${ms(tuned.baseline_s)} · ${x(tuned.speedup)}` : "not yet"),
      study.software ? [el("span", { class: "muted" }, "software stack"), el("span", { id: "study-software" }, `${stack(study.software)} (only its workers run the trials)`)] : null,
      study.reconfirm ? [el("span", { class: "muted" }, "re-confirms"), el("span", { id: "reconfirm" },
        `${study.reconfirm.decomposition_id} · ${x(study.reconfirm.config.speedup)} measured on ${stack(study.reconfirm.config.software)} · `,
        stateBadge(study.outcome))] : null,
      study.stop_reason ? [el("span", { class: "muted" }, "stopped by"), el("span", {}, study.stop_reason)] : null,
      study.message ? [el("span", { class: "muted" }, "note"), el("span", { id: "study-message" }, study.message)] : null,
      study.seeds && study.seeds.length ? [el("span", { class: "muted" }, "seeded with"), el("ul", { id: "study-seeds" }, study.seeds.map((s) => el("li", {},
        `${s.decomposition_id}: the ${s.kind} of ${s.neighbour} (${x(1 / s.ratio)} there), from `,
        s.source === "study" ? el("a", { href: `/ui/studies/${s.study_id}` }, `study #${s.study_id}`) : (s.source === "bundle" ? "a bundle" : "this run"))))] : null),
    tuned ? el("div", { class: "plot", id: "bounds" }, el("div", { class: "legend" }, "how close to the limit: the bounds of the tuned config"),
      boundsPicture({ ...tuned, decomposition_id: study.tuned_decomposition_id })) : null,
    el("div", { class: "plots" },
      el("div", { class: "plot" }, el("div", { class: "legend" }, "every finished trial's median time (blue), best so far (green), baseline (red)"), trialPlot(trials)),
      el("div", { class: "plot" }, el("div", { class: "legend" }, "time by chunks: unidirectional (blue), bidirectional (orange)"), fieldPlot(trials))),
    el("h2", {}, "Trials"),
    dataTable("trials", columns, trials, { filter: (t) => `${t.decomposition_id} ${t.state} ${t.status || ""} ${t.message || ""}` }),
  ));
}

async function workersPage() {
  const workers = await api("/v1/workers?include_inactive=true");
  const columns = [
    { key: "id", label: "worker", num: true, value: (w) => w.id },
    { key: "name", label: "name", value: (w) => w.name },
    { key: "hardware", label: "hardware", value: (w) => w.hardware_key },
    // a worker tunes every ring its devices split into: the hardware keys of those rings (a ring of 4 of 8: 4:1/8)
    { key: "rings", label: "also tunes rings", value: (w) => (w.ring_keys || []).slice(1).join(", ") || "-" },
    { key: "status", label: "status", value: (w) => (w.online ? "online" : w.active ? "offline" : "left"), render: (w) => stateBadge(w.online ? "online" : w.active ? "offline" : "left") },
    { key: "heartbeat", label: "last heartbeat", value: (w) => w.last_heartbeat, render: (w) => ago(w.last_heartbeat) },
    { key: "trial", label: "current trial", num: true, value: (w) => w.current_trial_id },
    { key: "done", label: "trials done", num: true, value: (w) => w.trials_done },
    { key: "software", label: "software", value: (w) => stack(w.software) },
  ];
  keepFocus(() => main.replaceChildren(el("h1", {}, "Workers"), dataTable("workers", columns, workers)));
}

async function configsPage() {
  const params = new URLSearchParams(location.search);
  const query = new URLSearchParams();
  for (const key of ["platform", "device_kind"]) if (params.get(key)) query.set(key, params.get(key));
  const [tuned, workers] = await Promise.all([api(`/v1/tuned?${query}`), api("/v1/workers")]);
  // the stacks of the registered workers on each hardware they tune (their own and their rings'): a problem with
  // no config of one of them is stale there
  const stacks = new Map(workers.flatMap((w) => (w.ring_keys && w.ring_keys.length ? w.ring_keys : [w.hardware_key])
    .map((key) => [`${key}|${w.software_key}`, { key, w }])));
  const have = new Set(tuned.map((c) => `${c.problem_key}|${c.hardware_key}|${c.software_key}`));
  const staleFor = (c) => [...stacks.values()].filter(({ key, w }) => key === c.hardware_key
    && !have.has(`${c.problem_key}|${c.hardware_key}|${w.software_key}`)).map(({ w }) => stack(w.software));
  // what a config is and what it gains first (its verdict and memory beside its speedup), the bounds and its
  // provenance after; the long keys wrap, so the table fits an ordinary window
  const columns = [
    { key: "problem", label: "problem", wrap: true, value: (c) => c.problem_key },
    { key: "hardware", label: "hardware", wrap: true, value: (c) => c.hardware_key },
    { key: "decomposition", label: "decomposition", value: (c) => c.decomposition_id },
    { key: "speedup", label: "speedup", num: true, value: (c) => c.speedup, render: (c) => el("span", { class: c.speedup > 1 ? "good" : "" }, x(c.speedup)) },
    { key: "overlap", label: "overlap", value: (c) => c.overlap || "–" },
    { key: "memory", label: "memory", num: true, value: (c) => c.memory_bytes, render: (c) => mib(c.memory_bytes) },
    { key: "time", label: "time", num: true, value: (c) => c.time_s, render: (c) => ms(c.time_s) },
    { key: "baseline", label: "baseline", num: true, value: (c) => c.baseline_s, render: (c) => ms(c.baseline_s) },
    { key: "hidden", label: "hidden", num: true, value: (c) => c.hidden_fraction, render: (c) => pct(c.hidden_fraction) },
    { key: "bound", label: "bound", num: true, value: (c) => c.bound_s, render: (c) => ms(c.bound_s) },
    { key: "compute", label: "compute", num: true, value: (c) => c.compute_s, render: (c) => ms(c.compute_s) },
    { key: "communication", label: "comm.", num: true, value: (c) => c.communication_s, render: (c) => ms(c.communication_s) },
    { key: "trials", label: "trials", num: true, value: (c) => c.trials, render: (c) => `${c.trials} / ${c.space_size}` },
    { key: "software", label: "measured on", wrap: true, value: (c) => stack(c.software) },
    { key: "stale", label: "stale for", wrap: true, value: (c) => staleFor(c).join("; "),
      render: (c) => (staleFor(c).length ? el("span", { class: "state stale" }, staleFor(c).join("; ")) : "–") },
  ];
  const field = (name, label) => el("input", { name, placeholder: label, value: params.get(name) || "" });
  keepFocus(() => main.replaceChildren(
    el("h1", {}, "Tuned configs"),
    el("form", { class: "toolbar", id: "config-filter", onsubmit: (event) => {
      event.preventDefault();
      const next = new URLSearchParams();
      for (const name of ["platform", "device_kind"]) if (event.target[name].value) next.set(name, event.target[name].value);
      go(`/ui/configs?${next}`);
    } }, field("platform", "platform"), field("device_kind", "device kind"), el("button", { type: "submit" }, "Filter"),
      el("button", { type: "button", id: "download", onclick: async () => download(await api(`/v1/bundles?${query}`)) },
        "Download bundle")),
    dataTable("configs", columns, tuned),
    tuned.length ? el("h2", {}, "How close to the limit, per problem") : null,
    el("div", { class: "pictures", id: "bounds-pictures" },
      tuned.map((c) => boundsPicture(c, `${c.problem_key} · ${c.hardware_key}`))),
  ));
}

function download(bundle) {
  const link = el("a", { href: URL.createObjectURL(new Blob([JSON.stringify(bundle, null, 2)], { type: "application/json" })),
                         download: "cmtune-bundle.json" });
  document.body.append(link); link.click(); link.remove();
}

async function submissionPage(id) {
  const sub = await api(`/v1/submissions/${id}`);
  const columns = [
    { key: "roles", label: "roles", value: (e) => e.roles.join(", ") },
    { key: "problem", label: "problem", value: (e) => e.problem_key },
    { key: "study", label: "study", num: true, value: (e) => e.study_id,
      render: (e) => (e.study_id ? el("a", { href: `/ui/studies/${e.study_id}` }, `#${e.study_id}`) : "tuned before") },
    { key: "state", label: "state", value: (e) => e.study_state, render: (e) => (e.study_state ? stateBadge(e.study_state) : "–") },
    { key: "decomposition", label: "tuned decomposition", value: (e) => e.decomposition_id },
    { key: "per_layer", label: "per layer", num: true, value: (e) => e.count },
    { key: "speedup", label: "speedup", num: true, value: (e) => e.speedup, render: (e) => el("span", { class: e.speedup > 1 ? "good" : "" }, x(e.speedup)) },
    { key: "bound", label: "bound", num: true, value: (e) => e.bound_s, render: (e) => ms(e.bound_s) },
    { key: "hidden", label: "hidden", num: true, value: (e) => e.hidden_fraction, render: (e) => pct(e.hidden_fraction) },
    { key: "saved", label: "saved per step", num: true, value: (e) => e.saved_s_per_step, render: (e) => ms(e.saved_s_per_step) },
  ];
  const step = sub.step;
  const speed = (s) => (s ? `${s.median.toFixed(2)}× (IQR ${s.low.toFixed(2)}–${s.high.toFixed(2)})` : "–");
  const stepCards = step ? [
    el("div", { class: "card" }, el("div", { class: "muted" }, "measured step vs the step as written"),
      el("div", { class: "value", id: "step-vs-reference" }, step.vs_reference ? speed(step.vs_reference) : step.state)),
    el("div", { class: "card" }, el("div", { class: "muted" }, "vs the all-baseline custom VJP"),
      el("div", { class: "value", id: "step-vs-baseline" }, speed(step.vs_baseline))),
    el("div", { class: "card" }, el("div", { class: "muted" }, "saved per step: measured"),
      el("div", { class: "value", id: "saved-measured" }, step.measured_saved_s_per_step === null ? "–" : ms(step.measured_saved_s_per_step))),
  ] : [];
  const variantColumns = [
    { key: "name", label: "variant", value: (v) => v.name, render: (v) => (v.name === step.variant ? el("strong", {}, `${v.name} (runs)`) : v.name) },
    { key: "status", label: "status", value: (v) => v.status, render: (v) => stateBadge(v.status === "ok" ? "completed" : "failed") },
    { key: "median", label: "step time", num: true, value: (v) => (v.timing ? v.timing.median_s : null), render: (v) => ms(v.timing ? v.timing.median_s : null) },
    { key: "iqr", label: "spread (IQR)", num: true, value: (v) => (v.timing ? v.timing.iqr_s : null), render: (v) => ms(v.timing ? v.timing.iqr_s : null) },
    { key: "speedup", label: "vs as written", num: true, value: (v) => (v.ratio ? 1 / v.ratio : null), render: (v) => x(v.ratio ? 1 / v.ratio : null) },
    { key: "compile", label: "compile", num: true, value: (v) => v.compile_s, render: (v) => (v.compile_s === null ? "–" : `${v.compile_s.toFixed(1)} s`) },
    { key: "message", label: "error", value: (v) => v.message || "" },
  ];
  keepFocus(() => main.replaceChildren(
    el("h1", {}, `Model ${sub.name} on ${Object.entries(sub.mesh.axes).map(([k, v]) => `${k}=${v}`).join(",")}`),
    el("div", { class: "cards" },
      el("div", { class: "card" }, el("div", { class: "muted" }, "layers"), el("div", { class: "value" }, sub.layers)),
      el("div", { class: "card" }, el("div", { class: "muted" }, "saved per step: estimated from the ops"),
        el("div", { class: "value", id: "saved-per-step" }, sub.saved_s_per_step === null ? "when every study is done" : ms(sub.saved_s_per_step))),
      ...stepCards),
    dataTable("roles", columns, sub.entries),
    sub.entries.some((e) => e.decomposition_id) ? el("h2", {}, "How close to the limit, per problem") : null,
    el("div", { class: "pictures", id: "bounds-pictures" },
      sub.entries.filter((e) => e.decomposition_id).map((e) => boundsPicture(e, `${e.roles.join(", ")} · ${e.problem_key}`))),
    step ? el("h2", {}, "The whole training step, measured") : null,
    step ? el("p", { class: "muted", id: "step-message" }, step.message || `step study #${step.study_id}: ${step.state}`) : null,
    step && step.decision && step.decision.bound ? el("p", { id: "step-bound" }, `Against its bound (per layer): ${step.decision.bound.summary}.`) : null,
    step && step.variants.length ? dataTable("variants", variantColumns, step.variants) : null,
    step && step.confirmation.length ? el("p", { class: "muted" }, "Timed again after the decision, in fresh rounds: the speedups above come from these.") : null,
    step && step.confirmation.length ? dataTable("confirmation", variantColumns, step.confirmation) : null,
    sub.overrides.length ? el("h2", {}, "Roles this model runs otherwise") : null,
    sub.overrides.length ? el("ul", { id: "overrides" }, sub.overrides.map((o) => el("li", {}, el("strong", {}, o.role), ` — ${o.reason}`))) : null,
  ));
}

// ---- router -----------------------------------------------------------------------------------

const ROUTES = [
  [/^\/ui\/?$/, "overview", () => overview()],
  [/^\/ui\/studies\/(\d+)$/, "overview", (m) => studyPage(m[1])],
  [/^\/ui\/workers$/, "workers", () => workersPage()],
  [/^\/ui\/configs$/, "configs", () => configsPage()],
  [/^\/ui\/submissions\/(\d+)$/, "overview", (m) => submissionPage(m[1])],
];

// A link signs in with the token in its fragment (#token=cmt_…), which a browser never sends to a server nor
// puts in a Referer: the page stores it and drops it from the address before it asks the API.  A ?token= of
// an older link is taken the same way.
function takeToken() {
  const query = new URLSearchParams(location.search), fragment = new URLSearchParams(location.hash.slice(1));
  const token = fragment.get("token") || query.get("token");
  if (!token) return;
  localStorage.setItem(TOKEN_KEY, token);
  query.delete("token");
  fragment.delete("token");
  const rest = `${String(query) ? `?${query}` : ""}${String(fragment) ? `#${fragment}` : ""}`;
  history.replaceState({}, "", `${location.pathname}${rest}`);
}

function route(rerender = false) {
  takeToken();  // also on a popstate: a #token= pasted over an open page navigates within it
  document.getElementById("logout").hidden = !localStorage.getItem(TOKEN_KEY);
  for (const [pattern, nav, render] of ROUTES) {
    const match = location.pathname.match(pattern);
    if (!match) continue;
    document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === nav));
    if (rerender) return render(match).catch(() => {});
    return live(() => render(match));
  }
  stop();
  main.replaceChildren(el("h1", {}, "Not found"), el("p", {}, el("a", { href: "/ui" }, "Back to the studies")));
}

document.addEventListener("click", (event) => {
  const link = event.target.closest("a[href^='/ui']");
  if (link && !event.metaKey && !event.ctrlKey) { event.preventDefault(); go(link.getAttribute("href")); }
});
document.getElementById("logout").addEventListener("click", () => { localStorage.removeItem(TOKEN_KEY); route(); });
window.addEventListener("popstate", () => route());
route();
