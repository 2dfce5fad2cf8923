// Tandem dashboard: polls GET /v1/dashboard every second and redraws each section.
// Plain DOM, no libraries. Every element a test or an operator looks for has a stable
// id, class or data-* attribute.
"use strict";

const POLL_MS = 1000;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c) e.append(c);
  return e;
}

function fmt(v, digits = 0, unit = "") {
  return v === null || v === undefined ? "-" : Number(v).toFixed(digits) + unit;
}

function gauge(pct) {
  const g = el("div", { class: "gauge" });
  const bar = el("div");
  bar.style.width = Math.max(0, Math.min(100, pct || 0)) + "%";
  g.append(bar);
  return g;
}

function renderClusters(fleet) {
  const root = document.getElementById("clusters");
  root.replaceChildren();
  if (!fleet.clusters.length) {
    root.append(el("p", { class: "muted", text: "no heartbeats yet" }));
    return;
  }
  for (const c of fleet.clusters) {
    const card = el("div", { class: "cluster" + (c.healthy ? "" : " unhealthy"),
                             "data-cluster": c.name, "data-healthy": String(c.healthy) });
    card.append(el("h3", { text: `${c.name} — ${c.healthy ? "healthy" : "UNHEALTHY"}` }));
    card.append(el("div", { class: "muted", text:
      `nodes ${c.nodes_up}/${c.nodes_total} up · GPUs ${c.gpus_total} (${c.gpus_free} free)` +
      ` · models: ${c.models.join(", ") || "-"}` }));
    for (const n of c.nodes) {
      const node = el("div", { class: "node", "data-node": `${c.name}/${n.node}`,
                               "data-status": n.status });
      node.append(el("b", { text: n.node + " " }),
                  el("span", { class: "badge " + n.status, text: n.status }),
                  el("span", { class: "muted", text:
                    ` heartbeat ${fmt(n.age_s, 1, "s")} ago` +
                    (n.findings.length ? " · " + n.findings.join(", ") : "") +
                    (n.drained ? " · drained: " + n.drain_reason : "") }));
      for (const g of n.gpus || []) {
        const row = el("div", { class: "gpu", "data-gpu": `${c.name}/${n.node}/${g.index}`,
                                "data-util": fmt(g.util) });
        row.append(el("span", { text: "gpu" + g.index }), gauge(g.util),
                   el("span", { text: fmt(g.util, 0, "%") }),
                   el("span", { text: fmt(g.temp, 0, "°C") + " " + fmt(g.power, 0, "W") }));
        node.append(row);
      }
      card.append(node);
    }
    root.append(card);
  }
}

function renderQueues(queues) {
  const body = document.querySelector("#queues tbody");
  body.replaceChildren();
  for (const q of queues) {
    body.append(el("tr", { "data-queue": `${q.cluster}/${q.lane}` },
      el("td", { text: q.cluster }), el("td", { text: q.lane }),
      el("td", { class: "depth", text: String(q.depth) }),
      el("td", { text: q.depth ? fmt(q.oldest_age_s, 1, " s") : "-" })));
  }
}

function lossCurve(points, checkpoints) {
  const W = 480, H = 160, P = 30;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W);
  svg.setAttribute("height", H);
  svg.setAttribute("class", "loss-curve");
  if (points.length < 2) return svg;
  const xs = points.map(p => p[0]);
  const ys = points.map(p => Math.log10(Math.max(p[1], 1e-6)));
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = x => P + (W - 2 * P) * (x - x0) / Math.max(x1 - x0, 1);
  const sy = y => H - P + (-(H - 2 * P)) * (y - y0) / Math.max(y1 - y0, 1e-9);
  for (const c of checkpoints) {
    if (c < x0 || c > x1) continue;
    const l = document.createElementNS(ns, "line");
    l.setAttribute("x1", sx(c)); l.setAttribute("x2", sx(c));
    l.setAttribute("y1", P); l.setAttribute("y2", H - P);
    l.setAttribute("stroke", "#2e9e4f"); l.setAttribute("stroke-dasharray", "3,3");
    svg.append(l);
  }
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.map((p, i) => `${sx(xs[i])},${sy(ys[i])}`).join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#3b7ddd");
  svg.append(line);
  const label = (x, y, text, anchor) => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", x); t.setAttribute("y", y); t.setAttribute("font-size", "10");
    t.setAttribute("text-anchor", anchor || "start"); t.textContent = text;
    svg.append(t);
  };
  label(P, P - 8, `loss (log) ${Math.pow(10, y1).toPrecision(3)}`);
  label(P, H - P + 12, `min ${Math.pow(10, y0).toPrecision(3)}`);
  label(W - P, H - 6, `step ${x1}`, "end");
  label(P, H - 6, `step ${x0}`);
  return svg;
}

function renderRuns(runs) {
  const root = document.getElementById("runs");
  root.replaceChildren();
  if (!runs.length) {
    root.append(el("p", { class: "muted", text: "no runs yet" }));
    return;
  }
  for (const r of runs) {
    const last = r.loss.length ? r.loss[r.loss.length - 1][1] : null;
    const box = el("div", { class: "run", "data-run": r.run_id, "data-state": r.state,
                            "data-step": String(r.latest_step) });
    box.append(el("div", {}, el("b", { text: r.run_id + " " }),
      el("span", { class: "badge", text: r.state }),
      el("span", { class: "muted", text:
        ` step ${r.latest_step}/${r.steps} · loss ${fmt(last, 4)} · restarts ${r.restarts}` +
        ` · checkpoint ${r.latest_checkpoint_step ?? "-"}` +
        ` · goodput ${r.goodput === null ? "-" : (100 * r.goodput).toFixed(1) + "%"}` })));
    box.append(lossCurve(r.loss, r.checkpoints));
    root.append(box);
  }
}

let shownGenerations = null;

function renderGenerations(gens) {
  const root = document.getElementById("generations");
  const ids = gens.map(g => g.id).join(",");
  if (ids === shownGenerations) return;  // unchanged: keep the loaded images
  shownGenerations = ids;
  root.replaceChildren();
  if (!gens.length) {
    root.append(el("p", { class: "muted", text: "none yet" }));
    return;
  }
  for (const g of gens) {
    const box = el("div", { class: "gen", "data-task": g.id });
    for (const url of g.image_urls) box.append(el("img", { src: url, alt: g.id }));
    box.append(el("div", { text: `${g.cluster} · ${g.worker}` }),
               el("div", { class: "muted", text: g.checkpoint || "built-in weights" }));
    root.append(box);
  }
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const r = await fetch("/v1/dashboard", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const s = await r.json();
    renderClusters(s.fleet);
    renderQueues(s.queues);
    renderRuns(s.runs);
    renderGenerations(s.generations);
    status.textContent = "live · " + new Date(s.at * 1000).toLocaleTimeString();
    status.dataset.live = "true";
  } catch (e) {
    status.textContent = "gateway unreachable: " + e.message;
    status.dataset.live = "false";
  }
  setTimeout(poll, POLL_MS);
}

poll();
