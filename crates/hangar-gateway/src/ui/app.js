// Hangar's status page: renders what GET /admin/status answers, every 2 s.
//
// No framework and no build step. Every element is built with
// createElement and textContent, never innerHTML, so nothing the server
// sends (model keys, engine errors) is ever read as markup. The page keeps
// no state of its own beyond the last answer: each poll redraws it whole.
"use strict";

const POLL_MS = 2000;
/** How many decisions and starts the two logs show. */
const LOG_LINES = 12;

const $ = (id) => document.getElementById(id);

/** An element with attributes and children (strings become text). */
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function ms(v) {
  if (v === undefined || v === null) return "—";
  if (v < 1000) return `${Math.round(v)} ms`;
  if (v < 60000) return `${(v / 1000).toFixed(1)} s`;
  return `${(v / 60000).toFixed(1)} min`;
}

function gigabytes(bytes) {
  return `${Math.round(bytes / 1e9)} GB`;
}

function rate(v) {
  if (v === undefined || v === null) return "—";
  return v < 10 ? v.toFixed(2) : v.toFixed(1);
}

function percent(v) {
  return v === undefined || v === null ? "—" : `${Math.round(v * 100)} %`;
}

function clock(at) {
  return new Date(at).toLocaleTimeString([], { hour12: false });
}

/** The short form of a replica's name `<model>:<id>`: its id's first 8 digits. */
function shortId(name) {
  return name.slice(name.lastIndexOf(":") + 1).slice(0, 8);
}

/** A small line plot of `values` (nulls are gaps), as inline SVG. */
function sparkline(values, label) {
  const NS = "http://www.w3.org/2000/svg";
  const w = 120;
  const h = 26;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const known = values.filter((v) => v !== null && v !== undefined);
  if (known.length === 0) return svg;
  const top = Math.max(...known) || 1;
  const step = values.length > 1 ? w / (values.length - 1) : w;
  // Each run of known values is a line, with the area under it shaded.
  let line = "";
  let area = "";
  let run = [];
  const flush = () => {
    if (run.length === 0) return;
    line += run.map(([x, y], i) => `${i ? "L" : "M"}${x} ${y}`).join(" ") + " ";
    area += `M${run[0][0]} ${h} ` + run.map(([x, y]) => `L${x} ${y}`).join(" ") + ` L${run[run.length - 1][0]} ${h} Z `;
    run = [];
  };
  values.forEach((v, i) => {
    if (v === null || v === undefined) return flush();
    run.push([(i * step).toFixed(1), (h - 2 - (v / top) * (h - 4)).toFixed(1)]);
  });
  flush();
  for (const [cls, d] of [["area", area], ["line", line]]) {
    const path = document.createElementNS(NS, "path");
    path.setAttribute("class", cls);
    path.setAttribute("d", d.trim());
    svg.append(path);
  }
  return svg;
}

/** A bar filled to `share` (0 to 1). */
function bar(share, title) {
  const fill = el("span", { class: "fill" });
  fill.style.width = `${Math.round(Math.min(1, Math.max(0, share || 0)) * 100)}%`;
  return el("span", { class: "bar", title }, fill);
}

function replicaChip(model, r) {
  const inst = r.instance || {};
  const util = inst.utilization;
  const lines = [
    `${r.name}`,
    `state ${r.state}${inst.state ? `, ${inst.state}` : ""}, ${inst.in_flight ?? r.in_flight} in flight`,
  ];
  if (util !== undefined) {
    lines.push(`last 15 s: utilization ${percent(util)}, mean concurrency ${inst.mean_concurrency.toFixed(2)}`);
  }
  if (r.failure) lines.push(`failed: ${r.failure}`);
  return el(
    "div",
    {
      class: `replica state-${r.state}`,
      "data-replica": r.name,
      "data-model": model,
      "data-state": r.state,
      "data-instance": inst.state,
      title: lines.join("\n"),
    },
    el("span", { class: "rmodel" }, model),
    el("span", { class: "rid" }, shortId(r.name)),
    el("span", { class: "badge" }, r.state),
    inst.state ? el("span", { class: `inst inst-${inst.state}` }, inst.state) : null,
    el("span", { class: "load" }, bar(util, "utilization, last 15 s"), `${inst.in_flight ?? r.in_flight}`),
  );
}

/** Nodes, each GPU with the replicas on it, and those on no GPU. */
function renderNodes(status) {
  const byNode = new Map();
  for (const n of status.nodes || []) byNode.set(n.name, { node: n, replicas: [] });
  for (const m of status.models) {
    for (const r of m.replicas) {
      const name = r.node || "unplaced";
      if (!byNode.has(name)) byNode.set(name, { node: { name, gpus: 0 }, replicas: [] });
      byNode.get(name).replicas.push([m.model, r]);
    }
  }
  const cards = [];
  for (const { node, replicas } of byNode.values()) {
    const gpus = [];
    const placed = new Set();
    for (let g = 0; g < (node.gpus || 0); g++) {
      const here = replicas.filter(([, r]) => (r.engine_gpus || r.gpus || []).includes(g));
      here.forEach(([, r]) => placed.add(r.name));
      gpus.push(
        el(
          "div",
          { class: "gpu", "data-gpu": g },
          el("span", { class: "glabel" }, `GPU ${g}`),
          el("div", { class: "chips" }, here.length ? here.map(([m, r]) => replicaChip(m, r)) : el("span", { class: "muted" }, "free")),
        ),
      );
    }
    const elsewhere = replicas.filter(([, r]) => !placed.has(r.name));
    if (elsewhere.length) {
      gpus.push(
        el(
          "div",
          { class: "gpu off" },
          el("span", { class: "glabel" }, "no GPU"),
          el("div", { class: "chips" }, elsewhere.map(([m, r]) => replicaChip(m, r))),
        ),
      );
    }
    const resident = (node.resident || []).length;
    const facts = [
      node.gpu_kind,
      node.gpus ? `${node.gpus} × ${gigabytes(node.gpu_memory)}` : null,
      node.draining ? "draining" : null,
      node.suspect ? "suspect: not answering" : null,
      resident ? `weights of ${resident} artifact${resident > 1 ? "s" : ""} resident` : null,
    ]
      .filter(Boolean)
      .join(" · ");
    cards.push(
      el(
        "div",
        { class: "node", "data-node": node.name },
        el("h3", {}, node.name, el("span", { class: "muted" }, facts)),
        gpus,
      ),
    );
  }
  $("nodes").replaceChildren(...(cards.length ? cards : [el("p", { class: "muted" }, "no node known yet")]));
}

function renderModels(status) {
  const rows = status.models.map((m) => {
    const s = m.scaling || {};
    const points = m.history || [];
    const last = points[points.length - 1];
    const utils = m.replicas.map((r) => r.instance && r.instance.utilization).filter((u) => u !== undefined && u !== null);
    const util = utils.length ? utils.reduce((a, b) => a + b, 0) / utils.length : null;
    const blocked = s.unplaceable ? el("div", { class: "warn" }, `unplaceable: ${s.unplaceable.reason}`) : null;
    return el(
      "tr",
      { "data-model": m.model },
      el("td", { class: "key" }, m.model, blocked),
      el("td", {}, s.policy || "—", s.override ? el("span", { class: "muted" }, ` ${JSON.stringify(s.override)}`) : null),
      el("td", { class: "counts" }, `${m.ready} / ${s.desired ?? "—"}`),
      el("td", { class: "queue" }, `${m.queue.waiting} / ${m.queue.capacity} `, el("span", { class: "muted" }, m.queue.algorithm)),
      el("td", {}, `${m.permits.used} / ${m.permits.total}`),
      el(
        "td",
        { class: "rps", "data-rps": last ? last.requests_per_s : "" },
        el("span", { class: "figure" }, rate(last && last.requests_per_s)),
        sparkline(points.map((p) => p.requests_per_s), "requests per second"),
      ),
      el(
        "td",
        { class: "ttft", "data-ttft-ms": m.ttft_p99_ms ?? "" },
        el("span", { class: "figure" }, ms(m.ttft_p99_ms)),
        sparkline(points.map((p) => p.ttft_p99_ms), "TTFT p99"),
      ),
      el("td", { class: "util" }, bar(util, "mean utilization of its replicas, last 15 s"), percent(util)),
    );
  });
  $("models").tBodies[0].replaceChildren(...rows);
}

function renderDecisions(status) {
  const all = [];
  for (const m of status.models) {
    const s = m.scaling;
    if (!s || !s.decisions) continue;
    for (const d of s.decisions) {
      // `at_ms` is on the controller's clock, whose now is `now_ms`.
      all.push({ model: m.model, at: status.at_ms - (s.now_ms - d.at_ms), d });
    }
  }
  all.sort((a, b) => b.at - a.at);
  const items = all.slice(0, LOG_LINES).map(({ model, at, d }) =>
    el(
      "li",
      { "data-model": model, class: d.desired > d.previous ? "up" : "down" },
      el("time", {}, clock(at)),
      el("span", { class: "key" }, model),
      el("span", { class: "change" }, `${d.previous} → ${d.desired}`),
      el("span", { class: "why" }, d.reason),
    ),
  );
  const none = status.fleet && !status.fleet.leading ? "the leading gateway's page shows them" : "none yet";
  $("decisions").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, none)]));
}

function renderStarts(status) {
  const all = status.models.flatMap((m) => (m.starts || []).map((s) => ({ model: m.model, s })));
  all.sort((a, b) => b.s.started_at_ms - a.s.started_at_ms);
  const items = all.slice(0, LOG_LINES).map(({ model, s }) => {
    const phases = (s.phases || [])
      .filter((p) => p.phase !== "placed")
      .map((p) => `${p.phase} ${ms(p.at_ms)}`)
      .join(" → ");
    const weights = s.weights ? ` (weights ${s.weights.source})` : "";
    return el(
      "li",
      { "data-model": model, "data-status": s.status, class: s.status },
      el("time", {}, clock(s.started_at_ms)),
      el("span", { class: "key" }, `${model}:${shortId(s.replica)}`),
      el("span", { class: "muted" }, s.node || ""),
      el("span", { class: "badge" }, s.status),
      el("span", { class: "why" }, s.status === "ready" ? `${phases}${weights}` : `after ${ms(s.ready_ms)}`),
      s.error ? el("pre", { class: "error", title: s.error }, s.error.slice(-400)) : null,
    );
  });
  $("starts").replaceChildren(...(items.length ? items : [el("li", { class: "muted" }, "none yet")]));
}

function renderSummary(status) {
  const replicas = status.models.flatMap((m) => m.replicas);
  const ready = replicas.filter((r) => r.state === "ready").length;
  const active = replicas.filter((r) => r.instance && r.instance.state === "active").length;
  const rps = status.models.reduce((sum, m) => {
    const h = m.history || [];
    return sum + (h.length ? h[h.length - 1].requests_per_s : 0);
  }, 0);
  const ttfts = status.models.map((m) => m.ttft_p99_ms).filter((t) => t !== null && t !== undefined);
  const figure = (label, value, id) => el("div", { class: "fig", id }, el("span", { class: "value" }, value), el("span", { class: "label" }, label));
  $("summary").replaceChildren(
    figure("nodes", String((status.nodes || []).length), "sum-nodes"),
    figure("models", String(status.models.length), "sum-models"),
    figure("replicas ready", `${ready} / ${replicas.length}`, "sum-ready"),
    figure("replicas active", String(active), "sum-active"),
    figure("requests/s", rate(rps), "sum-rps"),
    figure("worst TTFT p99 (1 min)", ttfts.length ? ms(Math.max(...ttfts)) : "—", "sum-ttft"),
  );
  const where = status.fleet ? `gateway ${status.fleet.gateway} · ${status.fleet.leading ? "leader" : "not leading"}` : "one machine";
  $("where").textContent = where;
}

function render(status) {
  renderSummary(status);
  renderNodes(status);
  renderModels(status);
  renderDecisions(status);
  renderStarts(status);
  $("updated").textContent = `updated ${clock(status.at_ms)}`;
  $("updated").className = "muted";
  document.body.dataset.rendered = String(status.at_ms);
}

function trouble(text) {
  $("updated").textContent = text;
  $("updated").className = "error";
}

async function poll() {
  try {
    const answer = await fetch("/admin/status", { credentials: "same-origin", cache: "no-store" });
    if (answer.ok) {
      render(await answer.json());
    } else {
      const body = await answer.json().catch(() => ({}));
      const why = (body.error && body.error.message) || answer.statusText;
      trouble(answer.status === 401 || answer.status === 403 ? `${why} — open /ui?key=YOUR_ADMIN_KEY` : `${answer.status}: ${why}`);
    }
  } catch (e) {
    trouble(`cannot reach the server (${e.message}); retrying`);
  }
  setTimeout(poll, POLL_MS);
}

poll();
