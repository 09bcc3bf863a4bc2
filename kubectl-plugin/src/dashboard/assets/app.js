// batchlease dashboard: one page, hash routes, data from /api/*, kept live
// by the server's event stream (/api/events). No framework, no build.
"use strict";

const TOKEN = document.querySelector('meta[name="batchlease-token"]').content;
const main = document.getElementById("main");
const PHASES = ["Pending", "Ready", "Running", "Succeeded", "DeadLettered", "Rejected", "Cancelled"];
let info = null;
let refreshing = false;
let again = false;

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function age(secs) {
  if (secs === null || secs === undefined) return "—";
  if (secs < 120) return `${secs}s`;
  if (secs < 7200) return `${Math.floor(secs / 60)}m`;
  if (secs < 172800) return `${Math.floor(secs / 3600)}h`;
  return `${Math.floor(secs / 86400)}d`;
}
function phase(p) {
  return p ? `<span class="phase phase-${esc(p)}">${esc(p)}</span>` : `<span class="muted">missing</span>`;
}
function time(t) {
  return t ? new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "—";
}
async function getJSON(url) {
  const r = await fetch(url, { headers: { Accept: "application/json" } });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}
async function post(url) {
  const r = await fetch(url, { method: "POST", headers: { "X-Batchlease-Token": TOKEN } });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

// ---- routing ---------------------------------------------------------------

function route() {
  // Only "#/…" is a route ("#main" is the skip link's target).
  const h = location.hash.startsWith("#/") ? location.hash.slice(1) : "/queues";
  const [path, query] = h.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] || "queues", parts, params: new URLSearchParams(query || "") };
}

function setCurrentNav(page) {
  for (const a of document.querySelectorAll("nav a")) {
    if (a.id === `nav-${page}` || (page === "task" && a.id === "nav-tasks")) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

// Re-renders a region only when its HTML changed, and keeps the keyboard
// focus where it was: on the element with the same id, or the link with
// the same target, or the button for the same task.
function focusKey(a) {
  if (!a || a === document.body) return null;
  if (a.id) return `#${CSS.escape(a.id)}`;
  if (a.getAttribute("href")) return `[href="${CSS.escape(a.getAttribute("href"))}"]`;
  if (a.dataset && a.dataset.task) return `${a.tagName.toLowerCase()}[data-task="${CSS.escape(a.dataset.task)}"]`;
  return null;
}
window.__renders = 0;
function put(el, html) {
  if (el.dataset.html === html) return;
  const key = el.contains(document.activeElement) ? focusKey(document.activeElement) : null;
  el.innerHTML = html;
  el.dataset.html = html;
  window.__renders += 1;
  if (key) {
    const f = el.querySelector(key);
    if (f) f.focus();
  }
}

// The static frame of a page (forms, headings) is drawn once per route;
// the data region inside it on every change.
let frameFor = null;
function frame(key, html) {
  if (frameFor !== key) {
    main.innerHTML = html;
    frameFor = key;
  }
}

async function refresh() {
  if (refreshing) { again = true; return; }
  refreshing = true;
  try {
    const r = route();
    setCurrentNav(r.page);
    if (r.page === "queues") await queuesPage();
    else if (r.page === "tasks") await tasksPage(r.params, false);
    else if (r.page === "dead") await tasksPage(r.params, true);
    else if (r.page === "task") await taskPage(r.parts[1], r.parts[2]);
    else if (r.page === "locks") await locksPage();
    else { frame("404", `<p>No such page.</p>`); }
  } catch (e) {
    // In the page's data region when it has one: the filter form above
    // stays, so a bad filter can be corrected.
    const region = main.querySelector(".data");
    const msg = `<div class="problem" id="load-error">Could not load: ${esc(e.message)}</div>`;
    if (region) put(region, msg);
    else { frameFor = null; main.innerHTML = msg; }
  } finally {
    refreshing = false;
    if (again) { again = false; refresh(); }
  }
}

// ---- queues ----------------------------------------------------------------

async function queuesPage() {
  frame("queues", `<h2>Queues</h2><div id="queues-data" class="data"></div>`);
  const rows = await getJSON("/api/queues");
  const all = !info || !info.namespace;
  let h = `<table id="queues"><thead><tr>${all ? "<th>Namespace</th>" : ""}<th>Queue</th><th>Paused</th>` +
    PHASES.map((p) => `<th class="num">${p}</th>`).join("") +
    `<th class="num">Offered</th><th class="num">Held</th><th>Oldest ready</th><th>Abort rate</th><th>Throttling</th><th>Holders</th></tr></thead><tbody>`;
  for (const q of rows) {
    const link = `#/tasks?namespace=${encodeURIComponent(q.namespace)}&queue=${encodeURIComponent(q.queue)}`;
    const thr = [];
    if (q.atCapacity) thr.push(`at capacity (${q.maxConcurrent})`);
    if (q.maxIssuesPerSecond) thr.push(`≤ ${q.maxIssuesPerSecond}/s`);
    const held = q.throttled || {};
    const back = (held.paused || 0) + (held.maxConcurrent || 0) + (held.rate || 0);
    if (back) thr.push(`${back} held back`);
    if (held.workerSlots) thr.push(`${held.workerSlots} waited for a worker slot`);
    h += `<tr data-queue="${esc(q.namespace)}/${esc(q.queue)}">${all ? `<td>${esc(q.namespace)}</td>` : ""}` +
      `<td><a href="${link}">${esc(q.queue)}</a></td><td>${q.paused ? "<strong>paused</strong>" : "no"}</td>` +
      PHASES.map((p) => `<td class="num" data-phase="${p}"><a href="${link}&phase=${p}">${q.phases[p] || 0}</a></td>`).join("") +
      `<td class="num">${q.offered}</td><td class="num">${q.held}</td><td>${age(q.oldestReadySeconds)}</td>` +
      `<td>${q.abortRate === null || q.abortRate === undefined ? "—" : Math.round(q.abortRate * 100) + "%"}</td>` +
      `<td>${esc(thr.join(", ") || "—")}</td><td>${esc(q.holders.join(", ") || "—")}</td></tr>`;
  }
  h += `</tbody></table>`;
  if (!rows.length) h = `<p class="muted">No queues yet: no BatchTasks or TaskQueues here.</p>`;
  put(document.getElementById("queues-data"), h);
}

// ---- tasks and dead letters ---------------------------------------------------

function filterForm(params, dead) {
  const v = (k) => esc(params.get(k) || "");
  const phaseSel = dead ? "" : `<label>Phase<select id="f-phase" name="phase"><option value="">any</option>` +
    PHASES.map((p) => `<option${params.get("phase") === p ? " selected" : ""}>${p}</option>`).join("") + `</select></label>`;
  return `<form class="filters" id="filters">
    <label>Queue<input id="f-queue" name="queue" value="${v("queue")}" size="12"></label>
    ${phaseSel}
    <label>Labels<input id="f-label" name="label" value="${v("label")}" placeholder="team=red" size="14"></label>
    <label>Name contains<input id="f-q" name="q" value="${v("q")}" size="14"></label>
    <input type="hidden" name="namespace" value="${v("namespace")}">
    <button id="f-apply">Filter</button></form>`;
}

async function tasksPage(params, dead) {
  const key = (dead ? "dead?" : "tasks?") + params.toString();
  frame(key, `<h2>${dead ? "Dead letters" : "Tasks"}</h2>${filterForm(params, dead)}<div id="action-result" role="status"></div><div id="tasks-data" class="data"></div>`);
  const form = document.getElementById("filters");
  form.onsubmit = (e) => {
    e.preventDefault();
    const p = new URLSearchParams();
    for (const [k, val] of new FormData(form)) if (val) p.set(k, val);
    location.hash = `#/${dead ? "dead" : "tasks"}?${p}`;
  };
  const q = new URLSearchParams(params);
  if (dead) q.set("phase", "DeadLetters");
  const page = await getJSON(`/api/tasks?${q}`);
  const all = !info || !info.namespace;
  let h = `<div class="pager"><span id="total">${page.total} task${page.total === 1 ? "" : "s"}</span>`;
  if (page.total > page.limit || page.offset > 0) {
    h += `<button class="secondary" id="prev"${page.offset === 0 ? " disabled" : ""}>Previous</button>` +
      `<span>${page.offset + 1}–${page.offset + page.rows.length}</span>` +
      `<button class="secondary" id="next"${page.offset + page.limit >= page.total ? " disabled" : ""}>Next</button>`;
  }
  h += `</div><table id="${dead ? "dead" : "tasks"}"><thead><tr>${all ? "<th>Namespace</th>" : ""}<th>Task</th><th>Queue</th><th>Phase</th>` +
    `<th class="num">Token</th><th class="num">Attempts</th><th>Holder</th><th>Age</th><th>Last failure</th>${dead ? "<th>Action</th>" : ""}</tr></thead><tbody>`;
  for (const t of page.rows) {
    const id = `${t.namespace}/${t.name}`;
    h += `<tr data-task="${esc(id)}">${all ? `<td>${esc(t.namespace)}</td>` : ""}` +
      `<td><a href="#/task/${encodeURIComponent(t.namespace)}/${encodeURIComponent(t.name)}">${esc(t.name)}</a></td>` +
      `<td>${esc(t.queue)}</td><td>${phase(t.phase)}</td><td class="num">${t.token}</td><td class="num">${t.attempts}</td>` +
      `<td>${esc(t.holder || "—")}</td><td>${age(t.ageSeconds)}</td>` +
      `<td>${esc(t.lastFailure || "—")}${dead && t.lastFailureMessage ? `<br><span class="muted">${esc(t.lastFailureMessage)}</span>` : ""}</td>` +
      (dead ? `<td><button class="redrive" data-task="${esc(id)}">Redrive</button></td>` : "") + `</tr>`;
  }
  h += `</tbody></table>`;
  put(document.getElementById("tasks-data"), h);
  const move = (delta) => {
    const p = new URLSearchParams(params);
    p.set("offset", Math.max(0, page.offset + delta));
    location.hash = `#/${dead ? "dead" : "tasks"}?${p}`;
  };
  const prev = document.getElementById("prev");
  const next = document.getElementById("next");
  if (prev) prev.onclick = () => move(-page.limit);
  if (next) next.onclick = () => move(page.limit);
  for (const b of document.querySelectorAll("button.redrive")) {
    b.onclick = () => {
      const [ns, name] = b.dataset.task.split("/");
      act("redrive", ns, name, `Redrive ${name}? It goes back to Pending with a fresh retry budget.`);
    };
  }
}

// ---- one task --------------------------------------------------------------------

async function taskPage(ns, name) {
  const key = `task/${ns}/${name}`;
  frame(key, `<p><a href="#/tasks?namespace=${encodeURIComponent(ns)}">← tasks</a></p>
    <h2><span id="task-name">${esc(name)}</span> <span id="task-phase"></span></h2>
    <div class="actions"><button id="cancel" class="danger" hidden>Cancel task</button>
    <button id="redrive" hidden>Redrive</button></div><div id="action-result" role="status"></div>
    <div id="task-data" class="data"></div>`);
  const d = await getJSON(`/api/task/${encodeURIComponent(ns)}/${encodeURIComponent(name)}`);
  put(document.getElementById("task-phase"), phase(d.phase));
  const cancel = document.getElementById("cancel");
  const redrive = document.getElementById("redrive");
  cancel.hidden = !d.canCancel;
  redrive.hidden = !d.canRedrive;
  cancel.onclick = () => act("cancel", ns, name, `Cancel ${name}? Its lease is released, its worker stops, and it ends Cancelled for good.`);
  redrive.onclick = () => act("redrive", ns, name, `Redrive ${name}? It goes back to Pending with a fresh retry budget.`);
  let h = `<section><dl class="facts">
    <dt>Queue</dt><dd>${esc(d.queue)}</dd><dt>Mode</dt><dd>${esc(d.mode)}</dd>
    <dt>Fencing token</dt><dd id="fencing-token">${d.fencingToken}</dd>
    <dt>Attempts</dt><dd>${d.attemptsSpent} of ${d.maxRetries + 1}</dd>
    <dt>Holder</dt><dd id="holder">${esc(d.holder || "—")}</dd>
    ${d.cancelRequested ? `<dt>Cancel</dt><dd>requested</dd>` : ""}
    ${d.lastFailure ? `<dt>Last failure</dt><dd>${esc(d.lastFailure)}</dd>` : ""}
    ${Object.keys(d.labels).length ? `<dt>Labels</dt><dd>${esc(Object.entries(d.labels).map(([k, v]) => `${k}=${v}`).join(", "))}</dd>` : ""}
    ${d.payload ? `<dt>Payload</dt><dd><pre>${esc(d.payload)}</pre></dd>` : ""}
    ${d.checkpoint ? `<dt>Checkpoint</dt><dd><pre>${esc(d.checkpoint)}</pre></dd>` : ""}
    ${d.result ? `<dt>Result</dt><dd><pre>${esc(d.result)}</pre></dd>` : ""}
    </dl></section>`;
  h += `<section><h3>Graph</h3>${graph(d)}</section>`;
  h += `<section><h3>Attempts</h3>${timeline(d)}${attemptsTable(d)}</section>`;
  if (d.locks.length) {
    h += `<section><h3>Resource locks</h3><table id="task-locks"><thead><tr><th>Resource</th><th>Lock token</th><th>Held by</th></tr></thead><tbody>` +
      d.locks.map((l) => `<tr><td>${esc(l.resource)}</td><td>${l.token ?? "—"}</td><td>${l.heldBy ? `<a href="#/task/${encodeURIComponent(ns)}/${encodeURIComponent(l.heldBy)}">${esc(l.heldBy)}</a>` : "free"}</td></tr>`).join("") +
      `</tbody></table></section>`;
  }
  put(document.getElementById("task-data"), h);
}

function attemptsTable(d) {
  let h = `<table id="attempts"><thead><tr><th class="num">Token</th><th>Holder</th><th>Issued</th><th>Claimed</th>` +
    `<th class="num">Renewals seen</th><th class="num">Checkpoints</th><th>Ended</th><th>Outcome</th><th>Storage</th></tr></thead><tbody>`;
  for (const a of d.attempts) {
    const out = [a.outcome || a.leasePhase || "—", a.reason].filter(Boolean).join(": ");
    h += `<tr data-token="${a.token}"><td class="num">${a.token}</td><td class="holder">${esc(a.holder || "—")}</td>` +
      `<td>${time(a.issued)}</td><td>${time(a.claimed)}</td>` +
      `<td class="num renewals">${a.renewals.length}${a.renewalsUnseen ? "+" : ""}</td><td class="num checkpoints">${a.checkpoints.length}</td>` +
      `<td>${time(a.ended)}</td><td class="outcome">${esc(out)}${a.message ? `<br><span class="muted">${esc(a.message)}</span>` : ""}</td>` +
      `<td>${a.committed ? `committed under token ${a.token}` : a.outcome ? "nothing committed" : "—"}</td></tr>`;
  }
  h += `</tbody></table>`;
  if (info) h += `<p class="muted">Renewals and checkpoints are those seen since the dashboard started (${time(info.journalSince)}); a “+” marks earlier ones not seen. Every write a holder makes carries its token: storage refuses a token older than the newest registered.</p>`;
  return d.attempts.length ? h : `<p class="muted">No attempt yet.</p>`;
}

// The attempts on one time axis: a bar from claim (or issue) to end (or
// now), a tick per renewal, a dot per checkpoint, a mark where it ended.
function timeline(d) {
  if (!d.attempts.length) return "";
  const ms = (t) => (t ? Date.parse(t) : null);
  const now = Date.now();
  let lo = Infinity;
  let hi = -Infinity;
  for (const a of d.attempts) {
    for (const t of [a.issued, a.claimed, a.ended, ...a.renewals, ...a.checkpoints]) {
      const v = ms(t);
      if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    if (!a.ended && !a.outcome) hi = Math.max(hi, now);
  }
  if (!isFinite(lo)) return "";
  if (hi - lo < 1000) hi = lo + 1000;
  const W = 1000, left = 190, right = 20, rowH = 30;
  const x = (t) => left + ((ms(t) - lo) / (hi - lo)) * (W - left - right);
  const H = d.attempts.length * rowH + 30;
  let s = `<svg id="timeline" role="img" aria-label="Attempts of ${esc(d.name)} over time" viewBox="0 0 ${W} ${H}" width="100%">`;
  d.attempts.forEach((a, i) => {
    const y = 10 + i * rowH;
    const start = a.claimed || a.issued;
    const end = a.ended || (a.outcome ? start : new Date(now).toISOString());
    const cls = esc(a.outcome || "live");
    s += `<g class="attempt" data-token="${a.token}"><text x="4" y="${y + 15}">#${a.token} ${esc((a.holder || "unclaimed").slice(0, 24))}</text>`;
    if (a.issued && a.claimed) s += `<line x1="${x(a.issued)}" x2="${x(a.claimed)}" y1="${y + 11}" y2="${y + 11}" stroke="#999" stroke-dasharray="3 3"/>`;
    if (start) s += `<rect class="bar ${cls}" x="${x(start)}" y="${y + 3}" width="${Math.max(2, x(end) - x(start))}" height="16"><title>token ${a.token}: ${esc(a.outcome || "running")}</title></rect>`;
    for (const r of a.renewals) s += `<line class="renewal" x1="${x(r)}" x2="${x(r)}" y1="${y}" y2="${y + 22}"><title>renewal ${time(r)}</title></line>`;
    for (const c of a.checkpoints) s += `<circle class="checkpoint" cx="${x(c)}" cy="${y + 11}" r="4"><title>checkpoint ${time(c)}</title></circle>`;
    if (a.ended) s += `<path class="end" d="M${x(a.ended)} ${y + 3} l6 8 l-6 8 l-6 -8 z"><title>${esc(a.outcome || "ended")} ${time(a.ended)}</title></path>`;
    s += `</g>`;
  });
  s += `<text x="${left}" y="${H - 4}">${time(new Date(lo).toISOString())}</text><text x="${W - right}" y="${H - 4}" text-anchor="end">${time(new Date(hi).toISOString())}</text></svg>`;
  s += `<p class="legend"><span>▮ holding</span><span>| renewal</span><span>● checkpoint</span><span>◆ end</span><span>┄ offered, not yet claimed</span></p>`;
  return s;
}

// Dependencies and the parent on the left, the task in the middle, its
// dependents and the children it spawned on the right.
function graph(d) {
  const leftN = [...d.dependsOn.map((n) => ({ ...n, rel: "depends on" })), ...(d.parent ? [{ ...d.parent, rel: "spawned by" }] : [])];
  const rightN = [...d.dependents.map((n) => ({ ...n, rel: "dependent" })), ...d.children.map((n) => ({ ...n, rel: "spawned" }))];
  if (!leftN.length && !rightN.length) return `<p class="muted" id="graph-empty">No dependencies, dependents or children.</p>`;
  const rowH = 40, W = 900, nw = 220, nh = 28;
  const rows = Math.max(leftN.length, rightN.length, 1);
  const H = rows * rowH + 10;
  const cx = (W - nw) / 2, cy = (H - nh) / 2;
  const ns = encodeURIComponent(d.namespace);
  const box = (n, x, y, self) => {
    const label = `${n.name}${n.phase ? ` · ${n.phase}` : " · missing"}`;
    const inner = `<rect x="${x}" y="${y}" width="${nw}" height="${nh}" rx="4"/><text x="${x + 8}" y="${y + 18}">${esc(label.slice(0, 34))}</text>`;
    return self ? `<g class="node self">${inner}</g>` :
      `<a href="#/task/${ns}/${encodeURIComponent(n.name)}" class="graph-link"><g class="node" data-name="${esc(n.name)}" data-rel="${esc(n.rel)}">${inner}<title>${esc(n.rel)}: ${esc(n.name)}</title></g></a>`;
  };
  let s = `<svg id="graph" role="img" aria-label="Task graph of ${esc(d.name)}" viewBox="0 0 ${W} ${H}" width="100%"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0 0 L10 5 L0 10 z" fill="#777"/></marker></defs>`;
  leftN.forEach((n, i) => {
    const y = 5 + i * rowH;
    s += `<path class="edge" d="M${10 + nw} ${y + nh / 2} C ${cx - 60} ${y + nh / 2}, ${cx - 60} ${cy + nh / 2}, ${cx} ${cy + nh / 2}"${n.rel === "spawned by" ? ' stroke-dasharray="4 3"' : ""}/>`;
    s += box(n, 10, y, false);
  });
  rightN.forEach((n, i) => {
    const y = 5 + i * rowH;
    const x = W - nw - 10;
    s += `<path class="edge" d="M${cx + nw} ${cy + nh / 2} C ${x - 60} ${cy + nh / 2}, ${x - 60} ${y + nh / 2}, ${x} ${y + nh / 2}"${n.rel === "spawned" ? ' stroke-dasharray="4 3"' : ""}/>`;
    s += box(n, x, y, false);
  });
  s += box({ name: d.name, phase: d.phase }, cx, cy, true) + `</svg>`;
  s += `<p class="legend"><span>— depends on</span><span>┄ spawned</span></p>`;
  return s;
}

// ---- locks -------------------------------------------------------------------------

async function locksPage() {
  frame("locks", `<h2>Resource locks</h2><p class="muted">Holders as their tasks' live leases show them; waiters oldest first (the order they are served in).</p><div id="locks-data" class="data"></div>`);
  const rows = await getJSON("/api/locks");
  const link = (ns, t) => `<a href="#/task/${encodeURIComponent(ns)}/${encodeURIComponent(t)}">${esc(t)}</a>`;
  let h = `<table id="locks"><thead><tr><th>Namespace</th><th>Resource</th><th>Holder</th><th>Lock token</th><th>Waiting</th></tr></thead><tbody>`;
  for (const l of rows) {
    h += `<tr data-resource="${esc(l.namespace)}/${esc(l.resource)}"><td>${esc(l.namespace)}</td><td>${esc(l.resource)}</td>` +
      `<td>${l.holder ? `${link(l.namespace, l.holder.task)} (token ${l.holder.token}${l.holder.holder ? `, ${esc(l.holder.holder)}` : ""})` : "free"}</td>` +
      `<td>${l.holder ? l.holder.lockToken : "—"}</td>` +
      `<td>${l.waiters.map((w) => `${link(l.namespace, w.task)} (${age(w.waitingSeconds)})`).join(", ") || "—"}</td></tr>`;
  }
  h += `</tbody></table>`;
  if (!rows.length) h = `<p class="muted">No task names a resource.</p>`;
  put(document.getElementById("locks-data"), h);
}

// ---- writes, confirmed -----------------------------------------------------------

function act(what, ns, name, text) {
  const dlg = document.getElementById("confirm");
  document.getElementById("confirm-title").textContent = what === "cancel" ? "Cancel task" : "Redrive task";
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-yes").textContent = what === "cancel" ? "Cancel task" : "Redrive";
  dlg.onclose = async () => {
    if (dlg.returnValue !== "ok") return;
    const out = document.getElementById("action-result");
    try {
      const r = await post(`/api/task/${encodeURIComponent(ns)}/${encodeURIComponent(name)}/${what}`);
      show(out, "notice", r.message);
    } catch (e) {
      show(out, "problem", `${what} failed: ${e.message}`);
    }
    refresh();
  };
  dlg.returnValue = "";
  dlg.showModal();
  document.getElementById("confirm-no").focus();
}

function show(el, cls, text) {
  if (!el) return;
  el.hidden = false;
  el.className = cls;
  el.textContent = text;
}

// ---- live ----------------------------------------------------------------------------

function applyInfo(i) {
  info = i;
  document.getElementById("scope").textContent = i.namespace ? `namespace ${i.namespace}` : "all namespaces";
  const banner = document.getElementById("banner");
  const failing = Object.entries(i.watches).filter(([, w]) => w.error);
  if (failing.length) {
    banner.hidden = false;
    banner.className = "banner";
    banner.textContent = "Watch failing, retrying — what you see may be stale: " +
      failing.map(([k, w]) => `${k} since ${time(w.errorSince)}: ${w.error}`).join("; ");
  } else if (banner.className === "banner") {
    banner.hidden = true;
  }
}

function connect() {
  const live = document.getElementById("live");
  const es = new EventSource("/api/events");
  es.addEventListener("change", (e) => {
    live.textContent = "live";
    live.className = "live ok";
    applyInfo(JSON.parse(e.data));
    refresh();
  });
  es.onerror = () => {
    live.textContent = "disconnected — reconnecting…";
    live.className = "live down";
  };
}

window.addEventListener("hashchange", () => {
  if (!location.hash.startsWith("#/")) return;
  frameFor = null;
  refresh();
});
document.querySelector(".skip").addEventListener("click", (e) => {
  e.preventDefault();
  main.focus();
});
connect();
refresh();
