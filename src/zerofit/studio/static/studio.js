// zerofit studio's page: it sends the form as the command line's words and shows what the server's command
// line code returns. No config rule lives here: every check, default and figure comes from the server.
"use strict";

const $ = (sel) => document.querySelector(sel);
const FIELDS = ["config", "model", "gpu", "num_gpus", "objective", "method", "preset", "seq_len", "global_batch", "overrides"];
const SEGMENT_COLOURS = { weights: "#4f8cff", gradients: "#e8743b", optimizer: "#945ecf", activations: "#19a979", buffers: "#8a93a6", headroom: "#e6e9ef" };
let planSeq = 0, lastPlan = null, watching = null, source = null, rowsSeen = [];

async function api(path, body) {
  const init = body === undefined ? {} : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const response = await fetch(path, init);
  let data;
  try { data = await response.json(); } catch (e) { data = { error: `${response.status} ${response.statusText}` }; }
  if (!response.ok && !data.error) data.error = `${response.status} ${response.statusText}`;
  return data;
}

function fill(select, values, labels) {
  select.replaceChildren(...values.map((v, i) => new Option(labels ? labels[i] : v, v)));
}

function text(el, value) { el.textContent = value == null ? "" : String(value); }

// ---- tabs
for (const button of document.querySelectorAll("nav .tab")) {
  button.addEventListener("click", () => showTab(button.dataset.tab));
}
function showTab(name) {
  for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".page")) p.classList.toggle("active", p.id === `page-${name}`);
  if (name === "runs" || name === "compare" || name === "chat") refreshRuns();
}

// ---- plan
function readForm() {
  const form = {};
  for (const f of FIELDS) form[f] = $(`#f-${f}`).value;
  form.overrides = form.overrides.split("\n").map((s) => s.trim()).filter(Boolean);
  return form;
}

function writeForm(form) {
  for (const f of FIELDS) {
    const el = $(`#f-${f}`);
    const value = f === "overrides" ? (form.overrides || []).join("\n") : form[f];
    if (el.tagName === "SELECT" && value !== "" && value != null && ![...el.options].some((o) => o.value === String(value))) {
      el.add(new Option(String(value), String(value)));
    }
    el.value = value == null ? "" : value;
  }
}

async function loadOptions() {
  const o = await api("/api/options");
  fill($("#f-config"), o.configs);
  $("#models").replaceChildren(...o.models.map((m) => new Option(m)));
  fill($("#f-gpu"), ["", ...o.gpus.map((g) => g.name)], ["(none: no memory verdict)", ...o.gpus.map((g) => g.label)]);
  fill($("#f-objective"), o.objectives);
  fill($("#f-method"), o.methods);
  fill($("#f-preset"), o.presets);
  const start = o.configs.includes("configs/demo.yaml") ? "configs/demo.yaml" : o.configs[0];
  if (start) await loadConfig(start);
}

async function loadConfig(config) {
  const seq = ++planSeq;
  const plan = await api(`/api/form?config=${encodeURIComponent(config)}`);
  if (seq !== planSeq) return;
  writeForm(plan.form || { config });
  renderPlan(plan);
}

async function replan() {
  const seq = ++planSeq;
  const plan = await api("/api/plan", readForm());
  if (seq === planSeq) renderPlan(plan);
}

let timer = null;
function replanSoon() { clearTimeout(timer); timer = setTimeout(replan, 250); }
for (const f of FIELDS) {
  const el = $(`#f-${f}`);
  if (f === "config") el.addEventListener("change", () => loadConfig(el.value));
  else el.addEventListener("input", replanSoon);
}

function showProblems(problems) {
  for (const f of [...FIELDS, "launch"]) text($(`#e-${f}`), "");
  for (const [field, paragraphs] of Object.entries(problems || {})) {
    const el = $(`#e-${field}`) || $("#e-overrides");
    text(el, paragraphs.join("\n\n"));
  }
}

function renderPlan(plan) {
  lastPlan = plan;
  showProblems(plan.problems);
  const verdict = $("#verdict");
  if (plan.error) {
    verdict.className = "verdict error";
    text(verdict, "The command line would refuse this plan: see the paragraph beside the field it names.");
    return;
  }
  const m = plan.report.memory, b = plan.report.batch;
  const fits = m.verdict === "fits";
  verdict.className = `verdict ${m.gpu ? (fits ? "fits" : "nofit") : ""}`;
  text(verdict, m.gpu
    ? `${m.verdict}: ${m.total_gib.toFixed(2)} GiB of ${m.gpu.limit_gib.toFixed(2)} GiB usable on ${m.gpu.name} (each of ${plan.report.world_size} rank(s))`
    : `${m.total_gib.toFixed(2)} GiB per rank (pick a GPU for a verdict)`);
  renderBars(plan.bars);
  renderBatch(b, plan.report);
  renderRemedies(m.remedies || []);
  text($("#commands"), `${plan.commands.plan}\n${plan.commands.launch}`);
  text($("#engine"), JSON.stringify(plan.report.engine_config, null, 2));
  $("#notes").replaceChildren(...plan.report.notes.map((n) => { const p = document.createElement("p"); p.className = "hint"; p.textContent = `Note: ${n}`; return p; }));
}

function renderBars(bars) {
  const full = bars.card_gib || bars.total_gib;
  const bar = document.createElement("div");
  bar.className = "bar";
  bar.id = "memory-bar";
  const legend = document.createElement("div");
  legend.className = "legend";
  const parts = [...bars.segments];
  if (bars.headroom != null) parts.push({ name: "headroom", gib: bars.headroom, lines: ["left under the card's usable limit"] });
  for (const s of parts) {
    if (s.gib <= 0) continue;
    const d = document.createElement("div");
    d.style.width = `${(100 * s.gib / Math.max(full, bars.total_gib)).toFixed(2)}%`;
    d.style.background = SEGMENT_COLOURS[s.name];
    d.title = `${s.name}: ${s.gib.toFixed(2)} GiB\n${s.lines.join("\n")}`;
    d.dataset.segment = s.name;
    d.dataset.gib = s.gib;
    bar.appendChild(d);
    const l = document.createElement("span");
    l.innerHTML = `<i style="background:${SEGMENT_COLOURS[s.name]}"></i>`;
    l.append(`${s.name} ${s.gib.toFixed(2)} GiB`);
    legend.appendChild(l);
  }
  $("#bars").replaceChildren(bar, legend);
}

function renderBatch(b, report) {
  const rows = [["split", b.formula], ["global batch", `${b.global_batch_size} ${b.samples}`], ["micro-batch", b.micro_batch_size],
    ["accumulation steps", b.grad_accum_steps], ["data-parallel ranks", b.dp_size], ["tokens / step (max)", b.max_tokens_per_optimizer_step],
    ["engine", report.preset || report.strategy], ["run folder", report.run_dir], ["LR schedule", report.schedule]];
  $("#batch").replaceChildren(...rows.map(([k, v]) => { const tr = document.createElement("tr"); tr.innerHTML = "<td></td><td></td>"; tr.cells[0].textContent = k; tr.cells[1].textContent = v; return tr; }));
}

function renderRemedies(remedies) {
  $("#remedies-box").style.display = remedies.length ? "" : "none";
  $("#remedies").replaceChildren(...remedies.map((r, i) => {
    const div = document.createElement("div");
    div.className = "remedy";
    const title = document.createElement("b");
    title.textContent = `${r.remedy}: ${r.total_gib.toFixed(2)} GiB (${r.verdict})`;
    const how = document.createElement("code");
    how.textContent = r.how;
    const cost = document.createElement("div");
    cost.className = "hint";
    cost.textContent = r.cost;
    const button = document.createElement("button");
    button.textContent = "Apply";
    button.className = "apply-remedy";
    button.id = `remedy-${i}`;
    button.addEventListener("click", () => applyRemedy(r.how));
    div.append(title, document.createElement("br"), how, cost, button);
    return div;
  }));
}

async function applyRemedy(how) {
  const seq = ++planSeq;
  const plan = await api("/api/remedy", { form: readForm(), how });
  if (seq !== planSeq) return;
  writeForm(plan.form);
  renderPlan(plan);
}

$("#launch").addEventListener("click", async () => {
  $("#launch").disabled = true;
  const answer = await api("/api/launch", readForm());
  $("#launch").disabled = false;
  if (answer.error) {
    showProblems(answer.problems);
    text($("#e-launch"), answer.error);
    return;
  }
  showTab("runs");
  watch(answer.job.run);
});

// ---- runs: launch queue and watch
async function refreshRuns() {
  const data = await api("/api/runs");
  if (!data.runs) return;
  const head = document.createElement("tr");
  head.innerHTML = "<th>run</th><th>state</th><th>step</th><th></th>";
  $("#runs").replaceChildren(head, ...data.runs.map((r) => {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td><td></td><td></td>";
    tr.cells[0].textContent = r.run;
    tr.cells[1].textContent = r.state + (r.job && r.state === "running" ? ` (${r.job.devices})` : "");
    tr.cells[1].className = `state-${r.state}`;
    tr.cells[2].textContent = r.max_steps ? `${r.step}/${r.max_steps}` : r.step;
    const button = document.createElement("button");
    button.textContent = "Watch";
    button.addEventListener("click", () => watch(r.run));
    tr.cells[3].appendChild(button);
    return tr;
  }));
  const withMetrics = data.runs.filter((r) => r.has_metrics).map((r) => r.run);
  renderComparePicks(withMetrics);
  renderChatModels(data.runs.map((r) => r.run));
  if (watching) renderWatchActions(data.runs.find((r) => r.run === watching));
}

function renderWatchActions(run) {
  const box = $("#watch-actions");
  box.replaceChildren();
  if (!run) return;
  const stop = document.createElement("button");
  stop.id = "stop";
  stop.textContent = "Stop (checkpoint, then exit)";
  stop.disabled = !(run.job && run.state === "running");
  stop.addEventListener("click", async () => { await api("/api/stop", { job: run.job.id }); refreshRuns(); });
  const resume = document.createElement("button");
  resume.id = "resume";
  resume.textContent = "Resume";
  resume.disabled = ["running", "queued", "stopping"].includes(run.state);
  resume.addEventListener("click", async () => {
    const answer = await api("/api/resume", { run: run.run });
    text($("#progress-text"), answer.error || `resuming (job ${answer.id})`);
    refreshRuns();
  });
  box.append(stop, resume);
}

function watch(run) {
  watching = run;
  rowsSeen = [];
  text($("#watch-title"), run);
  $("#completions").replaceChildren();
  drawCharts();
  if (source) source.close();
  source = new EventSource(`/api/events?run=${encodeURIComponent(run)}`);
  source.addEventListener("rows", (e) => { rowsSeen = rowsSeen.concat(JSON.parse(e.data)); drawCharts(); });
  source.addEventListener("reset", (e) => { rowsSeen = JSON.parse(e.data); drawCharts(); });
  source.addEventListener("status", (e) => showStatus(JSON.parse(e.data)));
  source.addEventListener("completions", (e) => showCompletions(JSON.parse(e.data)));
  refreshRuns();
}

let judgedBy = [["loss", "loss"]], cardGib = null;
function showStatus(s) {
  judgedBy = s.judged_by;
  cardGib = s.card_gib;
  const pct = s.max_steps ? Math.min(100, (100 * s.step) / s.max_steps) : 0;
  $("#progress-bar").style.width = `${pct}%`;
  const eta = s.eta_s != null ? `, about ${Math.round(s.eta_s)} s left` : "";
  text($("#progress-text"), `${s.state}: step ${s.step}${s.max_steps ? ` of ${s.max_steps}` : ""}${eta}`);
  $("#progress-text").dataset.state = s.state;
  drawCharts();
  refreshRuns();
}

function series(key) {
  return rowsSeen.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
}

function drawCharts() {
  const [key, words] = judgedBy[0];
  text($("#chart-main-title"), words);
  lineChart($("#chart-main"), [{ name: words, points: series(key) }]);
  $("#chart-main").dataset.points = series(key).length;
  lineChart($("#chart-lr"), [{ name: "lr", points: series("lr") }]);
  lineChart($("#chart-tps"), [{ name: "tokens/s", points: series("tokens_per_s") }]);
  const rankKeys = [...new Set(rowsSeen.flatMap((r) => Object.keys(r)).filter((k) => /^mem\/rank\d+\/peak_gib$/.test(k)))];
  lineChart($("#chart-mem"), rankKeys.map((k) => ({ name: k.split("/")[1], points: series(k) })), { limit: cardGib });
}

function showCompletions(items) {
  for (const c of items) {
    const pre = document.createElement("pre");
    pre.textContent = JSON.stringify(c, null, 1);
    $("#completions").prepend(pre);
  }
}

setInterval(async () => {
  if (!watching || !$("#page-runs").classList.contains("active")) return;
  const log = await api(`/api/log?run=${encodeURIComponent(watching)}`);
  if (log.log != null) { text($("#log"), log.log); $("#log").scrollTop = 1e9; }
}, 1500);

// ---- compare
function renderComparePicks(runs) {
  const checked = new Set([...document.querySelectorAll("#compare-picks input:checked")].map((i) => i.value));
  $("#compare-picks").replaceChildren(...runs.map((r) => {
    const label = document.createElement("label");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.value = r;
    box.checked = checked.has(r);
    box.style.width = "auto";
    label.append(box, ` ${r}`);
    label.style.display = "block";
    return label;
  }));
}

function table(el, head, rows) {
  const tr = document.createElement("tr");
  for (const h of head) { const th = document.createElement("th"); th.textContent = h; tr.appendChild(th); }
  el.replaceChildren(tr, ...rows.map((cells) => {
    const row = document.createElement("tr");
    for (const c of cells) { const td = document.createElement("td"); td.textContent = c; row.appendChild(td); }
    return row;
  }));
}

$("#compare-go").addEventListener("click", async () => {
  const runs = [...document.querySelectorAll("#compare-picks input:checked")].map((i) => i.value);
  const report = await api("/api/compare", { runs });
  text($("#e-compare"), report.error || "");
  if (report.error) return;
  const labels = report.runs.map((r) => r.label);
  table($("#compare-outcome"), ["", ...labels], Object.entries(report.outcome).map(([k, v]) => [k, ...v]));
  const diffs = Object.entries(report.config_differences);
  table($("#compare-config"), ["key", ...labels], diffs.length ? diffs.map(([k, v]) => [k, ...v]) : [["(no differences)"]]);
  $("#compare-plots").replaceChildren(...Object.keys(report.plots).map((p) => {
    const img = document.createElement("img");
    img.src = `/api/file?path=${encodeURIComponent(p)}`;
    img.alt = p;
    return img;
  }));
});

// ---- chat and export
function renderChatModels(runs) {
  $("#chat-models").replaceChildren(...[...runs, "tiny-llama", "smollm2-135m-instruct"].map((m) => new Option(m)));
  const select = $("#export-run");
  const current = select.value;
  fill(select, runs);
  if (runs.includes(current)) select.value = current;
}

$("#chat-send").addEventListener("click", async () => {
  text($("#e-chat"), "");
  const prompt = $("#chat-prompt").value;
  const settings = { prompt, image: $("#chat-image").value.trim(), max_new_tokens: Number($("#chat-tokens").value), temperature: Number($("#chat-temp").value) };
  $("#chat-send").disabled = true;
  await Promise.all(["a", "b"].map(async (pane) => {
    const model = $(`#chat-model-${pane}`).value.trim();
    if (!model) return;
    text($(`#chat-out-${pane}`), "generating...");
    const answer = await api("/api/chat", { ...settings, model });
    text($(`#chat-out-${pane}`), answer.error ? "" : answer.text);
    if (answer.error) text($("#e-chat"), answer.error);
    $(`#chat-out-${pane}`).dataset.done = "1";
  }));
  $("#chat-send").disabled = false;
});

for (const button of document.querySelectorAll("button.export")) {
  button.addEventListener("click", async () => {
    const answer = await api("/api/export", { run: $("#export-run").value, kind: button.dataset.kind });
    text($("#e-export"), answer.error || "");
    refreshExports();
  });
}

async function refreshExports() {
  const list = await api("/api/exports");
  if (!Array.isArray(list)) return;
  $("#exports").replaceChildren(...list.map((e) => {
    const pre = document.createElement("pre");
    pre.textContent = `${e.kind} of ${e.run} -> ${e.out}: ${e.state}\n${e.log}`;
    return pre;
  }));
  if (list.some((e) => e.state === "running")) setTimeout(refreshExports, 1500);
}

setInterval(() => { if ($("#page-runs").classList.contains("active")) refreshRuns(); }, 3000);
loadOptions();
