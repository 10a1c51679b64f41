// The fleet page (docs/operations.md, "The fleet page"): plain JS module, no build step, talks to this
// server's JSON API only.
// The API key is asked for once and kept in sessionStorage; every call sends it as a bearer token.

const KEY = "homefleet.api_key";
const REFRESH_MS = 1000;
const $ = (selector, root = document) => root.querySelector(selector);
const state = { machines: [], jobs: [], models: [], queue: [], view: "fleet", openMachine: null, openJob: null, blobs: new Map() };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
  return node;
}

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status; this.reason = error.reason || `http_${status}`; this.body = body;
  }
}

async function api(path, options = {}) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY) || ""}`, ...(options.headers || {}) };
  if (options.json !== undefined) { headers["Content-Type"] = "application/json"; options.body = JSON.stringify(options.json); }
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) askKey("the server refused the key: give another");
  const body = (response.headers.get("content-type") || "").includes("json") ? await response.json() : null;
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

// Server-Sent Events over fetch (EventSource cannot send the Authorization header).
async function follow(path, onEvent) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY)}`, Accept: "text/event-stream" } });
  if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
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
      if (data.length) onEvent(event, JSON.parse(data.join("\n")));
    }
  }
}

// A result as a Blob and its blob: URL (an <img> cannot send the key), cached per job.
async function resultBlob(job) {
  if (!state.blobs.has(job.id)) {
    state.blobs.set(job.id, (async () => {
      const response = await fetch(job.result.url, { headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY)}` } });
      if (!response.ok) throw new ApiError(response.status, null);
      const blob = await response.blob();
      return { blob, url: URL.createObjectURL(blob) };
    })());
  }
  return state.blobs.get(job.id);
}
const resultUrl = async (job) => (await resultBlob(job)).url;
const isMedia = (job) => /^(image|video)\//.test(job.result.media_type);

function media(job) {
  if (!isMedia(job)) {  // a text job's answer (text/plain), shown as text
    const node = el("pre", { class: "text-result", "data-job": job.id });
    resultBlob(job).then(({ blob }) => blob.text()).then((text) => { node.textContent = text; },
      () => { node.replaceWith(el("span", { class: "reason" }, "result unavailable")); });
    return node;
  }
  const video = job.result.media_type.startsWith("video/");
  const node = video ? el("video", { muted: "", loop: "", preload: "metadata", "data-job": job.id, title: "click to play" })
                     : el("img", { alt: job.params.prompt || job.id, "data-job": job.id });
  if (video) node.addEventListener("click", () => (node.paused ? node.play() : node.pause()));
  resultUrl(job).then((url) => { node.src = url; }, () => { node.replaceWith(el("span", { class: "reason" }, "result unavailable")); });
  return node;
}

const seconds = (s) => (s === null || s === undefined ? "–" : `${Number(s).toFixed(1)} s`);
const gib = (bytes) => `${(bytes / 2 ** 30).toFixed(1)} GiB`;
const actual = (job) => (job.load_s === null && job.run_s === null ? null : (job.load_s || 0) + (job.run_s || 0));
// Running jobs' progress, live: each one's events (SSE) while it runs, at most MAX_FOLLOWED at once
// (a browser keeps 6 connections per server); the others show the 1 s poll's progress.
const MAX_FOLLOWED = 3;
const live = new Map();  // job id -> {step, total, seen: [steps from its events]}
function followRunning() {
  for (const job of state.jobs) {
    if (job.state !== "running" || live.has(job.id) || live.size >= MAX_FOLLOWED) continue;
    const entry = { ...(job.progress || { step: 0, total: 1 }), seen: [] };
    live.set(job.id, entry);
    follow(`/v1/jobs/${job.id}/events`, (name, data) => {
      if (name !== "progress") return;
      entry.step = data.step; entry.total = data.total; entry.seen.push(data.step);
      for (const node of document.querySelectorAll(`progress[data-job='${job.id}']`)) paint(node, entry);
    }).catch(() => {}).finally(() => live.delete(job.id));
  }
}
function paint(node, progress) {
  node.max = progress.total; node.value = progress.step; node.title = `${progress.step}/${progress.total}`;
  if (progress.seen) node.dataset.seen = progress.seen.join(",");
}
function bar(job) {
  const node = el("progress", { "data-job": job.id });
  paint(node, live.get(job.id) || job.progress);
  return node;
}
const progressOf = (job) => live.get(job.id) || job.progress;

function machineState(machine) {
  if (!machine.online) return "offline";
  if (machine.syncing) return "syncing";
  if (machine.draining) return "draining";
  return "online";
}

function renderFleet() {
  const body = $("#machines tbody");
  body.replaceChildren(...state.machines.map((m) => {
    const running = state.jobs.filter((job) => job.machine === m.name && job.state === "running");
    return el("tr", { "data-machine": m.name, onclick: () => { state.openMachine = m.name; state.queue = []; loadQueue().then(renderFleet); } },
      el("td", {}, m.name),
      el("td", { class: `state-${machineState(m)}` }, machineState(m)),
      el("td", {}, m.backend),
      el("td", {}, `${m.memory_kind}, ${gib(m.memory_bytes)}`),
      el("td", {}, (m.warm_models || []).join(", ") || "–"),
      el("td", {}, (m.committed_models || []).join(", ") || "–"),
      el("td", {}, m.queued),
      el("td", {}, m.running, " ", running.filter(progressOf).map(bar)),
      el("td", {}, seconds(m.drain_s)));
  }));
  const box = $("#machine-queue");
  box.hidden = !state.openMachine;
  if (!state.openMachine) return;
  $("h2", box).textContent = `Queue of ${state.openMachine}, in order`;
  const line = [...state.queue].sort((a, b) => (a.state === b.state ? 0 : a.state === "running" ? -1 : 1));  // stable: oldest first
  $("ol", box).replaceChildren(...(line.length ? line.map((job) => el("li", { "data-job": job.id }, `${job.state} ${job.id} ${job.kind} ${job.model} `,
    job.params.prompt ? `“${job.params.prompt}” ` : "", progressOf(job) ? bar(job) : "")) : [el("li", {}, "nothing queued")]));
}

// The open machine's whole backlog in its order (oldest first, not only the recent jobs the page polls).
async function loadQueue() {
  const machine = state.openMachine;
  const line = await api(`/v1/jobs?machine=${encodeURIComponent(machine)}&state=running&state=queued&order=oldest&limit=500`);
  if (machine === state.openMachine) state.queue = line;
}

function renderJobs() {
  $("#jobs tbody").replaceChildren(...state.jobs.map((job) => el("tr", { "data-job": job.id, onclick: () => { state.openJob = job.id; renderJobs(); } },
    el("td", {}, job.id), el("td", { class: `job-${job.state}` }, job.state), el("td", {}, job.kind), el("td", {}, job.model),
    el("td", {}, job.machine || "–"), el("td", {}, seconds(job.predicted_s)), el("td", {}, seconds(actual(job))),
    el("td", {}, progressOf(job) ? bar(job) : job.reason ? el("span", { class: "reason" }, `${job.reason}: ${job.message || ""}`) : ""))));
  const box = $("#job-detail");
  const job = state.jobs.find((j) => j.id === state.openJob);
  box.hidden = !job;
  if (!job) return;
  if ($("h2", box).textContent !== `Job ${job.id} (${job.state})`) {
    $("h2", box).textContent = `Job ${job.id} (${job.state})`;
    $(".result", box).replaceChildren(job.result ? media(job) : "");
  }
  $("pre", box).textContent = JSON.stringify(job.provenance || job, null, 2);
}

function options(select, values) {
  const chosen = select.value;
  select.replaceChildren(el("option", { value: "" }, "all"), ...values.map((v) => el("option", { value: v }, v)));
  select.value = values.includes(chosen) ? chosen : "";
}

function renderGallery() {
  const done = state.jobs.filter((job) => (job.result ? isMedia(job) : job.kind !== "text"));
  options($("#filter-model"), [...new Set(state.jobs.map((j) => j.model))].sort());
  options($("#filter-machine"), [...new Set(state.jobs.map((j) => j.machine).filter(Boolean))].sort());
  options($("#filter-state"), [...new Set(state.jobs.map((j) => j.state))].sort());
  const [model, machine, jobState] = ["#filter-model", "#filter-machine", "#filter-state"].map((s) => $(s).value);
  const shown = done.filter((j) => (!model || j.model === model) && (!machine || j.machine === machine) && (!jobState || j.state === jobState));
  const gallery = $("#gallery");
  const have = [...gallery.children].map((figure) => `${figure.dataset.job}:${figure.dataset.state}`).join();
  if (have === shown.map((j) => `${j.id}:${j.state}`).join()) return;
  gallery.replaceChildren(...shown.map((job) => el("figure", { "data-job": job.id, "data-state": job.state },
    job.result ? media(job) : el("div", { class: `placeholder job-${job.state}` }, job.state, el("br"),
      job.reason ? el("span", { class: "reason" }, `${job.reason}: ${job.message || ""}`) : ""),
    el("figcaption", {}, el("b", {}, job.params.prompt || "(no prompt)"), el("br"), `${job.model} on ${job.machine || "–"}`))));
}

// What the chosen model takes for the chosen kind (GET /v1/models' params: the server's KindSpec).
function kindSpec() {
  const form = $("#submit-form");
  const model = state.models.find((m) => m.id === form.elements.model.value);
  return (model && model.params && model.params[form.elements.kind.value]) || { params: ["prompt"], inputs: [] };
}

// The kinds the models run; the model list keeps those running the chosen kind; the form shows
// the fields that kind takes (an input image only for kinds with inputs: edit, upscale).
function fitForm() {
  const form = $("#submit-form");
  const kinds = [...new Set(state.models.flatMap((m) => m.kinds))];
  const kind = kinds.includes(form.elements.kind.value) ? form.elements.kind.value : kinds[0];
  if ([...form.elements.kind.options].map((o) => o.value).join() !== kinds.join())
    form.elements.kind.replaceChildren(...kinds.map((k) => el("option", { value: k }, k)));
  form.elements.kind.value = kind;
  const models = state.models.filter((m) => m.kinds.includes(kind)).map((m) => m.id);
  const chosen = form.elements.model.value;
  form.elements.model.replaceChildren(...models.map((id) => el("option", { value: id }, id)));
  form.elements.model.value = models.includes(chosen) ? chosen : models[0] || "";
  const spec = kindSpec();
  for (const label of form.querySelectorAll("label[data-param]"))
    label.hidden = !(spec.params.includes(label.dataset.param) || spec.inputs.includes(label.dataset.param));
}

// Uploaded inputs by file (name, size, date): POST /v1/files once, its id (the content digest) reused.
const uploads = new Map();
async function upload(file) {
  const key = `${file.name}:${file.size}:${file.lastModified}`;
  if (!uploads.has(key)) {
    const body = new FormData(); body.append("file", file);
    uploads.set(key, api("/v1/files", { method: "POST", body }).then((stored) => stored.id));
    uploads.get(key).catch(() => uploads.delete(key));
  }
  return uploads.get(key);
}

async function submission() {
  const form = $("#submit-form");
  const spec = kindSpec();
  const params = {};
  if (spec.params.includes("prompt")) params.prompt = form.elements.prompt.value;
  for (const name of ["width", "height", "steps"]) if (spec.params.includes(name) && form.elements[name].value) params[name] = Number(form.elements[name].value);
  for (const name of spec.inputs) {
    const file = form.elements[name] && form.elements[name].files[0];
    if (!file) throw new ApiError(422, { error: { reason: `invalid_${name}`, message: `choose an input image (${name}): a ${form.elements.kind.value} job edits an uploaded file` } });
    params[name] = await upload(file);
  }
  return { kind: form.elements.kind.value, model: form.elements.model.value, target: form.elements.target.value, params };
}

function explain(decision) {
  const rows = Object.entries(decision.machines || {}).map(([name, d]) => el("tr", {},
    el("td", {}, name), el("td", {}, d.eligible ? "eligible" : "excluded"),
    el("td", {}, d.eligible ? `finish ${seconds(d.finish_s)} (work ahead ${seconds(d.work_ahead_s)}, load ${seconds(d.cold_load_s)}, run ${seconds(d.run_s)})`
                            : el("span", { class: "reason" }, `${d.reason}: ${d.message || ""}`)),
    el("td", { class: "memory" }, d.memory ? `memory: ${d.memory.text}` : "")));
  const verdict = decision.machine ? el("p", {}, `Would run on `, el("b", {}, decision.machine))
    : el("p", { class: "reason", "data-reason": decision.error?.reason }, `Would be refused: ${decision.error?.reason}: ${decision.error?.message}`);
  $("#explanation").replaceChildren(verdict, el("table", {}, el("tbody", {}, rows)));
}

async function dryRun() {
  try { explain(await api("/v1/jobs?dry_run=true", { method: "POST", json: await submission() })); }
  catch (error) { $("#explanation").replaceChildren(el("p", { class: "reason", "data-reason": error.reason }, `${error.reason}: ${error.message}`)); }
}

async function submit(event) {
  event.preventDefault();
  await dryRun();
  const box = $("#submitted"); const status = $(".status", box); const progress = $("#submitted-progress");
  box.hidden = false; progress.value = 0; progress.dataset.seen = ""; $(".result", box).replaceChildren();
  let accepted;
  try { accepted = await api("/v1/jobs", { method: "POST", json: await submission() }); }
  catch (error) {
    status.replaceChildren(el("span", { class: "reason", id: "refusal", "data-reason": error.reason }, `Refused: ${error.reason}: ${error.message}`));
    return;
  }
  status.textContent = `Job ${accepted.id} queued on ${accepted.machine} (position ${accepted.position})`;
  box.dataset.job = accepted.id;
  await follow(`/v1/jobs/${accepted.id}/events`, (name, data) => {
    if (name === "progress") {
      progress.max = data.total; progress.value = data.step;
      progress.dataset.seen = [progress.dataset.seen, data.step].filter(Boolean).join(",");
    } else if (name === "state") {
      status.textContent = `Job ${accepted.id} ${data.state} on ${data.machine}` + (data.reason ? ` (${data.reason}: ${data.message})` : "");
    } else if (name === "end") {
      if (data.result) { progress.value = progress.max; $(".result", box).replaceChildren(media(data)); }
      else status.replaceChildren(el("span", { class: "reason", id: "refusal", "data-reason": data.reason }, `${data.state}: ${data.reason}: ${data.message}`));
    }
  }).catch((error) => { status.textContent = `lost the job's events: ${error.message}`; });
}

async function refresh() {
  if (!sessionStorage.getItem(KEY)) return;
  try {
    const [machines, jobs] = await Promise.all([api("/v1/machines"), api("/v1/jobs?limit=200")]);
    state.machines = machines; state.jobs = jobs;
    if (state.view === "fleet" && state.openMachine) await loadQueue();
    if (state.view === "fleet" || state.view === "jobs") followRunning();
    $("#error").hidden = true;
    ({ fleet: renderFleet, jobs: renderJobs, gallery: renderGallery, submit: () => {} })[state.view]();
  } catch (error) {
    $("#error").hidden = false; $("#error").textContent = `${error.reason || "error"}: ${error.message}`;
  }
}

async function loadModels() {
  const [models, machines] = await Promise.all([api("/v1/models"), api("/v1/machines")]);  // then the form at once
  state.models = models.data;  // OpenAI's list shape: {"object": "list", "data": [...]}
  fitForm();
  const target = $("#submit-form select[name=target]");
  target.replaceChildren(el("option", { value: "server" }, "server"), el("option", { value: "auto" }, "Auto"),
    ...machines.filter((m) => m.name !== "server").map((m) => el("option", { value: m.name }, m.name)));
}

function show(view) {
  state.view = ["fleet", "jobs", "gallery", "submit"].includes(view) ? view : "fleet";
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${state.view}`;
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.view === state.view);
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
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("#key-input").value.trim());
  start();
});
$("#forget-key").addEventListener("click", () => askKey(""));
$("#dry-run").addEventListener("click", dryRun);
for (const name of ["kind", "model"]) $(`#submit-form select[name=${name}]`).addEventListener("change", () => { fitForm(); $("#explanation").replaceChildren(); });
$("#submit-form").addEventListener("submit", submit);
for (const id of ["#filter-model", "#filter-machine", "#filter-state"]) $(id).addEventListener("change", renderGallery);
window.addEventListener("hashchange", () => show(location.hash.slice(1)));
setInterval(refresh, REFRESH_MS);
if (sessionStorage.getItem(KEY)) start(); else askKey("");
