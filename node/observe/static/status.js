// The swarm's status page: fetch /api/status every interval and draw it.
// Everything in the JSON comes from peers (names, addresses, devices): it is untrusted, so it
// is only ever set as textContent or as numeric SVG attributes, never parsed as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
let intervalMs = 3000;

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function num(value, digits) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) : "";
}

function short(peer) {
  const text = String(peer);
  return text.length > 14 ? text.slice(0, 6) + ".." + text.slice(-6) : text;
}

function fillRows(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(...rows.map((cells) => {
    const tr = el("tr");
    for (const [text, className] of cells) tr.append(el("td", text, className));
    return tr;
  }));
}

function drawCurve(points) {
  const svg = document.getElementById("loss-curve");
  svg.replaceChildren();
  const clean = points.filter((p) => Array.isArray(p) && p.length === 2 &&
    Number.isFinite(p[0]) && Number.isFinite(p[1]));
  document.getElementById("loss-points").textContent = clean.length + " loss points";
  svg.setAttribute("data-points", String(clean.length));
  if (clean.length === 0) return;
  const [w, h, pad] = [640, 240, 36];
  const steps = clean.map((p) => p[0]);
  const losses = clean.map((p) => p[1]);
  const [x0, x1] = [Math.min(...steps), Math.max(...steps)];
  const [y0, y1] = [Math.min(...losses), Math.max(...losses)];
  const x = (s) => pad + (x1 > x0 ? (s - x0) / (x1 - x0) : 0.5) * (w - 2 * pad);
  const y = (l) => h - pad - (y1 > y0 ? (l - y0) / (y1 - y0) : 0.5) * (h - 2 * pad);
  const axis = document.createElementNS(SVG, "polyline");
  axis.setAttribute("class", "axis");
  axis.setAttribute("points", `${pad},${pad} ${pad},${h - pad} ${w - pad},${h - pad}`);
  svg.append(axis);
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("class", "line");
  line.setAttribute("points", clean.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" "));
  svg.append(line);
  for (const p of clean.slice(-200)) {
    const dot = document.createElementNS(SVG, "circle");
    dot.setAttribute("class", "point");
    dot.setAttribute("cx", x(p[0]).toFixed(1));
    dot.setAttribute("cy", y(p[1]).toFixed(1));
    dot.setAttribute("r", "2.5");
    svg.append(dot);
  }
  const labels = [[pad + 2, pad - 6, `loss ${y1.toFixed(3)}`], [pad + 2, h - pad + 14, `${y0.toFixed(3)}`],
                  [w - pad - 60, h - pad + 14, `step ${x1}`], [pad + 50, h - pad + 14, `step ${x0}`]];
  for (const [lx, ly, text] of labels) {
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", String(lx));
    label.setAttribute("y", String(ly));
    label.textContent = text;
    svg.append(label);
  }
}

function drawPlan(plan) {
  const stages = plan ? plan.stages : [];
  const fences = plan ? plan.fences : [];
  document.getElementById("plan").textContent = plan
    ? `plan ${String(plan.digest).slice(0, 12)}: estimated step ${num(plan.estimated_step_time_s, 4)} s, ` +
      `bubble ${num(100 * plan.bubble_fraction, 0)}%`
    : "none agreed yet";
  fillRows("stages", stages.map((s) => [
    [s.index], [`${s.nodes[0]}..${s.nodes[1] - 1}`], [`${s.first_node} .. ${s.last_node}`],
    [s.peers.map(short).join(", "), "id"],
  ]));
  const list = document.getElementById("fences");
  list.replaceChildren(...fences.map((f) => el("li", f.map(short).join(", "), "id")));
  fillRows("cuts", (plan ? plan.links : []).map((c) => [[c.after_stage], [c.forward], [c.backward]]));
  const backup = plan ? plan.backup : [];
  document.getElementById("backup").textContent =
    "backup: " + (backup.length ? backup.map(short).join(", ") : "none");
}

// The plan's codec for what src sends dst: forward across cut s from stage s to s + 1,
// backward from s + 1 to s; "" for peers the plan does not join by a cut.
function codecOf(plan) {
  const stageOf = new Map();
  for (const s of plan ? plan.stages : []) for (const p of s.peers) stageOf.set(p, s.index);
  const cuts = new Map((plan ? plan.links : []).map((c) => [c.after_stage, c]));
  return (src, dst) => {
    const [a, b] = [stageOf.get(src), stageOf.get(dst)];
    if (a === undefined || b === undefined) return "";
    if (b === a + 1 && cuts.has(a)) return "forward " + cuts.get(a).forward;
    if (a === b + 1 && cuts.has(b)) return "backward " + cuts.get(b).backward;
    return "";
  };
}

function draw(data) {
  const error = document.getElementById("error");
  error.hidden = !data.error;
  error.textContent = data.error ? "last read failed: " + data.error : "";
  if (Number.isFinite(data.interval_s)) intervalMs = Math.max(200, 1000 * data.interval_s);
  drawCurve(Array.isArray(data.loss_curve) ? data.loss_curve : []);
  const status = data.status;
  if (!status) return;
  document.getElementById("swarm").textContent = status.swarm;
  const read = data.read_at ? new Date(1000 * data.read_at).toLocaleTimeString() : "";
  const loss = Number.isFinite(status.loss) ? `, loss ${status.loss.toFixed(4)}` : "";
  const step = status.step === null ? "not training yet" : `step ${status.step}${loss}`;
  document.getElementById("summary").textContent =
    `${status.peers.length} peers; ${step}${status.finished ? " (finished)" : ""}; read at ${read}`;
  drawPlan(status.plan);
  fillRows("peers", status.peers.map((p) => [
    [p.peer_id, "id"], [p.observer ? "observer" : p.state], [p.stage === null ? "" : p.stage],
    [`${p.device} (${p.kind})`], [num(p.gflops, 1), "num"], [num(p.uplink_mb_s, 1), "num"],
    [num(p.downlink_mb_s, 1), "num"], [p.step === null ? "" : p.step, "num"],
    [num(p.loss, 4), "num"], [num(p.record_age_s, 1), "num"], [p.addrs.join(" "), "id"],
  ]));
  const codec = codecOf(status.plan);
  fillRows("links", status.links.map((l) => [
    [short(l.src), "id"], [short(l.dst), "id"], [num(l.mb_s, 2), "num"],
    [num(l.rtt_ms, 2), "num"], [num(l.age_s, 1), "num"], [codec(l.src, l.dst)],
  ]));
}

async function refresh() {
  try {
    const response = await fetch("/api/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    draw(await response.json());
  } catch (err) {
    const error = document.getElementById("error");
    error.hidden = false;
    error.textContent = "cannot reach the status server: " + err.message;
  }
  setTimeout(refresh, intervalMs);
}

refresh();
