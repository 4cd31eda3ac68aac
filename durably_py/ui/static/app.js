// durably console: the runs page and the run page, over the JSON API and its live event streams.
"use strict";

const TOKEN = (document.querySelector('meta[name="durably-token"]') || {}).content || "";
const ENDED = new Set(["completed", "failed", "cancelled"]);
const STATUSES = ["running", "waiting", "sleeping", "paused", "interrupted", "completed", "failed", "cancelled",
  "pending", "stale", "needs_attention", "over_budget"];
const main = document.getElementById("main");
const live = document.getElementById("live");

// ---- helpers ---------------------------------------------------------------------------------------
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else if (k === "style") el.style.cssText = v;  // through the CSSOM, which the page's CSP allows
    else el.setAttribute(k, v === true ? "" : v);
  }
  fill(el, ...children);
  return el;
}
// Replace an element's children, skipping null/false and flattening nested lists.
function fill(el, ...children) {
  el.replaceChildren();
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}
const SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) el.setAttribute(k, v);
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}
const badge = (status) => h("span", { class: `badge s-${status}`, "data-status": status }, status);
function pathText(path) { return path.length ? path.join(".") : "·"; }
function fmtDuration(sec) {
  if (sec === null || sec === undefined || !isFinite(sec)) return "";
  if (sec < 1) return `${Math.max(0, Math.round(sec * 1000))} ms`;
  if (sec < 60) return `${sec.toFixed(sec < 10 ? 2 : 1)} s`;
  const m = Math.floor(sec / 60), r = Math.round(sec % 60);
  if (m < 60) return `${m}m ${r}s`;
  const hr = Math.floor(m / 60);
  return hr < 48 ? `${hr}h ${m % 60}m` : `${Math.floor(hr / 24)}d ${hr % 24}h`;
}
function fmtTime(iso) {
  if (!iso) return "";
  const d = new Date(iso), now = new Date();
  const same = d.toDateString() === now.toDateString();
  return same ? d.toLocaleTimeString() : d.toLocaleString();
}
function json(value) {
  let text;
  try { text = JSON.stringify(value, null, 2); } catch (e) { text = String(value); }
  if (text === undefined) text = "null";
  return text.length > 20000 ? text.slice(0, 20000) + "\n… (truncated)" : text;
}
// A run's duration runs on while it runs; otherwise (parked, ended, cut off) it stops at its last activity.
function lastActivity(run) { return Date.parse(run.updated_at || run.created_at); }
// A step of the workflow's own (ctx.step), as the CLI counts them; sleeps, waits, spawns, joins and loops apart.
const isStep = (st) => !st.label.startsWith("ctx.");
function ownerText(owner) {
  const [host, pid] = String(owner.owner || "").split(":");
  return /^\d+$/.test(pid || "") ? `pid ${pid} on ${host}` : (owner.owner || "another process");
}
function setLive(state, text) { live.className = `live ${state}`; live.textContent = text; }

async function api(path, body) {
  const opts = body === undefined ? {} : {
    method: "POST", body: JSON.stringify(body),
    headers: Object.assign({ "Content-Type": "application/json" }, TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {}),
  };
  let response;
  try { response = await fetch(path, opts); } catch (e) {
    throw { error: "NetworkError", message: `the console server did not answer (${e.message})`,
      hint: "Is `durably ui` still running?" };
  }
  let data = null;
  try { data = await response.json(); } catch (e) { /* not JSON */ }
  if (!response.ok) throw data || { error: `HTTP ${response.status}`, message: response.statusText };
  return data;
}

function errorBanner(err) {
  return h("div", { class: "banner bad", role: "alert" },
    h("div", {}, h("b", {}, err.error || "Error"), ": ", err.message || String(err)),
    err.hint ? h("div", { class: "hint" }, err.hint) : null,
    err.docs ? h("div", { class: "muted" }, "docs: ", h("code", {}, err.docs)) : null);
}

// ---- runs page -------------------------------------------------------------------------------------
function runsPage() {
  const params = new URLSearchParams(location.search);
  const state = {
    q: params.get("q") || "", status: params.get("status") || "", workflow: params.get("workflow") || "",
    key: params.get("key") || "", since: params.get("since") || "", until: params.get("until") || "",
    limit: parseInt(params.get("limit") || "50", 10) || 50, offset: parseInt(params.get("offset") || "0", 10) || 0,
  };
  document.title = "Runs · durably";
  const tbody = h("tbody");
  const info = h("span", { class: "muted" });
  const prev = h("button", { type: "button", onclick: () => { state.offset = Math.max(0, state.offset - state.limit); reload(); } }, "← Newer");
  const next = h("button", { type: "button", onclick: () => { state.offset += state.limit; reload(); } }, "Older →");
  const problem = h("div");
  const workflows = h("datalist", { id: "workflows" });
  const field = (label, input, cls) => h("label", { class: `field ${cls || ""}` }, label, input);
  const q = h("input", { type: "search", name: "q", placeholder: "run id, workflow or key", value: state.q });
  const status = h("select", { name: "status" }, h("option", { value: "" }, "any"),
    STATUSES.map((st) => h("option", { value: st, selected: st === state.status }, st)));
  const workflow = h("input", { name: "workflow", list: "workflows", value: state.workflow, placeholder: "any" });
  const key = h("input", { name: "key", value: state.key, placeholder: "any" });
  const toLocal = (iso) => { if (!iso) return ""; const d = new Date(iso); return isNaN(d) ? "" : new Date(d - d.getTimezoneOffset() * 60000).toISOString().slice(0, 16); };
  const since = h("input", { type: "datetime-local", name: "since", value: toLocal(state.since) });
  const until = h("input", { type: "datetime-local", name: "until", value: toLocal(state.until) });
  const form = h("form", { class: "filters panel", onsubmit: (e) => { e.preventDefault(); apply(); } },
    field("Search", q, "q"), field("Status", status), field("Workflow", workflow), field("Key", key),
    field("Active since", since), field("Active until", until),
    h("button", { type: "button", class: "reset", onclick: () => { form.reset(); q.value = workflow.value = key.value = since.value = until.value = ""; status.value = ""; apply(); } }, "Clear"),
    workflows);
  for (const el of [status, since, until]) el.addEventListener("change", apply);
  let typing;
  for (const el of [q, workflow, key]) el.addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(apply, 300); });

  function apply() {
    const iso = (v) => (v ? new Date(v).toISOString() : "");
    Object.assign(state, { q: q.value.trim(), status: status.value, workflow: workflow.value.trim(), key: key.value.trim(),
      since: iso(since.value), until: iso(until.value), offset: 0 });
    reload();
  }
  const table = h("table", { class: "runs" },
    h("thead", {}, h("tr", {}, h("th", {}, "Run"), h("th", {}, "Workflow"), h("th", { class: "wide" }, "Key"),
      h("th", {}, "Status"), h("th", { class: "wide" }, "Started"), h("th", { class: "wide" }, "Duration"),
      h("th", { class: "wide", title: "completed steps" }, "Steps"), h("th", { class: "wide", title: "workflow attempt" }, "Attempt"))),
    tbody);
  main.replaceChildren(h("div", { class: "heading" }, h("h1", {}, "Runs"), info), form, problem,
    h("div", { class: "panel", style: "padding: 4px 6px" }, table, h("div", { class: "pager" }, prev, next)));

  let source = null;
  function query(extra) {
    const p = new URLSearchParams();
    for (const k of ["q", "status", "workflow", "key", "since", "until"]) if (state[k]) p.set(k, state[k]);
    if (state.limit !== 50) p.set("limit", state.limit);
    if (state.offset) p.set("offset", state.offset);
    for (const [k, v] of Object.entries(extra || {})) p.set(k, v);
    return p.toString();
  }
  function reload() {
    total = null;
    history.replaceState(null, "", "/" + (query() ? "?" + query() : ""));
    if (source) source.close();
    tbody.replaceChildren(h("tr", {}, h("td", { colspan: 8, class: "note" }, "loading…")));
    source = new EventSource(`/api/events?${query({ limit: state.limit + 1 })}`);
    source.addEventListener("runs", (e) => { setLive("on", "live"); problem.replaceChildren(); render(JSON.parse(e.data)); counted(); });
    source.addEventListener("failure", (e) => { problem.replaceChildren(errorBanner(JSON.parse(e.data))); source.close(); });
    source.onerror = () => {
      setLive("off", "reconnecting…");
      fetch(`/api/runs?${query({ limit: 1 })}`).then(async (r) => {
        if (!r.ok) { problem.replaceChildren(errorBanner(await r.json())); source.close(); setLive("off", "stopped"); }
      }).catch(() => {});
    };
  }
  // The number of matching runs, asked again whenever the page changed (a new run may have arrived).
  let total = null, asked = 0;
  function counted() {
    const ask = ++asked, q = query();
    fetch(`/api/count?${q}`).then((r) => (r.ok ? r.json() : null)).then((data) => {
      if (ask !== asked || !data) return;
      total = data.count;
      showInfo();
    }).catch(() => {});
  }
  let shownCount = 0, more = false;
  function showInfo() {
    const of = total === null ? "" : ` of ${total.toLocaleString("en")}`;
    info.textContent = shownCount ? `runs ${state.offset + 1}–${state.offset + shownCount}${of}${more ? "" : " (last page)"}` : total === 0 ? "" : of ? `${total.toLocaleString("en")} runs` : "";
  }
  function render(runs) {
    more = runs.length > state.limit;
    const shown = runs.slice(0, state.limit);
    shownCount = shown.length;
    const names = new Set(shown.map((r) => r.workflow));
    workflows.replaceChildren(...[...names].sort().map((n) => h("option", { value: n })));
    prev.disabled = state.offset === 0;
    next.disabled = !more;
    showInfo();
    if (!shown.length) {
      const filtered = ["q", "status", "workflow", "key", "since", "until"].some((k) => state[k]);
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: 8, class: "note" },
        state.offset ? "No more runs." : filtered ? "No run matches these filters." : "No runs yet: run a workflow, e.g. `durably run examples/quickstart.py`.")));
      return;
    }
    const now = Date.now();
    tbody.replaceChildren(...shown.map((r) => {
      const start = Date.parse(r.created_at);
      const dur = r.status === "running" ? (now - start) / 1000 : (lastActivity(r) - start) / 1000;
      return h("tr", { "data-run": r.run_id },
        h("td", { class: "id" }, h("a", { href: `/runs/${encodeURIComponent(r.run_id)}` }, r.run_id)),
        h("td", {}, r.workflow), h("td", { class: "wide" }, r.key || h("span", { class: "muted" }, "—")),
        h("td", {}, badge(r.status)), h("td", { class: "wide", title: r.created_at }, fmtTime(r.created_at)),
        h("td", { class: "wide num" }, fmtDuration(dur)),
        h("td", { class: "wide num" }, r.steps_done === undefined ? "" : String(r.steps_done)),
        h("td", { class: "wide num" }, r.attempt ? String(r.attempt) : "—"));
    }));
  }
  reload();
}

// ---- run page --------------------------------------------------------------------------------------
function runPage(runRef) {
  document.title = `${runRef} · durably`;
  const view = { snap: null, selected: null, source: null, opBanner: h("div"), forms: new Map() };
  // Approval forms (forms.js): kept across renders; a sent value is reported in the operations banner.
  const formKit = { cache: view.forms, dialog: (...args) => dialog(...args),
    done: (text) => view.opBanner.replaceChildren(h("div", { class: "banner good", role: "status", "data-result": "submit" }, text)) };
  main.replaceChildren(h("p", { class: "note" }, "loading…"));
  function connect() {
    const source = view.source = new EventSource(`/api/runs/${encodeURIComponent(runRef)}/events`);
    source.addEventListener("state", (e) => {
      const snap = JSON.parse(e.data);
      view.snap = snap;
      if (snap.partial) setLive("on", "loading…");
      else setLive(ENDED.has(snap.run.status) ? "" : "on", ENDED.has(snap.run.status) ? "ended" : "live");
      if (snap.run.run_id !== runRef) { runRef = snap.run.run_id; history.replaceState(null, "", `/runs/${encodeURIComponent(runRef)}`); }
      render();
    });
    source.addEventListener("failure", (e) => { main.replaceChildren(errorBanner(JSON.parse(e.data))); source.close(); });
    source.onerror = () => {
      setLive("off", "reconnecting…");
      if (!view.snap) {
        fetch(`/api/runs/${encodeURIComponent(runRef)}`).then(async (r) => {
          if (!r.ok) { main.replaceChildren(errorBanner(await r.json()), h("p", {}, h("a", { href: "/" }, "← all runs"))); source.close(); setLive("off", "stopped"); }
        }).catch(() => {});
      }
    };
  }
  const parts = { head: h("section", { class: "panel" }), steps: h("section", { class: "panel" }),
    detail: h("aside", { class: "panel detail" }), graph: h("section", { class: "panel" }), log: h("section", { class: "panel" }) };
  // The log as `durably logs` prints it, read when the panel is opened and again at each change while it is open.
  const logList = h("ol", { class: "log" });
  const logNote = h("span", { class: "muted" });
  const logBox = h("details", { "data-log": "", ontoggle: () => { if (logBox.open) loadLog(); } },
    h("summary", {}, h("b", {}, "Log"), " ", logNote), logList);
  parts.log.append(logBox);
  let logAsked = 0;
  async function loadLog() {
    const ask = ++logAsked;
    try {
      const data = await api(`/api/runs/${encodeURIComponent(view.snap.run.run_id)}/log`);
      if (ask !== logAsked) return;
      const shown = data.lines.filter((l) => l.t !== "signal").length;
      logNote.textContent = data.records > shown ? `(the last ${shown} of ${data.records} records; durably logs shows all)` : `(${data.records} records)`;
      logList.replaceChildren(...data.lines.map((l) => h("li", { "data-kind": l.t }, l.text)));
    } catch (err) { logList.replaceChildren(h("li", {}, errorBanner(err))); }
  }
  const waterfall = makeWaterfall((row) => { view.selected = row.key; renderDetail(); waterfall.select(row.key); });
  let built = false;

  function render() {
    const run = view.snap.run;
    document.title = `${run.workflow} ${run.run_id} · durably`;
    if (!built) {
      built = true;
      parts.steps.append(h("div", { class: "heading" }, h("h2", {}, "Steps and timeline"),
        h("div", { class: "legend" },
          h("span", {}, h("i", { style: "background: var(--ok)" }), "attempt ok"),
          h("span", {}, h("i", { style: "background: var(--fail)" }), "attempt failed"),
          h("span", {}, h("i", { class: "bar k-backoff", style: "position: static; display: inline-block" }), "backoff"),
          h("span", {}, h("i", { class: "bar k-child", style: "position: static; display: inline-block" }), "child run"),
          h("span", {}, h("i", { style: "background: var(--sleep)" }), "sleep"),
          h("span", {}, h("i", { style: "background: var(--wait)" }), "wait for signal"))),
        waterfall.el);
      main.replaceChildren(parts.head, h("div", { class: "split" }, parts.steps, parts.detail), parts.graph, parts.log);
    }
    renderHead();
    if (logBox.open && !view.snap.partial) loadLog();
    // A big run's first event holds its first steps only (no timeline): rows paint now, bars when the rest comes.
    waterfall.update(rowsOf(view.snap), view.snap);
    if (view.snap.partial) return;
    if (view.selected === null && waterfall.rows.length) view.selected = waterfall.rows[waterfall.rows.length - 1].key;
    waterfall.select(view.selected);
    renderDetail();
    renderGraph();
  }

  function renderHead() {
    const run = view.snap.run;
    const created = Date.parse(run.created_at);
    const dur = run.status === "running" ? view.snap.now - created / 1000 : (lastActivity(run) - created) / 1000;
    const fact = (label, value, wide) => value === null || value === undefined || value === "" ? null : h("div", { class: wide ? "wide" : null }, h("span", {}, label), h("b", {}, value));
    const partial = view.snap.partial;
    const own = run.steps.filter(isStep), calls = run.steps.length - own.length;
    const done = partial ? partial.done : own.filter((st) => st.status === "ok").length;
    const spent = run.spent && Object.entries(run.spent).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(", ");
    const budget = run.budget && Object.entries(run.budget).map(([k, v]) => `${k} ${v}`).join(", ");
    fill(parts.head, 
      h("div", { class: "runhead" }, h("h1", {}, run.workflow), badge(run.status), h("code", { class: "muted" }, run.run_id)),
      h("div", { class: "facts" },
        fact("key", run.key), fact("started", fmtTime(run.created_at)), fact("last activity", fmtTime(run.updated_at)),
        fact("duration", fmtDuration(dur)),
        fact("steps done", partial ? `${done} of ${partial.steps}` : `${done} of ${own.length}` + (calls ? ` · ${calls} ctx calls` : "")),
        run.queued ? fact("due", run.queued.due === null ? "when woken" : fmtTime(new Date(run.queued.due * 1000).toISOString())) : null,
        run.queued ? fact("priority", String(run.queued.priority)) : null,
        run.owner ? fact("running in", ownerText(run.owner)) : null,
        fact("workflow attempt", run.attempt ? String(run.attempt) : null),
        run.parent ? h("div", {}, h("span", {}, "parent run"), h("a", { href: `/runs/${encodeURIComponent(run.parent)}` }, run.parent)) : null,
        fact("budget", budget), fact("spent", spent), fact("script", run.script, true)),
      run.error ? h("div", { class: "banner bad" }, h("b", {}, (run.error.type || "").split(":").pop()), ": ", run.error.message || "") : null,
      run.status === "completed" ? h("details", {}, h("summary", {}, "result"), h("pre", { class: "json" }, json(run.result))) : null,
      h("details", {}, h("summary", {}, "input"), h("pre", { class: "json" }, json(run.input))),
      Object.keys(run.annotations || {}).length ? h("details", { open: true }, h("summary", {}, "annotations"), h("pre", { class: "json" }, json(run.annotations))) : null,
      (run.advisories || []).length ? h("div", {}, h("h2", { style: "margin-top: 10px" }, "Advisories"),
        run.advisories.map((a) => h("div", { class: "advice" }, h("code", {}, a.code), " ", a.message || "", a.hint ? h("div", { class: "muted" }, a.hint) : null))) : null,
      (run.warnings || []).map((w) => h("div", { class: "banner bad" }, w)),
      run.ready ? h("div", { class: "banner good", "data-ready": "" }, `ready: ${run.ready}; a worker or `, h("code", {}, `durably retry ${run.run_id}`), " continues it") : null,
      run.status === "pending" && !run.ready ? h("div", { class: "banner", "data-pending": "" }, "pending: nothing runs it until a worker claims it (", h("code", {}, "durably worker"), ")") : null,
      run.owner && run.owner.alive === false ? h("div", { class: "banner bad", "data-unresponsive": "" }, `the process holding it (${ownerText(run.owner)}) is not running; its lease lapses ${run.owner.expires ? "in " + fmtDuration(run.owner.expires - view.snap.now) : "soon"}, then any process may continue it`) : null,
      (run.signals || []).length ? h("div", { class: "signals", "data-signals": "" }, h("h2", { style: "margin-top: 10px" }, "Unread signals"),
        run.signals.map((sg) => h("div", { class: "advice", "data-signal": sg.name }, h("code", {}, sg.name), ` sent ${fmtTime(sg.at)}, unread: it waits in the run's inbox`,
          sg.payload === null || sg.payload === undefined ? null : h("div", { class: "muted" }, `payload ${JSON.stringify(sg.payload)}`)))) : null,
      awakeables(run), waitForms(run, formKit), attention(run), overBudget(run), operations(run), view.opBanner);
  }

  // ---- awakeables waiting for an outside system ------------------------------------------------
  function awakeables(run) {
    const open = run.status === "waiting" ? run.awakeables || [] : [];
    if (!open.length) return null;
    return h("div", { class: "signals", "data-awakeables": "" }, h("h2", { style: "margin-top: 10px" }, "Waiting for awakeables"),
      open.map((a) => h("div", { class: "advice", "data-awakeable": a.id }, h("code", {}, a.id), a.name ? ` ${a.name}` : "",
        a.deadline ? ` · deadline ${fmtTime(a.deadline)}` : " · no deadline",
        h("div", { class: "muted" }, "resolve it with ", h("code", {}, `durably resolve-awakeable ${a.id} JSON`),
          " or a POST to its callback URL"))));
  }

  // ---- a run parked over its budget --------------------------------------------------------------
  function overBudget(run) {
    const over = run.status === "over_budget" ? run.over_budget || {} : null;
    if (!over) return null;
    const kind = over.kind || "usd";
    const money = (k, v) => k === "usd" ? `$${Number(v).toFixed(2)}` : `${v} ${k}`;
    const rows = Object.entries(over.by || {}).map(([label, kinds]) =>
      h("div", { "data-spent-on": label }, h("code", {}, label), " ", Object.entries(kinds).map(([k, v]) => money(k, v)).join(", ")));
    const amount = h("input", { name: "amount", value: String((over.limit || {})[kind] || 1), inputmode: "decimal", autocomplete: "off" });
    return h("div", { class: "banner bad", "data-over-budget": "" },
      h("h2", { style: "margin-top: 0" }, "Over budget"),
      h("p", {}, `spent ${money(kind, over.needed)} of ${money(kind, (over.limit || {})[kind])}` + (over.owner && over.owner !== run.run_id ? ` (the budget of ${over.owner})` : "") + "; nothing runs until the budget is raised"),
      rows,
      h("div", { class: "ops" }, h("label", { class: "field" }, `raise ${kind} by`, amount),
        h("button", { type: "button", class: "primary", "data-op": "budget-raise",
          onclick: () => send("budget", { raise: { [kind]: Number(amount.value) } }) }, "Raise budget"),
        h("button", { type: "button", class: "danger", "data-op": "budget-cancel",
          onclick: () => confirmOp("cancel", `Cancel ${run.run_id}?`, "The run ends cancelled instead of spending more.", {}, true) }, "Cancel run")));
  }

  // ---- effects that need attention -------------------------------------------------------------
  function attention(run) {
    const cut = run.status === "needs_attention" ? run.attention || [] : [];
    if (!cut.length) return null;
    return h("div", { class: "attention", "data-attention": "" }, h("h2", { style: "margin-top: 10px" }, "Needs attention"),
      h("p", { class: "muted" }, "An unsafe step was cut off: nothing runs it again until you decide. Check whether its effect happened (the service knows it by its operation id), then record what you found."),
      cut.map((eff) => {
        const where = pathText(eff.path);
        return h("div", { class: "banner bad", "data-effect": where },
          h("div", {}, h("b", {}, `${where} ${eff.label}`), ` cut off in attempt ${eff.attempt}`),
          h("dl", {}, h("dt", {}, "operation id"), h("dd", {}, h("code", { "data-operation-id": "" }, eff.operation_id)),
            h("dt", {}, "input"), h("dd", {}, h("pre", { class: "json", "data-effect-input": "" }, json(eff.input))),
            h("dt", {}, "started"), h("dd", {}, fmtTime(eff.started_at))),
          h("div", { class: "ops" },
            h("button", { type: "button", class: "primary", "data-op": "resolve-value", onclick: () => resolveValueDialog(run, eff) }, "Record result…"),
            h("button", { type: "button", "data-op": "resolve-rerun",
              onclick: () => confirmResolve(`Run ${where} ${eff.label} again?`, "Only if its effect did not happen (or repeating it is harmless): the step runs again as a new attempt, with the same operation id, in the console's process.", { path: where, rerun: true }, false) }, "Run again"),
            h("button", { type: "button", class: "danger", "data-op": "resolve-fail",
              onclick: () => confirmResolve(`Fail ${where} ${eff.label}?`, "The step fails with EffectFailedError: the workflow handles it like any failed step, and if the run fails its compensations run.", { path: where, fail: true }, true) }, "Fail")));
      }));
  }
  function confirmResolve(title, text, body, danger) {
    dialog(title, h("p", {}, text), "Resolve", danger, async () => { await send("resolve", body); });
  }
  function resolveValueDialog(run, eff) {
    const where = pathText(eff.path);
    const value = h("textarea", { name: "value", spellcheck: "false", placeholder: '{"id": "ch_123"}' }, "");
    function validate() {
      let msg = "";
      const text = value.value.trim();
      if (!text) msg = "Enter the step's result as JSON (null for none).";
      else { try { JSON.parse(text); } catch (e) { msg = `not valid JSON: ${e.message}`; } }
      d.problem.textContent = msg;
      d.submit.disabled = !!msg;
      return !msg;
    }
    const d = dialog(`Record the result of ${where} ${eff.label}`, h("div", { style: "display: flex; flex-direction: column; gap: 10px" },
      h("p", {}, `Only once you verified that the effect happened (operation id ${eff.operation_id}): the workflow gets this value as the step's result and continues in the console's process; the step does not run again.`),
      h("label", { class: "field" }, "Result (JSON)", value)), "Record result", false,
      async () => {
        if (!validate()) return false;
        await send("resolve", { path: where, value: JSON.parse(value.value.trim()) });
      });
    value.addEventListener("input", validate);
    validate();
  }

  // ---- operations ------------------------------------------------------------------------------
  function operations(run) {
    const st = run.status;
    const waitingFor = run.steps.filter((x) => x.status === "waiting").map((x) => x.output && x.output.signal).filter(Boolean);
    const canCancel = !ENDED.has(st), canPause = !ENDED.has(st) && st !== "paused", canResume = st === "paused";
    const canRetry = st !== "running", canRestart = st !== "running";  // a refusal explains itself, with its hint
    return h("div", { class: "ops" },
      h("button", { type: "button", class: waitingFor.length ? "primary" : "", disabled: ENDED.has(st), "data-op": "signal",
        onclick: () => signalDialog(run, waitingFor[0] || "") }, "Signal…"),
      h("button", { type: "button", disabled: !canPause, "data-op": "pause",
        onclick: () => confirmOp("pause", `Pause ${run.run_id}?`, "A run no process holds pauses at once; a running one pauses at its next step boundary.", {}) }, "Pause"),
      h("button", { type: "button", disabled: !canResume, "data-op": "resume",
        onclick: () => confirmOp("resume", `Resume ${run.run_id}?`, "The process waiting on it continues it; otherwise retry continues it.", {}) }, "Resume"),
      h("button", { type: "button", disabled: !canRetry || !!view.snap.partial, "data-op": "retry", onclick: () => retryDialog(run) }, "Retry…"),
      h("button", { type: "button", disabled: !canRestart, "data-op": "restart",
        onclick: () => confirmOp("restart", `Restart ${run.workflow}?`, "Starts it over as a new run with the same input and key, in the console's process. The old run's log is kept.", {}) }, "Restart"),
      h("button", { type: "button", class: "danger", disabled: !canCancel, "data-op": "cancel",
        onclick: () => confirmOp("cancel", `Cancel ${run.run_id}?`, "The run ends as cancelled (its attached child runs too); a running process stops at its next step boundary. This cannot be undone.", {}, true) }, "Cancel run"));
  }

  function dialog(title, body, submitLabel, danger, onSubmit) {
    const problem = h("div", { class: "invalid", role: "alert" });
    const submit = h("button", { type: "submit", class: `primary ${danger ? "danger" : ""}`, "data-confirm": "" }, submitLabel);
    const dlg = h("dialog", {}, h("form", { method: "dialog", onsubmit: async (e) => {
      e.preventDefault();
      if (submit.disabled) return;
      submit.disabled = true;
      const ok = await onSubmit(problem);
      submit.disabled = false;
      if (ok !== false) { dlg.close(); dlg.remove(); }
    } }, h("h2", {}, title), body, problem,
    h("div", { class: "actions" }, h("button", { type: "button", onclick: () => { dlg.close(); dlg.remove(); } }, "Close"), submit)));
    document.body.append(dlg);
    dlg.showModal();
    return { dlg, submit, problem };
  }

  async function send(op, body) {
    view.opBanner.replaceChildren(h("div", { class: "banner good" }, `${op}: sending…`));
    try {
      const result = await api(`/api/runs/${encodeURIComponent(view.snap.run.run_id)}/${op}`, body);
      view.opBanner.replaceChildren(h("div", { class: "banner good", role: "status", "data-result": op }, describe(op, result)));
      if ((op === "restart" || op === "retry") && result.run_id && result.run_id !== view.snap.run.run_id) {
        view.opBanner.firstChild.append(" ", h("a", { href: `/runs/${encodeURIComponent(result.run_id)}` }, "open the new run →"));
      }
      return result;
    } catch (err) {
      view.opBanner.replaceChildren(errorBanner(err));
      view.opBanner.firstChild.setAttribute("data-result", `${op}-failed`);
      return null;
    }
  }
  function describe(op, r) {
    if (op === "signal") return `signal ${JSON.stringify(r.signal)} sent with payload ${JSON.stringify(r.payload)}`;
    if (op === "cancel") return r.cancelled ? `cancelled ${r.run_id}` : `asked ${r.run_id} to stop; it is still ${r.status} and stops at its next step boundary`;
    if (op === "pause") return r.paused ? `paused ${r.run_id}` : `asked ${r.run_id} to pause; it is still ${r.status}`;
    if (op === "resume") return r.resumed ? `resumed ${r.run_id} (${r.status})` : `${r.run_id} is still paused`;
    if (op === "retry") return `retrying ${r.run_id}: ${r.status}`;
    if (op === "restart") return `restarted as ${r.run_id}: ${r.status}`;
    if (op === "resolve") return `resolved ${r.run_id}: ${r.status}`;
    if (op === "budget") return `raised the budget of ${r.run_id}: ${r.status}`;
    return JSON.stringify(r);
  }
  function confirmOp(op, title, text, body, danger) {
    dialog(title, h("p", {}, text), op[0].toUpperCase() + op.slice(1), danger, async () => { await send(op, body); });
  }
  function signalDialog(run, name) {
    const nameInput = h("input", { name: "name", value: name, required: true, placeholder: "approval", autocomplete: "off" });
    const payload = h("textarea", { name: "payload", spellcheck: "false", placeholder: '{"ok": true}' }, "");
    let submit;
    function validate() {
      const text = payload.value.trim();
      let msg = "";
      if (!nameInput.value.trim()) msg = "A signal needs a name: the one the workflow waits for.";
      else if (nameInput.value.startsWith("$")) msg = "Names starting with $ are reserved.";
      else if (text) { try { JSON.parse(text); } catch (e) { msg = `payload is not valid JSON: ${e.message}`; } }
      d.problem.textContent = msg;
      d.submit.disabled = !!msg;
      return !msg;
    }
    const d = dialog(`Signal ${run.run_id}`, h("div", { style: "display: flex; flex-direction: column; gap: 10px" },
      h("label", { class: "field" }, "Signal name", nameInput),
      h("label", { class: "field" }, "Payload (JSON; empty sends null)", payload)), "Send signal", false,
      async () => {
        if (!validate()) return false;
        const text = payload.value.trim();
        await send("signal", { name: nameInput.value.trim(), payload: text ? JSON.parse(text) : null });
      });
    submit = d.submit;
    nameInput.addEventListener("input", validate);
    payload.addEventListener("input", validate);
    validate();
    return submit;
  }
  function retryDialog(run) {
    const select = h("select", { name: "from_step" }, h("option", { value: "" }, "where it stopped (no step runs again)"),
      run.steps.filter((st) => st.status === "ok" || st.status === "failed" || st.status === "compensated").map((st) =>
        h("option", { value: pathText(st.path), selected: view.selected === pathText(st.path) }, `${pathText(st.path)}  ${st.label}`)));
    dialog(`Retry ${run.run_id}`, h("div", {}, h("p", {}, "Continues the run in the console's process. Choose a step to run it and every step completed after it again."),
      h("label", { class: "field" }, "Run again from", select)), "Retry", false,
      async () => { await send("retry", select.value ? { from_step: select.value } : {}); });
  }

  // ---- detail of the selected step ---------------------------------------------------------------
  // The output a streamed step emitted so far, live while it runs (its chunks as server-sent events).
  function liveOutput(row, st) {
    if (view.live && view.live.key !== row.key) { view.live.source.close(); view.live = null; }
    const running = st.status === "running" || st.status === "retrying";
    if (!view.live && running && row.path.length) {
      const pre = h("pre", { class: "json", "data-live-output": "" });
      const source = new EventSource(`/api/runs/${encodeURIComponent(view.snap.run.run_id)}/stream/${pathText(row.path)}`);
      view.live = { key: row.key, pre, source };
      source.addEventListener("chunk", (e) => {
        const chunk = JSON.parse(e.data);
        pre.textContent += typeof chunk === "string" ? chunk : JSON.stringify(chunk) + "\n";
      });
      source.addEventListener("end", () => source.close());
      source.addEventListener("failure", () => source.close());
    }
    return view.live && st.status !== "ok" ? [h("div", { class: "muted" }, "live output"), view.live.pre] : null;
  }

  function renderDetail() {
    const row = waterfall.all.find((r) => r.key === view.selected);
    if (!row) { fill(parts.detail, h("h2", {}, "Step"), h("p", { class: "muted" }, "Select a step to see its output, error and attempts.")); return; }
    const st = row.step || {};
    const child = st.label === "ctx.spawn" && st.output && st.output.run_id;
    const dl = h("dl", {},
      h("dt", {}, "path"), h("dd", {}, h("code", {}, pathText(row.path))),
      h("dt", {}, "status"), h("dd", {}, badge(row.status)),
      h("dt", {}, "attempts"), h("dd", {}, String(st.attempts || row.spans.filter((x) => x.kind === "attempt").length || "")),
      st.ms !== null && st.ms !== undefined ? [h("dt", {}, "last attempt"), h("dd", {}, fmtDuration(st.ms / 1000))] : null,
      st.finished_at ? [h("dt", {}, "finished"), h("dd", {}, fmtTime(st.finished_at))] : null,
      st.status === "running" && st.started_at ? [h("dt", {}, "running for"), h("dd", { "data-running-for": "" }, fmtDuration(view.snap.now - Date.parse(st.started_at) / 1000))] : null,
      st.compensation ? [h("dt", {}, "compensation"), h("dd", {}, st.compensation)] : null,
      child ? [h("dt", {}, "child run"), h("dd", {}, h("a", { href: `/runs/${encodeURIComponent(child)}` }, child))] : null);
    fill(parts.detail, h("h2", {}, row.label), dl,
      st.error ? h("div", { class: "banner bad" }, h("b", {}, (st.error.type || "").split(":").pop()), ": ", st.error.message || "",
        st.error.traceback ? h("details", {}, h("summary", {}, "traceback"), h("pre", { class: "json" }, st.error.traceback)) : null) : null,
      st.status === "ok" || st.status === "compensated" ? [h("div", { class: "muted" }, "output"), h("pre", { class: "json" }, json(st.output))] : null,
      st.status === "waiting" || st.status === "sleeping" ? h("pre", { class: "json" }, json(st.output)) : null,
      st.stashed !== null && st.stashed !== undefined ? [h("div", { class: "muted" }, "stash"), h("pre", { class: "json" }, json(st.stashed))] : null,
      liveOutput(row, st),
      row.spans.length ? [h("div", { class: "muted", style: "margin-top: 8px" }, "timeline"), h("ol", {}, row.spans.map((x) =>
        h("li", {}, `${x.kind}${x.kind === "attempt" ? " " + x.attempt : ""} · ${x.status} · `,
          x.end === null ? `since ${new Date(x.start * 1000).toLocaleTimeString()}` : fmtDuration(x.end - x.start), x.detail ? ` · ${x.detail}` : "")))] : null);
  }

  // ---- graph: task graphs and child runs ------------------------------------------------------------
  function renderGraph() {
    const snap = view.snap;
    const graphs = snap.graphs || [];
    const spawned = snap.run.steps.filter((st) => st.label === "ctx.spawn" && st.output && st.output.run_id);
    const inGraph = new Set(graphs.flatMap((g) => g.nodes.map((n) => n.run_id)).filter(Boolean));
    const loose = spawned.filter((st) => !inGraph.has(st.output.run_id));
    if (!graphs.length && !loose.length) { parts.graph.hidden = true; return; }
    parts.graph.hidden = false;
    const statusOf = Object.fromEntries((snap.children || []).map((c) => [c.run_id, c.status]));
    const blocks = graphs.map((g) => h("div", { style: "margin-bottom: 12px" },
      h("div", { class: "heading" }, h("b", {}, `ctx.graph at ${pathText(g.path)}`), badge(g.status)),
      drawGraph(g.nodes.map((n) => ({ id: n.id, title: n.id, sub: n.wait ? `${n.status} · waits: ${n.wait}` : `${n.status} · ${n.workflow}`,
        status: n.status, deps: n.depends_on, href: n.run_id ? `/runs/${encodeURIComponent(n.run_id)}` : null })))));
    if (loose.length) {
      const root = { id: "__self", title: snap.run.workflow, sub: "this run", status: "self", deps: [], href: null };
      const nodes = [root, ...loose.map((st) => ({ id: st.output.run_id, title: st.output.run_id,
        sub: `${statusOf[st.output.run_id] || "child"} · ${st.output.detached ? "detached" : "attached"}`,
        status: statusOf[st.output.run_id] || "pending", deps: ["__self"], href: `/runs/${encodeURIComponent(st.output.run_id)}` }))];
      blocks.push(h("div", {}, h("div", { class: "heading" }, h("b", {}, "child runs")), drawGraph(nodes)));
    }
    fill(parts.graph, h("h2", {}, "Graph"), ...blocks);
  }

  connect();
}

// Layered drawing of a DAG: columns by longest dependency chain, one row per node within a column.
function drawGraph(nodes) {
  const byId = Object.fromEntries(nodes.map((n) => [n.id, n]));
  const depth = {};
  const level = (n, seen = new Set()) => {
    if (depth[n.id] !== undefined) return depth[n.id];
    if (seen.has(n.id)) return 0;
    seen.add(n.id);
    const d = Math.max(-1, ...n.deps.filter((x) => byId[x]).map((x) => level(byId[x], seen))) + 1;
    return (depth[n.id] = d);
  };
  nodes.forEach((n) => level(n));
  const columns = [];
  for (const n of nodes) (columns[depth[n.id]] = columns[depth[n.id]] || []).push(n);
  const W = 210, H = 50, GX = 70, GY = 16, PAD = 14;
  const pos = {};
  columns.forEach((col, c) => col.forEach((n, r) => { pos[n.id] = { x: PAD + c * (W + GX), y: PAD + r * (H + GY) }; }));
  const width = PAD * 2 + columns.length * W + (columns.length - 1) * GX;
  const height = PAD * 2 + Math.max(...columns.map((c) => c.length)) * (H + GY) - GY;
  const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "graph" });
  for (const n of nodes) for (const d of n.deps) {
    if (!pos[d]) continue;
    const a = pos[d], b = pos[n.id];
    const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2, mx = (x1 + x2) / 2;
    svg.append(s("path", { class: "edge", d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2 - 6},${y2}`, "marker-end": "url(#arrow)" }));
  }
  svg.prepend(s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "5", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" },
    s("path", { d: "M0,0 L10,5 L0,10 z", fill: "currentColor", class: "muted" }))));
  const clip = (t, n) => (t.length > n ? t.slice(0, n - 1) + "…" : t);
  for (const n of nodes) {
    const p = pos[n.id];
    const g = s("g", { class: `node s-${n.status}`, transform: `translate(${p.x},${p.y})`, "data-node": n.id },
      s("title", {}, `${n.title}\n${n.sub}`),
      s("rect", { width: W, height: H, rx: 8 }), s("rect", { class: "stripe", width: 4, height: H - 12, x: 6, y: 6, rx: 2 }),
      s("text", { x: 18, y: 21 }, clip(n.title, 27)), s("text", { x: 18, y: 38, class: "sub" }, clip(n.sub, 31)));
    svg.append(n.href ? s("a", { href: n.href }, g) : g);
  }
  return h("div", { class: "graph" }, svg);
}

// ---- waterfall -------------------------------------------------------------------------------------
function rowsOf(snap) {
  const rows = new Map();
  const row = (path) => {
    const key = pathText(path);
    if (!rows.has(key)) rows.set(key, { key, path, label: "", status: "", step: null, spans: [] });
    return rows.get(key);
  };
  for (const st of snap.run.steps) { const r = row(st.path); r.step = st; r.label = st.label; r.status = st.status; }
  for (const sp of snap.timeline) { const r = row(sp.path); r.spans.push(sp); if (!r.label) { r.label = sp.label; r.status = sp.status; } }
  // A spawn's row also shows its child run's lifetime: the time a join of it waits.
  const children = Object.fromEntries((snap.children || []).map((c) => [c.run_id, c]));
  for (const r of rows.values()) {
    const child = r.step && r.step.label === "ctx.spawn" && r.step.output && children[r.step.output.run_id];
    if (!child) continue;
    const open = !ENDED.has(child.status) && child.status !== "interrupted";
    r.spans.push({ path: r.path, label: child.workflow, kind: "child", status: child.status, attempt: 1,
      start: Date.parse(child.created_at) / 1000, end: open ? null : Date.parse(child.updated_at || child.created_at) / 1000,
      detail: `child run ${child.run_id} (${child.workflow})` });
  }
  // A fan-out's or loop's position and each of its branches have no step of their own: a group row stands for
  // each, spanning its steps, so the tree can fold them.
  const groups = new Map();
  for (const r of [...rows.values()]) {
    for (let n = r.path.length - 1; n >= 1; n--) {
      const key = pathText(r.path.slice(0, n));
      const parent = rows.get(key);
      if (parent && !parent.group) { parent.children = (parent.children || 0) + 1; break; }
      let g = groups.get(key);
      if (!g) {
        g = { key, path: r.path.slice(0, n), label: "", status: "", step: null, spans: [], group: true, members: [], subgroups: 0 };
        groups.set(key, g);
        rows.set(key, g);
      }
      g.members.push(r);
    }
  }
  const rank = ["failed", "running", "waiting", "sleeping", "pending", "paused", "cancelled"];
  for (const g of groups.values()) {
    const depth = g.path.length;
    const direct = new Set(g.members.map((m) => pathText(m.path.slice(0, depth + 1))));
    const branches = [...direct].filter((k) => groups.has(k)).length;
    g.children = direct.size;
    const owner = rows.get(pathText(g.path.slice(0, -1)));
    g.label = owner && owner.label === "ctx.loop" ? `iteration ${g.path[depth - 1]}`
      : branches === direct.size ? `${branches} branches` : `branch ${g.path[depth - 1]}`;
    const statuses = new Set(g.members.map((m) => m.status));
    g.status = rank.find((x) => statuses.has(x)) || (statuses.has("ok") ? "ok" : [...statuses][0] || "");
    let start = Infinity, end = -Infinity, open = false;
    for (const m of g.members) for (const sp of m.spans) {
      start = Math.min(start, sp.start);
      if (sp.end === null) open = true; else end = Math.max(end, sp.end);
    }
    if (start < Infinity) g.spans.push({ path: g.path, label: g.label, kind: "group", status: g.status, attempt: 1, start,
      end: open ? null : Math.max(end, start), detail: `${g.members.filter((m) => !m.group).length} steps` });
  }
  const cmp = (a, b) => { for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i]; return a.length - b.length; };
  return [...rows.values()].sort((a, b) => cmp(a.path, b.path));
}

function makeWaterfall(onPick) {
  const ROW = 26;
  const ticks = h("div", { class: "ticks" });
  const axis = h("div", { class: "wf-axis" }, h("div", { class: "cols" }, h("span", {}, "step"), h("span", {}, "status"),
    h("span", { class: "num" }, "tries"), h("span", { class: "num" }, "time")), ticks);
  const inner = h("div", { class: "wf-rows" });
  const body = h("div", { class: "wf-body" }, inner);
  const el = h("div", { class: "wf" }, axis, body);
  const wf = { el, rows: [], all: [], collapsed: new Set(), t0: 0, t1: 1, now: 0, selected: null };
  let drawn = new Map();
  body.addEventListener("scroll", () => paint(false));
  window.addEventListener("resize", () => paint(true));

  // The rows on show: every row but the descendants of a folded one (rows come sorted by path).
  function visible() {
    if (!wf.collapsed.size) return wf.all;
    const out = [];
    let folded = null;
    for (const r of wf.all) {
      if (folded !== null && r.key.startsWith(folded)) continue;
      folded = wf.collapsed.has(r.key) && r.children ? r.key + "." : null;
      out.push(r);
    }
    return out;
  }
  wf.toggle = (key, open) => {
    const fold = open === undefined ? !wf.collapsed.has(key) : !open;
    if (fold === wf.collapsed.has(key)) return;
    if (fold) wf.collapsed.add(key); else wf.collapsed.delete(key);
    wf.rows = visible();
    inner.style.height = `${Math.max(wf.rows.length, 1) * ROW}px`;
    paint(true);
    const twisty = inner.querySelector(`.wf-row[data-path="${key}"] .twisty`);
    if (twisty) twisty.focus();
  };
  wf.update = (rows, snap) => {
    wf.all = rows;
    rows = wf.rows = visible();
    const run = snap.run;
    wf.now = snap.now;
    const created = Date.parse(run.created_at) / 1000;
    let t1 = created;
    for (const sp of snap.timeline) t1 = Math.max(t1, sp.end === null ? snap.now : sp.end);
    if (!ENDED.has(run.status) && run.status !== "interrupted" && run.status !== "paused") t1 = Math.max(t1, snap.now);
    else if (run.updated_at) t1 = Math.max(t1, Date.parse(run.updated_at) / 1000);
    wf.t0 = created;
    wf.t1 = Math.max(t1, created + 0.001);
    wf.t1 += (wf.t1 - wf.t0) * 0.015;  // room for the last bar's minimum width
    inner.style.height = `${Math.max(rows.length, 1) * ROW}px`;
    if (!rows.length) inner.replaceChildren(h("p", { class: "note" }, "No step has run yet."));
    else if (inner.querySelector(".note")) inner.replaceChildren();
    paintTicks();
    paint(true);
  };
  wf.select = (key) => { wf.selected = key; for (const [k, node] of drawn) node.classList.toggle("sel", k === key); };

  function paintTicks() {
    const span = wf.t1 - wf.t0;
    const steps = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 43200, 86400];
    const most = Math.max(2, Math.min(6, Math.floor((ticks.clientWidth || 480) / 80)));
    const step = steps.find((x) => span / x <= most) || span / most;
    const nodes = [];
    for (let t = 0; t <= span * 0.93; t += step) nodes.push(h("span", { style: `left: ${(t / span) * 100}%` }, t === 0 ? "0" : `+${fmtDuration(t)}`));
    ticks.replaceChildren(...nodes.slice(0, 8));
    wf.tickStep = step;
  }
  function pct(t) { return ((t - wf.t0) / (wf.t1 - wf.t0)) * 100; }
  function rowNode(r) {
    const track = h("div", { class: "track" });
    const span = wf.t1 - wf.t0;
    for (let t = wf.tickStep; t < span; t += wf.tickStep) track.append(h("div", { class: "wf-grid", style: `left: ${(t / span) * 100}%` }));
    for (const sp of r.spans) {
      const end = sp.end === null ? wf.now : sp.end;
      const left = pct(sp.start), width = Math.max(pct(end) - left, 0);
      const tip = `${r.label} · ${sp.kind}${sp.kind === "attempt" ? " " + sp.attempt : ""} · ${sp.status} · ${fmtDuration(end - sp.start)}${sp.detail ? " · " + sp.detail : ""}`;
      track.append(h("div", { class: `bar k-${sp.kind} st-${sp.status} ${sp.end === null ? "open" : ""}`, title: tip,
        style: `left: ${left}%; width: ${width}%` }));
    }
    const st = r.step || {};
    const total = r.spans.filter((x) => x.kind === "attempt" && x.end !== null).reduce((a, x) => a + (x.end - x.start), 0);
    const open = !wf.collapsed.has(r.key);
    const twisty = r.children ? h("button", { type: "button", class: "twisty", "aria-expanded": String(open),
      "aria-label": `${open ? "Fold" : "Unfold"} ${r.key} (${r.children} below)`, title: open ? "fold (←)" : "unfold (→)",
      onclick: (e) => { e.stopPropagation(); wf.toggle(r.key); },
      onkeydown: (e) => {
        if (e.key === "ArrowLeft" || e.key === "ArrowRight") { e.preventDefault(); wf.toggle(r.key, e.key === "ArrowRight"); }
      } }, open ? "▾" : "▸") : h("span", { class: "twisty none" });
    const node = h("div", { class: `wf-row ${r.group ? "group" : ""} ${wf.selected === r.key ? "sel" : ""}`, style: `top: ${r.index * ROW}px`, "data-path": r.key, "data-status": r.status,
      "aria-expanded": r.children ? String(open) : null, onclick: () => onPick(r) },
      h("div", { class: "cols" },
        h("span", { class: "name", style: `padding-left: ${(r.path.length - 1) * 14}px`, title: `${r.key} ${r.label}` }, twisty, h("span", { class: "path" }, r.key), r.label),
        h("span", {}, badge(r.status)),
        h("span", { class: "num" }, st.attempts > 1 ? String(st.attempts) : ""),
        h("span", { class: "num", "data-elapsed": st.status === "running" && st.started_at ? "" : null }, r.group ? (r.spans.length && r.spans[0].end !== null ? fmtDuration(r.spans[0].end - r.spans[0].start) : "")
          : st.status === "running" && st.started_at ? fmtDuration(wf.now - Date.parse(st.started_at) / 1000)
          : total ? fmtDuration(total) : st.ms ? fmtDuration(st.ms / 1000) : "")),
      track);
    return node;
  }
  function paint(all) {
    const top = body.scrollTop, height = body.clientHeight || 600;
    const first = Math.max(0, Math.floor(top / ROW) - 15), last = Math.min(wf.rows.length, Math.ceil((top + height) / ROW) + 15);
    const next = new Map();
    for (let i = first; i < last; i++) {
      const r = wf.rows[i];
      r.index = i;
      const old = drawn.get(r.key);
      if (old && !all) { next.set(r.key, old); drawn.delete(r.key); continue; }
      const node = rowNode(r);
      if (old) { old.replaceWith(node); drawn.delete(r.key); } else inner.append(node);
      next.set(r.key, node);
    }
    for (const node of drawn.values()) node.remove();
    drawn = next;
  }
  return wf;
}

// ---- queues page ------------------------------------------------------------------------------------
function queuesPage() {
  document.title = "Queues · durably";
  const tbody = h("tbody");
  const problem = h("div");
  const table = h("table", { class: "runs queues" },
    h("thead", {}, h("tr", {}, h("th", {}, "Queue"), h("th", { class: "num" }, "Due"), h("th", { class: "num" }, "Later"),
      h("th", { class: "num" }, "Running"), h("th", { class: "num" }, "Parked"), h("th", {}, "Oldest wait"),
      h("th", {}, "Partitions"), h("th", {}, "Limits"))),
    tbody);
  main.replaceChildren(h("div", { class: "heading" }, h("h1", {}, "Queues")), problem,
    h("div", { class: "panel", style: "padding: 4px 6px" }, table));
  const limitsText = (q) => {
    const l = q.limits, u = q.in_use, parts = [];
    if (l.concurrency !== undefined) parts.push(`concurrency ${u.runs || 0}/${l.concurrency}`);
    if (l.per_worker !== undefined) parts.push(`${l.per_worker} per worker`);
    if (l.rate_limit) parts.push(`rate ${u.starts || 0}/${l.rate_limit.max} per ${l.rate_limit.per}s`);
    if (l.partition_concurrency !== undefined) parts.push(`${l.partition_concurrency} per partition`);
    return parts.join(", ");
  };
  function render(queues) {
    if (!queues.length) {
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: 8, class: "note" }, "No queued runs yet: `durably enqueue` records some.")));
      return;
    }
    tbody.replaceChildren(...queues.map((q) => h("tr", { "data-queue": q.name },
      h("td", {}, q.name), h("td", { class: "num" }, String(q.due)), h("td", { class: "num" }, String(q.later)),
      h("td", { class: "num" }, String(q.running)), h("td", { class: "num" }, String(q.parked)),
      h("td", {}, q.oldest_wait === null ? "" : fmtDuration(q.oldest_wait)),
      h("td", { title: Object.keys(q.partitions).join(", ") }, Object.keys(q.partitions).length ? String(Object.keys(q.partitions).length) : ""),
      h("td", {}, limitsText(q)))));
  }
  async function reload() {
    try {
      render(await api("/api/queues"));
      problem.replaceChildren();
      setLive("on", "live");
    } catch (err) {
      problem.replaceChildren(errorBanner(err));
      setLive("off", "retrying…");
    }
    setTimeout(reload, 2000);
  }
  reload();
}

// ---- routing ---------------------------------------------------------------------------------------
const match = location.pathname.match(/^\/runs\/(.+)$/);
if (match) runPage(decodeURIComponent(match[1]));
else if (location.pathname === "/queues") queuesPage();
else runsPage();
