// The fleet page (docs/operations.md, "The fleet page"): plain JS module, no build step, talks to this
// server's JSON API only.
// The API key is asked for once and kept in sessionStorage; every call sends it as a bearer token.
// Views: Fleet (machines grouped by host, each running job with its step, elapsed and remaining
// time), Jobs (cancel / interrupt / requeue), Gallery (enlarge, download, same settings, new seed,
// send to another kind) and Submit (a form built from the model's own spec in GET /v1/models,
// with an inpaint mask drawn on a canvas).

const KEY = "homefleet.api_key";
const SUBMITTED = "homefleet.submitted";  // the Submit view's last job, followed again after a reload
const REFRESH_MS = 1000;
// How often the models and machines the Submit form offers are read again while another view is shown.
const MODELS_REFRESH_MS = 5000;
const $ = (selector, root = document) => root.querySelector(selector);
// Jobs are read PAGE at a time, newest first (GET /v1/jobs, keyset paging: docs/api.md). `jobs`: the
// newest page, then the older pages loaded ("Load older"); `older`: whether any is; `more`: whether
// jobs older than the last loaded one may exist.
const PAGE = 200;
const state = { machines: [], jobs: [], more: false, older: false, loadingOlder: false, models: [], queue: [],
  view: "fleet", openMachine: null, openJob: null, stopping: null, blobs: new Map() };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
  return node;
}

// Re-render without losing the keyboard's place: the focused control (data-key) is focused again.
function replaceKeepingFocus(parent, children) {
  const focused = document.activeElement && parent.contains(document.activeElement) ? document.activeElement.dataset.key : null;
  parent.replaceChildren(...children);
  if (focused) { const again = parent.querySelector(`[data-key="${CSS.escape(focused)}"]`); if (again) again.focus(); }
}

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status; this.reason = error.reason || error.code || `http_${status}`; this.body = body;
  }
}

// JSON with exact integers: one past 2^53 (a seed reaches 2^63-1) is read as a BigInt from its own
// digits (the reviver's context.source) and written back as those digits (JSON.rawJSON).
const exactInteger = (key, value, context) =>
  (typeof value === "number" && Number.isInteger(value) && !Number.isSafeInteger(value) && context && /^-?\d+$/.test(context.source) ? BigInt(context.source) : value);
const parseJson = (text) => JSON.parse(text, exactInteger);
const toJson = (value, space) => JSON.stringify(value, (key, v) => (typeof v === "bigint" ? JSON.rawJSON(String(v)) : v), space);

const bearer = () => ({ Authorization: `Bearer ${sessionStorage.getItem(KEY) || ""}` });

async function api(path, options = {}) {
  const headers = { ...bearer(), ...(options.headers || {}) };
  if (options.json !== undefined) { headers["Content-Type"] = "application/json"; options.body = toJson(options.json); }
  let response;
  try { response = await fetch(path, { ...options, headers }); }
  catch (error) {  // no answer at all: the browser's own words ("Failed to fetch") say too little
    throw new ApiError(0, { error: { reason: "server_unreachable",
      message: `the server does not answer (${error.message}); the page tries again by itself` } });
  }
  if (response.status === 401) askKey("the server refused the key: give another");
  const body = (response.headers.get("content-type") || "").includes("json") ? parseJson(await response.text()) : null;
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

// Server-Sent Events over fetch (EventSource cannot send the Authorization header).
async function follow(path, onEvent) {
  const response = await fetch(path, { headers: { ...bearer(), Accept: "text/event-stream" } });
  if (!response.ok) throw new ApiError(response.status, await response.text().then(parseJson).catch(() => null));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      let event = "message"; const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(event, parseJson(data.join("\n")));
    }
  }
}

// A job's results in order (n images, each {digest, media_type, size_bytes, url, seed}): its
// `results`, else its one `result`; none before it has succeeded.
const resultsOf = (job) => job.results || (job.result ? [job.result] : []);
// A result as a Blob, its blob: URL (an <img> cannot send the key) and its file name as the server
// names it (Content-Disposition: <job id>[-<index>].<the extension of its media type>, docs/api.md),
// cached per result URL; one that could not be read (the server restarting, a lost connection) is
// read again the next time it is shown, not "result unavailable" for the tab's life.
async function resultBlob(result) {
  if (!state.blobs.has(result.url)) {
    const loading = (async () => {
      const response = await fetch(result.url, { headers: bearer() });
      if (!response.ok) throw new ApiError(response.status, null);
      const blob = await response.blob();
      const named = /filename="([^"]+)"/.exec(response.headers.get("content-disposition") || "");
      return { blob, url: URL.createObjectURL(blob), name: named ? named[1] : null };
    })();
    state.blobs.set(result.url, loading);
    loading.catch(() => state.blobs.delete(result.url));
  }
  return state.blobs.get(result.url);
}
const resultUrl = async (result) => (await resultBlob(result)).url;
const isMedia = (result) => /^(image|video)\//.test(result.media_type);
const isImage = (result) => result.media_type.startsWith("image/");
// "image 2 of 3" for result `index` (from 0) of a job with `count` results; "" for a job's only one.
// What a job's prompt shows: a chat's last user message (params.user_message, set by the chat
// routes), not the chat-templated text the model reads; else its prompt; blank is none.
const promptOf = (job) => String((job.kind === "text" && job.params.chat && job.params.user_message) || job.params.prompt || "").trim();
// A prompt in a table row or a line: its first PROMPT_SHOWN characters (a text job's prompt may be a
// whole document); the job's details show it all.
const PROMPT_SHOWN = 300;
const clip = (text) => (text.length > PROMPT_SHOWN ? `${text.slice(0, PROMPT_SHOWN)}…` : text);
const nth = (index, count) => (count > 1 ? `image ${index + 1} of ${count}` : "");

// Result `index` of `count` of a job: an <img>, a <video>, or a text job's answer (text/plain) as text.
function media(job, result, index = 0, count = 1) {
  const which = { "data-job": job.id, "data-index": String(index), "data-digest": result.digest };
  if (!isMedia(result)) {
    const node = el("pre", { class: "text-result", ...which });
    resultBlob(result).then(({ blob }) => blob.text()).then((text) => { node.textContent = text; },
      () => { node.replaceWith(el("span", { class: "reason" }, "result unavailable")); });
    return node;
  }
  const name = [clip(promptOf(job)) || `result of ${job.id}`, nth(index, count)].filter(Boolean).join(", ");
  const node = result.media_type.startsWith("video/") ? el("video", { muted: "", loop: "", preload: "metadata", controls: "", ...which, "aria-label": name })
                                                      : el("img", { alt: name, ...which });
  resultUrl(result).then((url) => { node.src = url; }, () => { node.replaceWith(el("span", { class: "reason" }, "result unavailable")); });
  return node;
}

// A link that saves result `index` of `count` (its blob: URL) under the server's name for it
// (resultBlob: a text job's answer is <job id>.txt). Until the result is read it is disabled (a
// click saved the page itself under the result's name); one that cannot be read says so.
function downloadLink(job, result, index, count) {
  const link = el("a", { class: "download", href: "#", "aria-disabled": "true", "data-key": `download:${job.id}:${index}`, "data-index": String(index),
    "aria-label": `Download the result of job ${job.id}${count > 1 ? `, ${nth(index, count)}` : ""}`,
    onclick: (event) => { if (event.currentTarget.hasAttribute("aria-disabled")) event.preventDefault(); } }, count > 1 ? `Download ${index + 1}` : "Download");
  resultBlob(result).then(({ url, name }) => {
    link.href = url; link.download = name || `${job.id}${count > 1 ? `-${index}` : ""}`; link.removeAttribute("aria-disabled");
  }, () => { link.textContent = "result unavailable"; });
  return link;
}

// Every result of a job, each with its download link (Jobs details, Submit's finished job).
function allResults(job) {
  const results = resultsOf(job);
  return results.map((result, index) => el("div", { class: isMedia(result) ? "result-item" : "result-item text" },
    media(job, result, index, results.length), downloadLink(job, result, index, results.length)));
}

// ---- times ----
const seconds = (s) => (s === null || s === undefined ? "–" : `${Number(s).toFixed(1)} s`);
const gib = (bytes) => `${(bytes / 2 ** 30).toFixed(1)} GiB`;
const actual = (job) => (job.load_s === null && job.run_s === null ? null : (job.load_s || 0) + (job.run_s || 0));
// The journal's times are UTC; one without a zone is read as UTC, not as the browser's local time.
const when = (iso) => (iso ? Date.parse(/[zZ]|[+-]\d\d:?\d\d$/.test(iso) ? iso : `${iso}Z`) : null);
// A job's submission time in the user's locale: the time alone on today's date, else the date too;
// the whole timestamp, with its zone, in the title.
function clock(iso) {
  if (!iso) return "–";
  const at = new Date(when(iso));
  const time = at.toLocaleTimeString([], { hour12: false });
  return el("time", { datetime: at.toISOString(), title: at.toLocaleString([], { dateStyle: "full", timeStyle: "long" }) },
    at.toDateString() === new Date().toDateString() ? time : `${at.toLocaleDateString([], { dateStyle: "medium" })} ${time}`);
}
const elapsed = (job) => (job.started_at ? Math.max(0, (Date.now() - when(job.started_at)) / 1000) : null);
// An ended job cut short after its claim (cancelled mid-run, interrupted, terminated) reports no run
// time: the seconds it held its machine, claim to end, as the quotas count it.
const held = (job) => (job.started_at && job.finished_at ? Math.max(0, (when(job.finished_at) - when(job.started_at)) / 1000) : null);
function actualCell(job) {
  if (job.state === "running") return `${seconds(elapsed(job))} so far`;
  if (actual(job) !== null || held(job) === null) return seconds(actual(job));
  return el("span", { class: "held", title: "cut short: no run time reported; the time from its claim to its end, which it held its machine (quotas count it)" },
    `${seconds(held(job))} held`);
}
// Remaining seconds of a running job: from its step rate once a step is done, else placement's prediction.
function remaining(job) {
  const spent = elapsed(job); const progress = progressOf(job);
  if (spent === null) return null;
  if (progress && progress.step > 0 && progress.total) return (spent / progress.step) * (progress.total - progress.step);
  return job.predicted_s ? Math.max(0, job.predicted_s - spent) : null;
}

// ---- progress (SSE for running jobs) ----
// A browser keeps at most 6 connections to a server (HTTP/1.1), shared by all its tabs, and an
// event stream holds one for as long as it is open: past 6, every tab's polls wait for a stream to
// end (two tabs, each following two running jobs and its submitted one, froze both). So an event
// stream is opened only holding one of STREAM_SLOTS slots, Web Locks shared by this page's tabs
// (navigator.locks; none on a plain-http address other than localhost, not a secure context: then
// each tab keeps to MAX_FOLLOWED and its submitted job). `withStreamSlot(open)` runs `open` in a
// free slot, held until its promise settles, and answers its value; NO_SLOT when every slot is taken.
const STREAM_SLOTS = 4;
const NO_SLOT = Symbol("no stream slot");
async function withStreamSlot(open) {
  if (!navigator.locks) return open();
  for (let slot = 0; slot < STREAM_SLOTS; slot += 1) {
    const held = await navigator.locks.request(`homefleet.stream.${slot}`, { ifAvailable: true },
      async (lock) => (lock ? { value: await open() } : null));
    if (held) return held.value;
  }
  return NO_SLOT;
}
// Running jobs' progress, live: each one's events (SSE) while it runs, at most MAX_FOLLOWED at once
// per tab and while a stream slot is free; the others show the 1 s poll's progress.
const MAX_FOLLOWED = 3;
const live = new Map();  // job id -> {step, total, seen: [steps from its events]}
function followRunning() {
  for (const job of state.jobs) {
    if (job.state !== "running" || live.has(job.id) || live.size >= MAX_FOLLOWED) continue;
    const entry = { ...(job.progress || { step: 0, total: 1 }), seen: [] };
    live.set(job.id, entry);
    withStreamSlot(() => follow(`/v1/jobs/${job.id}/events`, (name, data) => {
      if (name === "end") state.jobs = state.jobs.map((known) => (known.id === data.id ? data : known));  // its row, at the next draw
      if (name !== "progress") return;
      entry.step = data.step; entry.total = data.total; entry.seen.push(data.step);
      for (const node of document.querySelectorAll(`progress[data-job='${job.id}']`)) paint(node, entry);
    })).catch(() => {}).finally(() => live.delete(job.id));
  }
}
function paint(node, progress) {
  node.max = progress.total; node.value = progress.step; node.title = `${progress.step}/${progress.total}`;
  node.setAttribute("aria-label", `step ${progress.step} of ${progress.total}`);
  if (progress.seen) node.dataset.seen = progress.seen.join(",");
}
function bar(job) {
  const node = el("progress", { "data-job": job.id });
  paint(node, live.get(job.id) || job.progress);
  return node;
}
const progressOf = (job) => live.get(job.id) || job.progress;
const short = (id) => String(id).slice(0, 8);

// ---- queue control: cancel a queued job, interrupt a running one, requeue an ended one ----
const ENDED = ["succeeded", "failed", "rejected", "interrupted", "cancelled", "purged"];
// Notices (docs/operations.md, "The fleet page"): one at a time, a newer one replacing it; it
// clears NOTICE_MS (milliseconds) after it was said, or at its close button. A `lasting` one (an
// interrupt waiting for the job's end, a model retired under the form) stays until superseded or
// closed. An error (`alarm`: a refused action) is listed apart and stays until its own close button.
const NOTICE_MS = 10000;
const MAX_ALARMS = 5;  // the newest errors kept listed; an older one goes when a sixth comes
let noticeTimer = null;
function say(text, { lasting = false } = {}) {
  clearTimeout(noticeTimer);
  $("#notice").textContent = text; $("#notice-box").hidden = false;
  if (!lasting) noticeTimer = setTimeout(unsay, NOTICE_MS);
}
function unsay() { clearTimeout(noticeTimer); $("#notice-box").hidden = true; $("#notice").textContent = ""; }
function alarm(text) {
  const item = el("li", { class: "alert", role: "alert" }, el("span", {}, text),
    el("button", { type: "button", class: "close", "aria-label": "Dismiss this error", onclick: () => item.remove() }, "✕"));
  $("#alerts").prepend(item);
  for (const old of [...$("#alerts").children].slice(MAX_ALARMS)) old.remove();
}
async function act(job, action) {
  try {
    if (action === "requeue") {
      const again = await api(`/v1/jobs/${job.id}/requeue`, { method: "POST", json: {} });
      say(`Job ${job.id} requeued as ${again.id} on ${again.machine}`);
    } else {
      const answer = await api(`/v1/jobs/${job.id}/cancel`, { method: "POST" });
      if (answer.state === "running") { state.stopping = job.id; say(`Job ${job.id} is stopping at its next step`, { lasting: true }); }
      else say(`Job ${job.id} ${answer.state}`);
    }
  } catch (error) { alarm(`${action} of ${job.id} refused: ${error.reason}: ${error.message}`); }
  refresh();
}
function controls(job) {
  const button = (action, label) => el("button", { type: "button", class: `act-${action}`, "data-key": `${action}:${job.id}`, "data-job": job.id,
    "aria-label": `${label} job ${job.id}`, onclick: (event) => { event.stopPropagation(); act(job, action); } }, label);
  if (job.state === "queued") return [button("cancel", "Cancel")];
  if (job.state === "running") return [button("interrupt", "Interrupt")];
  return ENDED.includes(job.state) ? [button("requeue", "Requeue")] : [];
}
// A running job as the Fleet view names it: id, kind, prompt, step, elapsed and remaining seconds.
function runningLine(job) {
  const progress = progressOf(job); const left = remaining(job);
  return el("div", { class: "running-job", "data-job": job.id },
    el("b", {}, short(job.id)), ` ${job.kind}`, promptOf(job) ? ` “${clip(promptOf(job))}”` : "", el("br"),
    progress ? [bar(job), ` step ${progress.step}/${progress.total}`] : "starting",
    el("span", { class: "times" }, ` · ${seconds(elapsed(job))} elapsed · ${left === null ? "–" : `~${seconds(left)}`} left `),
    controls(job));
}

// ---- Fleet ----
function machineState(machine) {
  if (!machine.online) return "offline";
  if (machine.syncing) return "syncing";
  if (machine.draining) return "draining";
  return "online";
}

function machineRow(m, device) {
  const running = state.jobs.filter((job) => job.machine === m.name && job.state === "running");
  const open = () => { state.openMachine = m.name; state.queue = []; loadQueue().then(renderFleet); };
  return el("tr", { "data-machine": m.name, class: device ? "device" : null, onclick: open },  // the button: the keyboard's way
    el("td", { "data-label": "Machine" }, el("button", { type: "button", class: "link", "data-key": `machine:${m.name}`,
      onclick: (event) => { event.stopPropagation(); open(); },
      "aria-label": `${m.name}: open its queue` }, device ? `↳ ${m.name}` : m.name)),
    el("td", { "data-label": "State", class: `state-${machineState(m)}` }, machineState(m)),
    el("td", { "data-label": "Device" }, m.backend, m.device === null || m.device === undefined ? "" : ` #${m.device}`),
    el("td", { "data-label": "Memory" }, `${m.memory_kind}, ${gib(m.memory_bytes)}`),
    el("td", { "data-label": "Warm" }, (m.warm_models || [])  // one no longer verified is being withdrawn (R4)
      .map((model) => ((m.verified_models || []).includes(model) ? model : `${model} (withdrawn)`)).join(", ") || "–"),
    el("td", { "data-label": "Committed" }, (m.committed_models || []).join(", ") || "–"),
    el("td", { "data-label": "Queued" }, m.queued),
    el("td", { "data-label": "Running" }, running.length ? running.map(runningLine) : m.running),
    el("td", { "data-label": "Drains in" }, seconds(m.drain_s)));
}

function renderFleet() {
  // a host's devices under it: one host row, then its devices (a single-device machine is its own host)
  const hosts = new Map();
  for (const m of state.machines) {
    const host = m.host || m.name;
    if (!hosts.has(host)) hosts.set(host, []);
    hosts.get(host).push(m);
  }
  const rows = [];
  for (const [host, machines] of hosts) {
    if (machines.length === 1 && (machines[0].device === null || machines[0].device === undefined)) { rows.push(machineRow(machines[0], false)); continue; }
    rows.push(el("tr", { class: "host", "data-host": host }, el("th", { scope: "rowgroup", colspan: "9" }, `Host ${host} (${machines.length} devices)`)));
    rows.push(...machines.map((m) => machineRow(m, true)));
  }
  replaceKeepingFocus($("#machines tbody"), rows);
  const box = $("#machine-queue");
  box.hidden = !state.openMachine;
  if (!state.openMachine) return;
  $("h2", box).textContent = `Queue of ${state.openMachine}, in order`;
  const line = [...state.queue].sort((a, b) => (a.state === b.state ? 0 : a.state === "running" ? -1 : 1));  // stable: oldest first
  replaceKeepingFocus($("ol", box), line.length ? line.map((job) => el("li", { "data-job": job.id }, `${job.state} ${job.id} ${job.kind} ${job.model} `,
    promptOf(job) ? `“${clip(promptOf(job))}” ` : "", progressOf(job) ? bar(job) : "", " ", controls(job))) : [el("li", {}, "nothing queued")]);
}

// The open machine's whole backlog in its order (oldest first, not only the recent jobs the page polls).
async function loadQueue() {
  const machine = state.openMachine;
  const line = await api(`/v1/jobs?machine=${encodeURIComponent(machine)}&state=running&state=queued&order=oldest&limit=500`);
  if (machine === state.openMachine) state.queue = line;
}

// ---- Jobs ----
// The table is updated in place: a job keeps its row, and a cell is written only when what it
// shows changed (`setCell`), so text selected in a row (a prompt, a job id to copy) survives the
// 1 s refresh, as the job's details do; rows come and go with the jobs loaded.
const JOB_COLUMNS = ["Job", "State", "Kind", "Model", "Prompt", "Machine", "Submitted", "Predicted", "Actual", "Progress / reason", "Actions"];
const openJob = (id) => (event) => {  // the details follow the table: brought into view
  event.stopPropagation();
  if (event.currentTarget.tagName === "TR" && String(getSelection())) return;  // a drag that selected text to copy, not a click
  state.openJob = id; renderJobs();
  $("#job-detail").scrollIntoView({ block: "start" });
};
// `cell` shows `content()` (a node, text, or a list of them) unless it already shows `shown`: what
// the content is drawn from, as a string.
function setCell(cell, shown, content) {
  if (cell.dataset.shown === shown) return;
  cell.dataset.shown = shown;
  replaceKeepingFocus(cell, [content()].flat());
}
function fillJobRow(row, job) {
  const [id, jobState, kind, model, prompt, machine, submitted, predicted, actualTd, progress, actions] = row.cells;
  setCell(id, job.id, () => el("button", { type: "button", class: "link", "data-key": `job:${job.id}`, "aria-label": `job ${job.id}: details`,
    title: job.id, onclick: openJob(job.id) }, short(job.id)));
  setCell(jobState, job.state, () => job.state); jobState.className = `job-${job.state}`;
  setCell(kind, job.kind, () => job.kind);
  setCell(model, job.model, () => job.model);
  const text = promptOf(job);
  setCell(prompt, text, () => clip(text) || "–");
  if (prompt.title !== text) prompt.title = text;
  setCell(machine, job.machine || "–", () => job.machine || "–");
  setCell(submitted, `${job.created_at}|${new Date().toDateString()}`, () => clock(job.created_at));  // redrawn at midnight: no longer today
  setCell(predicted, seconds(job.predicted_s), () => seconds(job.predicted_s));
  const spent = actualCell(job);
  setCell(actualTd, typeof spent === "string" ? spent : spent.outerHTML, () => spent);
  const reason = job.reason ? `${job.reason}: ${job.message || ""}` : "";
  setCell(progress, progressOf(job) ? "<progress>" : reason, () => (progressOf(job) ? bar(job) : reason ? el("span", { class: "reason" }, reason) : ""));
  if (progressOf(job)) paint($("progress", progress), progressOf(job));
  setCell(actions, job.state, () => controls(job));
}
function renderJobs() {
  const body = $("#jobs tbody");
  const rows = new Map([...body.rows].map((row) => [row.dataset.job, row]));
  const loaded = new Set(state.jobs.map((job) => job.id));
  for (const [id, row] of rows) if (!loaded.has(id)) { row.remove(); rows.delete(id); }
  let next = body.firstElementChild;  // rows stay where they are; a new one goes in its place
  for (const job of state.jobs) {
    const row = rows.get(job.id) || el("tr", { "data-job": job.id, onclick: openJob(job.id) },
      JOB_COLUMNS.map((label) => el("td", { "data-label": label, class: label === "Prompt" ? "prompt" : null })));
    fillJobRow(row, job);
    if (row === next) next = next.nextElementSibling;
    else body.insertBefore(row, next);
  }
  renderPaging($("#jobs-paging"), `Showing ${state.jobs.length} jobs, newest first`);
  const box = $("#job-detail");
  const job = state.jobs.find((j) => j.id === state.openJob);
  box.hidden = !job;
  if (!job) return;
  if ($("h2", box).textContent !== `Job ${job.id} (${job.state})`) {
    $("h2", box).textContent = `Job ${job.id} (${job.state})`;
    $(".result", box).replaceChildren(...allResults(job));
  }
  // written only when it changed: rewritten every second, it dropped a selection being copied (a seed)
  // (the details' own <pre>: a text job's answer is a <pre> of the result above it)
  const details = toJson(job.provenance || job, 2);
  if ($("pre.details", box).textContent !== details) $("pre.details", box).textContent = details;
}

// ---- Gallery ----
function options(select, values) {
  // Rebuilt only when the values change: a list drawn anew each refresh closed a list the user
  // had open and dropped the option under the pointer.
  if ([...select.options].slice(1).map((o) => o.value).join("\n") === values.join("\n")) return;
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "" }, "all"), ...values.map((v) => el("option", { value: v }, v)));
  select.value = values.includes(chosen) ? chosen : "";
}

function enlarge(job, result) {
  const dialog = $("#enlarged");
  resultUrl(result).then((url) => { $("img", dialog).src = url; });
  $("img", dialog).alt = promptOf(job) || job.id;
  $(".caption", dialog).textContent = `${promptOf(job) || ""} · ${job.model} · seed ${result.seed ?? job.seed ?? "–"}`;
  dialog.showModal();
}

// The actions on result `index` of `count` of a job (none yet: `result` null): enlarge, download,
// send to another kind and Same settings act on this result (Same settings on image i of n fills
// that image's own seed, seed + i, and n 1: it makes that image again); New seed on the whole job.
function remixes(job, result, index, count) {
  const which = count > 1 ? `job ${job.id}, ${nth(index, count)}` : `job ${job.id}`;
  const button = (name, label, onclick) => el("button", { type: "button", class: `remix-${name}`, "data-key": `${name}:${job.id}:${index}`,
    "aria-label": `${label}: ${which}`, onclick }, label);
  const buttons = [];
  if (result) {
    buttons.push(button("enlarge", "Enlarge", () => enlarge(job, result)));
    buttons.push(downloadLink(job, result, index, count));
  }
  if (kindsRun().includes(job.kind)) {
    buttons.push(button("same", "Same settings", () => fillFrom(job, false, count > 1 && result ? { result, index, count } : null)));
    buttons.push(button("new-seed", "New seed", () => fillFrom(job, true)));
  }
  if (result && isImage(result)) {
    for (const kind of ["upscale", "img2img", "edit", "inpaint"].filter((k) => kindsRun().includes(k)))
      buttons.push(button(`send-${kind}`, `→ ${kind}`, () => sendTo(job, kind, index)));
  }
  return el("div", { class: "remix", role: "group", "aria-label": `Actions on ${which}` }, buttons);
}

// One figure per result (a job of n images: n figures, in order); a job without one: its state.
function renderGallery() {
  const done = state.jobs.filter((job) => (job.result ? isMedia(job.result) : job.kind !== "text"));
  options($("#filter-model"), [...new Set(state.jobs.map((j) => j.model))].sort());
  options($("#filter-machine"), [...new Set(state.jobs.map((j) => j.machine).filter(Boolean))].sort());
  options($("#filter-state"), [...new Set(state.jobs.map((j) => j.state))].sort());
  const [model, machine, jobState] = ["#filter-model", "#filter-machine", "#filter-state"].map((s) => $(s).value);
  const shown = done.filter((j) => (!model || j.model === model) && (!machine || j.machine === machine) && (!jobState || j.state === jobState))
    .flatMap((job) => { const results = resultsOf(job); return results.length ? results.map((result, index) => ({ job, result, index, count: results.length })) : [{ job, result: null, index: 0, count: 0 }]; });
  $("#gallery-scope").textContent = `Filters apply to the ${state.jobs.length} jobs loaded: ${shown.length} results shown`;
  renderPaging($("#gallery-paging"), `${state.jobs.length} jobs loaded, newest first`);
  const gallery = $("#gallery");
  // the figures' buttons follow the kinds the models run: a gallery drawn before the models
  // loaded is drawn again once they have, not only when a job changes
  const key = `${kindsRun().join()}|${shown.map(({ job, index }) => `${job.id}:${index}:${job.state}`).join()}`;
  if (gallery.dataset.drawn === key) return;
  gallery.dataset.drawn = key;
  replaceKeepingFocus(gallery, shown.map(({ job, result, index, count }) => el("figure", { "data-job": job.id, "data-index": String(index), "data-state": job.state },
    result ? media(job, result, index, count) : el("div", { class: `placeholder job-${job.state}` }, job.state, el("br"),
      job.reason ? el("span", { class: "reason" }, `${job.reason}: ${job.message || ""}`) : ""),
    el("figcaption", {}, el("b", {}, clip(promptOf(job)) || "(no prompt)"), el("br"), `${job.model} on ${job.machine || "–"}`,
      count > 1 ? [el("br"), `${nth(index, count)} · seed ${result.seed ?? "–"}`] : ""),
    remixes(job, result, index, count))));
}

// ---- Submit: the form built from the model's spec (GET /v1/models) ----
// Params the form leaves to the server: set by it (expanded_by) or shaped otherwise (grammar: the OpenAI routes).
const NOT_IN_FORM = ["expanded_by", "expand_prompt", "grammar", "adapters", "user_message"];
const CHOICES = { format: ["mp4", "webp", "gif"] };
const form = () => $("#submit-form");
const runnable = () => state.models.filter((m) => !m.kinds.includes("adapter"));
const kindsRun = () => [...new Set(runnable().flatMap((m) => m.kinds))];
const chosenModel = () => state.models.find((m) => m.id === form().elements.model.value);
const inputs = {};  // input name -> {digest, label, result?}: a result (send to, same settings) instead of a file
const CHOOSE = Symbol("choose a model");  // buildForm's model: none chosen, the user picks one
let awaiting = {};  // a job's params while the user picks a model for them (Same settings of a retired model's job)

// What the chosen model takes for the chosen kind: params, inputs, ranges, and the defaults
// (the kind's on its family, then the model's own).
function kindSpec() {
  const model = chosenModel();
  const spec = (model && model.params && model.params[form().elements.kind.value]) || { params: ["prompt"], inputs: [], defaults: {}, ranges: {} };
  return { ...spec, ranges: spec.ranges || {}, defaults: { ...(spec.defaults || {}), ...((model && model.defaults) || {}) } };
}

function paramField(name, spec) {
  const value = spec.defaults[name]; const range = spec.ranges[name];
  const hint = [];
  let field;
  if (CHOICES[name]) {
    field = el("select", { name }, CHOICES[name].map((c) => el("option", { value: c }, c)));
    field.value = value ?? CHOICES[name][0];
  } else if (typeof value === "boolean") {
    field = el("input", { name, type: "checkbox" }); field.checked = value;
  } else if (range || typeof value === "number" || name === "seed") {
    const step = range && range.step ? range.step : range && range.integer ? 1 : "any";
    field = el("input", { name, type: "number", step, min: range ? range.min : null, max: range ? range.max : null, inputmode: "decimal" });
    if (value !== undefined && value !== null) field.value = value;
    if (range) hint.push(`${range.min}–${range.max}${range.step ? `, ×${range.step}` : ""}`);
    if (name === "seed") { field.placeholder = "random"; hint.push("empty: random"); }
  } else if (name === "prompt" || name === "negative_prompt") {
    field = el("textarea", { name, rows: name === "prompt" ? 2 : 1 });
    field.value = value ?? (name === "prompt" ? "a lighthouse at dusk" : "");
  } else {
    field = el("input", { name, type: "text" });
    if (value !== undefined && value !== null) field.value = Array.isArray(value) ? value.join(",") : value;
  }
  if (value !== undefined && value !== null && typeof value !== "boolean") hint.push(`default ${value}`);
  const id = `hint-${name}`;
  if (hint.length) field.setAttribute("aria-describedby", id);
  return el("label", { "data-param": name, class: name.endsWith("prompt") ? "wide" : null }, name.replaceAll("_", " "), field,
    hint.length ? el("span", { class: "hint", id }, hint.join(" · ")) : "");
}

function inputField(name) {
  const chosen = inputs[name];
  const file = el("input", { name, type: "file", accept: "image/png,image/jpeg,image/webp", "aria-describedby": `from-${name}` });
  const from = el("span", { class: "hint", id: `from-${name}` }, chosen ? `using ${chosen.label}` : "choose a file");
  file.addEventListener("change", () => {  // a file chosen: it replaces a result sent here
    delete inputs[name]; from.textContent = file.files.length ? `using ${file.files[0].name}` : "choose a file";
    if (name === "image") showInput();
  });
  const children = [name === "image" ? "Input image" : `${name} file`, file, from];
  if (chosen) children.push(el("button", { type: "button", "data-key": `clear:${name}`, onclick: () => { delete inputs[name]; buildForm(); } }, "Choose a file instead"));
  return el("label", { "data-param": name }, children);
}

// The kinds the models run (adapters run none); the model list keeps those running the chosen
// kind, `model` chosen when it is one of them (else the first), or none with CHOOSE: the list then
// starts with "choose a model" and the form keeps its prompt until one is chosen; the form shows
// every param of that kind with its range and default, then `keep`'s values.
function buildForm(keep = {}, model = form().elements.model.value) {
  const f = form();
  const kinds = kindsRun();
  const kind = kinds.includes(f.elements.kind.value) ? f.elements.kind.value : kinds[0];
  if ([...f.elements.kind.options].map((o) => o.value).join() !== kinds.join())
    f.elements.kind.replaceChildren(...kinds.map((k) => el("option", { value: k }, k)));
  f.elements.kind.value = kind;
  const models = runnable().filter((m) => m.kinds.includes(kind)).map((m) => m.id);
  const choosing = f.elements.model.querySelector("option[value='']") && f.elements.prompt ? { ...awaiting, prompt: f.elements.prompt.value } : {};
  const choose = model === CHOOSE && models.length > 0;
  if (!choose) awaiting = {};
  f.elements.model.replaceChildren(...(choose ? [el("option", { value: "" }, "choose a model")] : []), ...models.map((id) => el("option", { value: id }, id)));
  f.elements.model.value = choose ? "" : models.includes(model) ? model : models[0] || "";
  const spec = kindSpec();
  const fields = spec.params.filter((name) => !spec.inputs.includes(name) && !NOT_IN_FORM.includes(name));
  $("#params").replaceChildren(el("legend", {}, `Parameters of ${kind}`), ...fields.map((name) => paramField(name, spec)));
  for (const [name, value] of Object.entries({ ...choosing, ...keep })) setField(name, value);
  fitInputs();
  buildAdapters(spec);
}

function setField(name, value) {
  const field = form().elements[name];
  if (!field || field instanceof RadioNodeList || field.type === "file") return;
  field.dataset.edited = "1";  // chosen, not a default: kept across a change of kind or model
  if (field.type === "checkbox") field.checked = Boolean(value);
  else field.value = value === null || value === undefined ? "" : Array.isArray(value) ? value.join(",") : value;
}

function fitInputs() {
  const spec = kindSpec();
  const box = $("#inputs");
  box.hidden = !spec.inputs.length;
  const mask = spec.inputs.includes("mask");
  box.replaceChildren(el("legend", {}, "Inputs"), ...spec.inputs.map(inputField), mask ? maskEditor() : "");
  if (mask) showInput();
}

// The adapters that fit the chosen model (its `adapters`: those of its family the server's
// check would not refuse), each with a scale (params.adapters: [{id, scale}]).
function buildAdapters(spec) {
  const model = chosenModel();
  const box = $("#adapters");
  const fitting = new Set((model && model.adapters) || []);
  const family = state.models.filter((m) => m.kinds.includes("adapter") && fitting.has(m.id));
  box.hidden = !(spec.params.includes("adapters") && family.length);
  box.replaceChildren(el("legend", {}, "Adapters (LoRA) that fit this model"), ...family.map((a) => el("div", { class: "adapter", "data-adapter": a.id },
    el("label", { class: "inline" }, el("input", { type: "checkbox", name: "adapter", value: a.id }), a.id),
    el("label", { class: "inline" }, "scale", el("input", { type: "number", name: `scale:${a.id}`, value: "1", step: "0.05", min: "-4", max: "4",
      "aria-label": `scale of ${a.id}` })))));
}

// ---- the inpaint mask: drawn over the input image (white: repaint), or uploaded ----
const mask = { canvas: null, drawn: false, size: null };
// The brush paints black and white stripes, seen on any image (one colour vanished on an image
// of that colour); the mask reads only where it painted (alpha, maskPng). An 8 px tile.
function stripes() {
  const tile = el("canvas"); tile.width = 8; tile.height = 8;
  const context = tile.getContext("2d");
  context.fillStyle = "#fff"; context.fillRect(0, 0, 8, 8);
  context.strokeStyle = "#000"; context.lineWidth = 2.5;
  for (const shift of [-8, 0, 8]) { context.beginPath(); context.moveTo(shift, 8); context.lineTo(shift + 8, 0); context.stroke(); }
  return tile;
}
// the mask canvas is read back (maskPng, the page's checks): the browser keeps it in memory for that
const maskContext = (canvas) => canvas.getContext("2d", { willReadFrequently: true });
function maskEditor() {
  const canvas = el("canvas", { id: "mask-canvas", role: "img", "aria-label": "Mask: drag to paint the area to repaint", tabindex: "0" });
  const image = el("img", { id: "mask-image", alt: "the input image under the mask" });
  mask.canvas = canvas; mask.drawn = false;
  let mode = "draw"; let last = null;  // the stroke's previous point while the pointer is down
  const brush = el("input", { type: "range", id: "brush-size", min: "1", max: "32", value: "6", "aria-label": "brush size (pixels of the image)" });
  const spot = (event) => {
    const box = canvas.getBoundingClientRect();
    return [(event.clientX - box.left) * (canvas.width / box.width), (event.clientY - box.top) * (canvas.height / box.height)];
  };
  // a round brush from the previous point to this one (pointer events come sparse on a fast move)
  const stroke = (event) => {
    const context = maskContext(canvas);
    context.globalCompositeOperation = mode === "erase" ? "destination-out" : "source-over";
    context.strokeStyle = context.createPattern(stripes(), "repeat"); context.lineWidth = Number(brush.value); context.lineCap = "round";
    const point = spot(event);
    context.beginPath(); context.moveTo(...(last || point)); context.lineTo(...point); context.stroke();
    last = point; mask.drawn = true;
  };
  canvas.addEventListener("pointerdown", (event) => { last = null; canvas.setPointerCapture(event.pointerId); stroke(event); });
  canvas.addEventListener("pointermove", (event) => { if (last) stroke(event); });
  for (const name of ["pointerup", "pointercancel"]) canvas.addEventListener(name, () => { last = null; });
  const modeButton = (name, label) => el("button", { type: "button", id: `mask-${name}`, "aria-pressed": String(name === mode),
    onclick: (event) => { mode = name; for (const b of event.target.parentNode.querySelectorAll("[aria-pressed]")) b.setAttribute("aria-pressed", String(b === event.target)); } }, label);
  return el("div", { class: "mask-editor", role: "group", "aria-label": "Mask editor" },
    el("div", { class: "mask-stage" }, image, canvas),
    el("div", { class: "row" }, modeButton("draw", "Brush"), modeButton("erase", "Erase"),
      el("button", { type: "button", id: "mask-clear", onclick: () => { maskContext(canvas).clearRect(0, 0, canvas.width, canvas.height); mask.drawn = false; } }, "Clear"),
      el("label", { class: "inline" }, "size", brush)),
    el("p", { class: "hint" }, "Paint the area to repaint (white in the mask), or upload a mask file above."));
}

// The input image under the canvas: the chosen file, or the result sent here.
async function showInput() {
  const file = form().elements.image && form().elements.image.files[0];
  let url = null;
  if (file) url = URL.createObjectURL(file);
  else if (inputs.image && inputs.image.result) url = await resultUrl(inputs.image.result);
  const image = $("#mask-image");
  if (!url || !image) return;
  image.onload = () => {
    if (mask.size && mask.size[0] === image.naturalWidth && mask.size[1] === image.naturalHeight && mask.drawn) return;
    mask.canvas.width = image.naturalWidth; mask.canvas.height = image.naturalHeight; mask.drawn = false;
    mask.size = [image.naturalWidth, image.naturalHeight];
  };
  image.src = url;
}

// The drawn mask as the PNG the API expects: the image's size, white where painted, black elsewhere.
function maskPng() {
  const { canvas } = mask;
  const out = el("canvas"); out.width = canvas.width; out.height = canvas.height;
  const painted = maskContext(canvas).getImageData(0, 0, canvas.width, canvas.height).data;
  const context = out.getContext("2d");
  const pixels = context.createImageData(canvas.width, canvas.height);
  for (let i = 0; i < painted.length; i += 4) {
    const v = painted[i + 3] >= 128 ? 255 : 0;
    pixels.data[i] = v; pixels.data[i + 1] = v; pixels.data[i + 2] = v; pixels.data[i + 3] = 255;
  }
  context.putImageData(pixels, 0, 0);
  return new Promise((resolve) => out.toBlob(resolve, "image/png"));
}

// Uploaded inputs by content: POST /v1/files once, its id (the content digest) reused.
const uploads = new Map();
async function upload(blob, key) {
  if (!uploads.has(key)) {
    const body = new FormData(); body.append("file", blob, "input.png");
    uploads.set(key, api("/v1/files", { method: "POST", body }).then((stored) => stored.id));
    uploads.get(key).catch(() => uploads.delete(key));
  }
  return uploads.get(key);
}

// A number field's text as sent: an integer past 2^53 as a BigInt (its exact digits), else a Number.
const numeric = (text) => (/^\s*-?\d+\s*$/.test(text) && !Number.isSafeInteger(Number(text)) ? BigInt(text.trim()) : Number(text));

async function submission() {
  const f = form();
  const spec = kindSpec();
  if (!f.elements.model.value) throw new ApiError(422, { error: { reason: "invalid_model", message: `choose a model: one that runs ${f.elements.kind.value}` } });
  const params = {};
  for (const label of $("#params").querySelectorAll("label[data-param]")) {
    const name = label.dataset.param; const field = f.elements[name];
    if (field.type === "checkbox") params[name] = field.checked;
    else if (field.value === "") continue;
    else if (field.type === "number") params[name] = numeric(field.value);
    else params[name] = field.value;
  }
  if (spec.params.includes("stop") && typeof params.stop === "string") params.stop = params.stop.split(",");
  for (const name of spec.inputs) {
    const file = f.elements[name] && f.elements[name].files[0];
    if (name === "mask" && mask.drawn && !file) {
      const png = await maskPng();
      params.mask = await upload(png, `mask:${png.size}:${Date.now()}`);
    } else if (file) params[name] = await upload(file, `${file.name}:${file.size}:${file.lastModified}`);
    else if (inputs[name]) params[name] = inputs[name].digest;
    else throw new ApiError(422, { error: { reason: `invalid_${name}`, message: `choose an input (${name}): ${article(f.elements.kind.value)} ${f.elements.kind.value} job needs it` +
      (name === "mask" ? ", or paint the mask over the image" : "") } });
  }
  const adapters = [...f.querySelectorAll("input[name=adapter]:checked")].map((box) => ({ id: box.value, scale: Number(f.elements[`scale:${box.value}`].value) }));
  if (adapters.length) params.adapters = adapters;
  return { kind: f.elements.kind.value, model: f.elements.model.value, target: f.elements.target.value, params };
}

// Remix: the form filled from a job (its model, kind, target and params; its inputs as results),
// a new random seed when asked.
function fillFrom(job, newSeed, image = null) {
  for (const name of Object.keys(inputs)) delete inputs[name];
  const f = form();
  f.elements.kind.value = job.kind; buildForm();
  const runs = runnable().some((m) => m.id === job.model && m.kinds.includes(job.kind));
  if ([...f.elements.target.options].some((o) => o.value === job.target)) f.elements.target.value = job.target;
  const spec = kindSpec();
  for (const name of spec.inputs) {
    const digest = job.params[name];
    if (digest) inputs[name] = { digest, label: `the job's ${name} (${short(String(digest).replace(/^[a-z0-9]+:/, ""))})`,
      result: state.jobs.flatMap(resultsOf).find((r) => r.digest === digest) };
  }
  const params = { ...job.params };
  if (newSeed) params.seed = Math.floor(Math.random() * 2 ** 31);
  else if (image && image.result.seed !== null && image.result.seed !== undefined) Object.assign(params, { seed: image.result.seed, n: 1 });
  else if (job.seed !== null && job.seed !== undefined) params.seed = job.seed;
  buildForm(params, runs ? job.model : CHOOSE);
  awaiting = runs ? {} : params;  // its settings come back once a model is chosen
  if (job.params.adapters) for (const a of job.params.adapters) {
    const box = f.querySelector(`input[name=adapter][value="${CSS.escape(a.id)}"]`);
    if (box) { box.checked = true; f.elements[`scale:${a.id}`].value = a.scale ?? 1; }
  }
  say(`Form filled from ${image ? `${nth(image.index, image.count)} of ` : ""}job ${job.id}${newSeed ? " with a new seed" : ""}: ` + (runs ? "Submit to run it"
    : `${notRunning(job.model, job.kind)}, choose a model, then Submit`));
  location.hash = "#submit";
}

// Why a job's model is not offered for `kind`: out of service (retired, so no longer listed), or
// it runs other kinds.
const notRunning = (model, kind) => (runnable().some((m) => m.id === model)
  ? `its model ${model} does not run ${kind}` : `its model ${model} is no longer in service (retired)`);

// Send result `index` of a job to another kind as its input image (results as inputs: the result's
// digest), with the job's model when it runs that kind, else none chosen: the user picks one.
const article = (word) => (/^[aeiou]/i.test(word) ? "an" : "a");

function sendTo(job, kind, index = 0) {
  for (const name of Object.keys(inputs)) delete inputs[name];
  const results = resultsOf(job); const result = results[index];
  const which = (id) => (results.length > 1 ? `${nth(index, results.length)} of job ${id}` : `the result of job ${id}`);
  inputs.image = { digest: result.digest, label: which(short(job.id)), result };
  const runs = runnable().some((m) => m.id === job.model && m.kinds.includes(kind));
  form().elements.kind.value = kind;
  // an upscale's prompt describes the picture only if asked for: empty, never the form's example
  buildForm(kind === "upscale" ? { prompt: "" } : job.params.prompt ? { prompt: job.params.prompt } : {}, runs ? job.model : CHOOSE);
  say(`Sent ${which(job.id)} to ${kind}: ` + (runs ? `with its model ${job.model}, choose the settings and Submit`
    : `${notRunning(job.model, kind)}, choose a model, then Submit`));
  location.hash = "#submit";
}

function explain(decision) {
  const rows = Object.entries(decision.machines || {}).map(([name, d]) => el("tr", {},
    el("td", { "data-label": "Machine" }, name), el("td", { "data-label": "Verdict" }, d.eligible ? "eligible" : "excluded"),
    el("td", { "data-label": "Why" }, d.eligible ? `finish ${seconds(d.finish_s)} (work ahead ${seconds(d.work_ahead_s)}, load ${seconds(d.cold_load_s)}, run ${seconds(d.run_s)})`
                            : el("span", { class: "reason" }, `${d.reason}: ${d.message || ""}`)),
    el("td", { "data-label": "Memory", class: "memory" }, d.memory ? `memory: ${d.memory.text}` : "")));
  const verdict = decision.machine ? el("p", {}, `Would run on `, el("b", {}, decision.machine))
    : el("p", { class: "reason", "data-reason": decision.error?.reason }, `Would be refused: ${decision.error?.reason}: ${decision.error?.message}`);
  $("#explanation").replaceChildren(verdict, el("table", { class: "cards" }, el("tbody", {}, rows)));
}

async function dryRun() {
  try { explain(await api("/v1/jobs?dry_run=true", { method: "POST", json: await submission() })); }
  catch (error) { $("#explanation").replaceChildren(el("p", { class: "reason", "data-reason": error.reason }, `${error.reason}: ${error.message}`)); }
}

async function submit(event) {
  event.preventDefault();
  const box = $("#submitted"); const status = $(".status", box); const progress = $("#submitted-progress");
  const interrupt = $("#interrupt-submitted");
  box.hidden = false; progress.value = 0; progress.dataset.seen = ""; $(".result", box).replaceChildren(); interrupt.hidden = true;
  delete box.dataset.job; status.textContent = "Submitting…";
  await dryRun();
  let accepted;
  try { accepted = await api("/v1/jobs", { method: "POST", json: await submission() }); }
  catch (error) {
    status.replaceChildren(el("span", { class: "reason", id: "refusal", "data-reason": error.reason }, `Refused: ${error.reason}: ${error.message}`));
    return;
  }
  status.textContent = `Job ${accepted.id} queued on ${accepted.machine} (position ${accepted.position})`;
  sessionStorage.setItem(SUBMITTED, accepted.id);  // a reload of this tab follows it again
  await followSubmitted(accepted.id);
}

// The Submit view's panel follows job `id` to its end: progress, state, then its results or
// why it ended otherwise. The events stream starts with the job's state, so a job followed
// again after a reload (or one that ended meanwhile) shows as it is now; a stream that stops
// before the job's end (the server restarted, the network dropped) is followed again, after
// 1 s and up to 8 s between tries, as long as the panel shows this job.
async function followSubmitted(id) {
  const box = $("#submitted"); const status = $(".status", box); const progress = $("#submitted-progress");
  const interrupt = $("#interrupt-submitted");
  box.hidden = false; box.dataset.job = id;
  interrupt.hidden = false;
  interrupt.onclick = () => act({ id }, "interrupt");
  let ended = false;
  for (let pause = 1000; ; pause = Math.min(2 * pause, 8000)) {
    let heard = false;
    try {
      const handle = (name, data) => {
        if (box.dataset.job !== id) return;  // a newer submission took the panel
        heard = true;
        if (name === "progress") {
          progress.max = data.total; progress.value = data.step;
          progress.dataset.seen = [progress.dataset.seen, data.step].filter(Boolean).join(",");
        } else if (name === "state") {
          status.textContent = `Job ${id} ${data.state} on ${data.machine}` + (data.reason ? ` (${data.reason}: ${data.message})` : "");
          interrupt.textContent = data.state === "running" ? "Interrupt" : "Cancel";  // a queued job is cancelled at once
        } else if (name === "end") {
          ended = true;
          interrupt.hidden = true;
          if (state.stopping === id) { state.stopping = null; say(`Job ${id} ${data.state}`); }
          if (data.result) { progress.value = progress.max; $(".result", box).replaceChildren(...allResults(data)); status.textContent = `Job ${id} succeeded on ${data.machine}`; }
          else status.replaceChildren(el("span", { class: "reason", id: "refusal", "data-reason": data.reason },
            [data.state, data.reason === data.state ? null : data.reason, data.message].filter(Boolean).join(": ")));
        }
      };
      if (await withStreamSlot(() => follow(`/v1/jobs/${id}/events`, handle)) === NO_SLOT) {
        // every stream slot taken (other tabs' streams): the job as it is now, read again in 1 s
        const job = await api(`/v1/jobs/${id}`);
        handle("state", job);
        if (job.progress) handle("progress", job.progress);
        if (ENDED.includes(job.state)) handle("end", job);
        if (ended || box.dataset.job !== id) return;
        await new Promise((resolve) => setTimeout(resolve, 1000));
        if (box.dataset.job !== id) return;
        continue;
      }
      if (ended || box.dataset.job !== id) return;
      status.dataset.lost = "stream ended";
    } catch (error) {
      if (box.dataset.job !== id) return;
      if (error.status === 404) { sessionStorage.removeItem(SUBMITTED); box.hidden = true; return; }  // gone (purged)
      if (error.status >= 400 && error.status < 500 && error.status !== 429) {  // a refusal no wait changes
        status.textContent = `lost the job's events: ${error.message}`; return;
      }
      status.dataset.lost = error.message;
    }
    if (heard) pause = 1000;  // it was answering: the next try soon
    status.textContent = `Job ${id}: following its events again … (${status.dataset.lost})`;
    await new Promise((resolve) => setTimeout(resolve, pause));
    if (box.dataset.job !== id) return;
  }
}

// ---- paging: the 1 s refresh reads the newest page alone; "Load older" adds the next ones ----
// The newest page read again, with the older pages loaded kept as they were, each job among them
// replaced by `updates` (id -> the job now, null: gone): the jobs that newer ones pushed off the
// newest page stay after it, in their order.
function withOlder(newest, updates) {
  if (!state.older || newest.length < PAGE) { state.older = false; state.more = newest.length === PAGE; return newest; }
  const ids = new Set(newest.map((job) => job.id));
  const last = state.jobs.findIndex((job) => job.id === newest[newest.length - 1].id);
  return [...newest, ...(last >= 0 ? state.jobs.slice(last + 1) : state.jobs).filter((job) => !ids.has(job.id))
    .map((job) => (updates.has(job.id) ? updates.get(job.id) : job)).filter(Boolean)];
}
// The loaded older jobs not ended yet, as they are now (id -> job): one read of the open jobs, oldest
// first, and a job no longer among them (it ended) read once by itself. No read while every older
// job has ended, as most have: the refresh stays one page, however many were loaded.
const OPEN_PAGE = 500;  // the API's largest page
async function olderUpdates(newest) {
  const ids = new Set(newest.map((job) => job.id));
  const open = state.older ? state.jobs.filter((job) => !ids.has(job.id) && !ENDED.includes(job.state)) : [];
  const updates = new Map();
  if (!open.length) return updates;
  for (const job of await api(`/v1/jobs?state=queued&state=running&order=oldest&limit=${OPEN_PAGE}`)) updates.set(job.id, job);
  if (updates.size === OPEN_PAGE) return updates;  // a backlog past one page: the others as they were
  for (const job of open.filter((known) => !updates.has(known.id)))
    updates.set(job.id, await api(`/v1/jobs/${job.id}`).catch((error) => (error.status === 404 ? null : job)));
  return updates;
}
// "Load older": the next PAGE jobs after the oldest loaded one (the API's cursor, `after=`), added
// after those shown; the Gallery's filters apply to them too. A cursor whose job is gone (404) is
// dropped for the one before it.
async function loadOlder() {
  if (state.loadingOlder || !state.jobs.length) return;
  state.loadingOlder = true; renderView();
  try {
    for (;;) {
      const cursor = state.jobs[state.jobs.length - 1];
      try {
        const page = await api(`/v1/jobs?limit=${PAGE}&after=${encodeURIComponent(cursor.id)}`);
        const known = new Set(state.jobs.map((job) => job.id));
        state.jobs = [...state.jobs, ...page.filter((job) => !known.has(job.id))];
        state.older = true; state.more = page.length === PAGE;
        break;
      } catch (error) {
        if (error.reason !== "job_not_found" || state.jobs.length < 2) throw error;
        state.jobs = state.jobs.filter((job) => job !== cursor);
      }
    }
  } catch (error) { alarm(`Loading older jobs failed: ${error.reason}: ${error.message}`); }
  finally { state.loadingOlder = false; }
  renderView();
}
// A view's paging line: `text` (how many it shows), whether older jobs exist, and Load older while they may.
function renderPaging(box, text) {
  const line = state.more ? `${text}; older jobs exist, not loaded yet` : `${text}: every job`;
  if ($(".paging-status", box).textContent !== line) $(".paging-status", box).textContent = line;
  const button = $(".load-older", box);
  button.hidden = !state.more; button.disabled = state.loadingOlder;
  button.textContent = state.loadingOlder ? "Loading…" : `Load ${PAGE} older jobs`;
}
const renderView = () => ({ fleet: renderFleet, jobs: renderJobs, gallery: renderGallery, submit: () => {} })[state.view]();

// One refresh at a time: a server slower than REFRESH_MS to answer had them pile up (5 at once at
// 4 s an answer, queued behind the browser's 6 connections) and land out of order, an older answer
// drawn over a newer one. A tick while one is under way is skipped; a view's change waits its turn.
let refreshing = null;
function refresh() {
  if (!refreshing) refreshing = refreshOnce().finally(() => { refreshing = null; });
  return refreshing;
}

async function refreshOnce() {
  if (!sessionStorage.getItem(KEY)) return;
  try {
    const [machines, newest] = await Promise.all([api("/v1/machines"), api(`/v1/jobs?limit=${PAGE}`)]);
    const updates = await olderUpdates(newest);
    state.machines = machines; state.jobs = withOlder(newest, updates);
    // the notice follows an interrupt to the job's end, whichever view or panel sent it
    const stopped = state.stopping && state.jobs.find((job) => job.id === state.stopping && ENDED.includes(job.state));
    if (stopped) { state.stopping = null; say(`Job ${stopped.id} ${stopped.state}`); }
    if (state.view === "fleet" && state.openMachine) await loadQueue();
    if (state.view === "fleet" || state.view === "jobs") followRunning();
    if (state.view !== "submit" && Date.now() - modelsReadAt > MODELS_REFRESH_MS) loadModels(true).catch(() => {});
    $("#error").hidden = true;
    renderView();
  } catch (error) {
    $("#error").hidden = false; $("#error").textContent = `${error.reason || "error"}: ${error.message}`;
  }
}

// The models and machines the Submit form offers (GET /v1/models, /v1/machines): read at start, then
// again while another view is shown (`follow`), so that a model registered, retired or given new
// defaults since the page loaded is offered without a reload. A change is applied only while the
// Submit view is not shown and no file is chosen in it: never under the user's hands; what was typed
// or filled from a job stays (the fields marked edited), as across a change of model.
let modelsSeen = "";
let modelsReadAt = 0;

async function loadModels(follow = false) {
  modelsReadAt = Date.now();
  const [models, machines] = await Promise.all([api("/v1/models"), api("/v1/machines")]);  // then the form at once
  const seen = toJson([models.data, machines.map((m) => m.name)]);  // BigInt-safe: a seed range reaches 2^63-1
  const filesChosen = [...form().querySelectorAll("input[type=file]")].some((file) => file.files.length);
  if (follow && (seen === modelsSeen || state.view === "submit" || filesChosen || mask.drawn)) return;
  modelsSeen = seen;
  state.models = models.data;  // OpenAI's list shape: {"object": "list", "data": [...]}
  const model = form().elements.model;
  const [kindBefore, modelBefore] = [form().elements.kind.value, model.value];
  const gone = follow && modelBefore && !runnable().some((m) => m.id === modelBefore && m.kinds.includes(kindBefore));
  // a chosen model retired meanwhile (or no longer running the kind): none is chosen in its place, and the notice says so
  buildForm(follow ? edited() : {}, gone || (follow && model.querySelector("option[value='']") && !model.value) ? CHOOSE : model.value);
  if (gone) say(`The model ${modelBefore} is no longer in service for ${kindBefore} (retired or changed): choose a model, then Submit`, { lasting: true });
  const target = $("#submit-form select[name=target]");
  const chosen = target.value;
  target.replaceChildren(el("option", { value: "server" }, "server"), el("option", { value: "auto" }, "Auto"),
    ...machines.filter((m) => m.name !== "server").map((m) => el("option", { value: m.name }, m.name)));
  target.value = [...target.options].some((o) => o.value === chosen) ? chosen : "server";
}

function show(view) {
  state.view = ["fleet", "jobs", "gallery", "submit"].includes(view) ? view : "fleet";
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${state.view}`;
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.dataset.view === state.view);
    if (link.dataset.view === state.view) link.setAttribute("aria-current", "page"); else link.removeAttribute("aria-current");
  }
  refresh();
}

function askKey(message) {
  sessionStorage.removeItem(KEY);
  $("#key-form").hidden = false;
  $("#error").hidden = !message; $("#error").textContent = message || "";
}

function start() {
  $("#key-form").hidden = true;
  loadModels().catch(() => {});
  show(location.hash.slice(1));
  const submitted = sessionStorage.getItem(SUBMITTED);
  if (submitted && !$("#submitted").dataset.job) followSubmitted(submitted);
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("#key-input").value.trim());
  start();
});
$("#forget-key").addEventListener("click", () => askKey(""));
$("#notice-close").addEventListener("click", unsay);
$("#dry-run").addEventListener("click", dryRun);
// A field the user typed in (or the form filled from a job) keeps its value when the kind or
// the model changes, where the new kind has it; the others take the new model's defaults.
$("#params").addEventListener("input", (event) => { if (event.target.name) event.target.dataset.edited = "1"; });
const edited = () => Object.fromEntries([...$("#params").querySelectorAll("[data-edited]")]
  .map((field) => [field.name, field.type === "checkbox" ? field.checked : field.value]));
for (const name of ["kind", "model"]) $(`#submit-form select[name=${name}]`).addEventListener("change", () => { buildForm(edited()); $("#explanation").replaceChildren(); });
form().addEventListener("submit", submit);
// A field the browser refuses stops the submission before `submit` runs: an earlier refusal or
// dry run shown there would read as this one's; the status says what was not sent and why instead.
form().addEventListener("invalid", (event) => {
  $("#explanation").replaceChildren();
  const status = $("#submitted .status");
  if (!$("#submitted").hidden) status.textContent = `Not sent: ${event.target.name}: ${event.target.validationMessage}`;
}, true);
for (const id of ["#filter-model", "#filter-machine", "#filter-state"]) $(id).addEventListener("change", renderGallery);
for (const button of document.querySelectorAll(".load-older")) button.addEventListener("click", loadOlder);
window.addEventListener("hashchange", () => show(location.hash.slice(1)));
setInterval(refresh, REFRESH_MS);
if (sessionStorage.getItem(KEY)) start(); else askKey("");
