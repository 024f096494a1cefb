// The demo page: plain browser JavaScript against the public HTTP API (no build step, no CDN).
"use strict";

const $ = (id) => document.getElementById(id);
let models = [];
let generation = null; // AbortController of the running stream

// ---- talking to the API -----------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  const token = $("token").value.trim();
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

/** The API's own message for a failed response: {"error": ...} (ours) or FastAPI's {"detail": ...}. */
async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    if (body.error) return body.error;
    if (body.detail) return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status}: ${text.slice(0, 300)}`;
}

async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// ---- models and controls ----------------------------------------------------------------------

// the attention settings that differ from the standard transformer, e.g. "softmax0, rope positions"
function describe(m) {
  const s = m.attention_settings || {};
  const parts = [m.attention];
  if (s.score && s.score !== "dot") parts.push(`${s.score} scores`);
  if (s.qkv_sharing && s.qkv_sharing !== "none") parts.push(`shared ${s.qkv_sharing.toUpperCase()}`);
  if (s.masking && s.masking !== "causal") parts.push(`${s.masking} mask: leaks the future`);
  if (s.positions && s.positions !== "sinusoidal") parts.push(`${s.positions} positions`);
  if (s.n_relational_head) parts.push(`${s.n_head} self + ${s.n_relational_head} relational heads`);
  return parts.join(", ");
}

async function loadModels() {
  const response = await fetch("/models", { headers: headers() });
  if (!response.ok) throw new Error(await errorMessage(response));
  models = (await response.json()).data;
  const fill = (select, list) => {
    select.replaceChildren(...list.map((m) => new Option(`${m.id} (${describe(m)})`, m.id)));
  };
  fill($("gen-model"), models.filter((m) => m.kind === "gpt"));
  fill($("att-model"), models);
  updateLayerHead();
}

function updateLayerHead() {
  const m = models.find((x) => x.id === $("att-model").value);
  const range = (n) => Array.from({ length: n || 0 }, (_, i) => new Option(String(i), String(i)));
  $("att-layer").replaceChildren(...range(m && m.layers));
  const selfHeads = m && m.attention_settings && m.attention_settings.n_relational_head
    ? m.attention_settings.n_head : Infinity;
  $("att-head").replaceChildren(...range(m && m.heads).map((o, i) => {
    if (i >= selfHeads) o.text = `${i} (relational)`;
    return o;
  }));
}

function bindSliders() {
  for (const out of document.querySelectorAll("output[for]")) {
    const input = $(out.htmlFor.value);
    const show = () => { out.textContent = input.value; };
    input.addEventListener("input", show);
    show();
  }
}

// ---- completion (server-sent events from POST /generate_stream) -------------------------------

function generationParameters() {
  const num = (id) => Number($(id).value);
  const temperature = num("temperature");
  const p = {
    model: $("gen-model").value || null,
    max_new_tokens: num("max_new_tokens"),
    do_sample: temperature > 0,
    eos_bias: num("eos_bias"),
  };
  if (temperature > 0) {
    p.temperature = temperature;
    if (num("top_k") > 0) p.top_k = num("top_k");
    if (num("top_p") < 1) p.top_p = num("top_p");
  }
  if (num("eos_bias_decay") < 1) p.eos_bias_decay = num("eos_bias_decay");
  if ($("seed").value !== "") p.seed = num("seed");
  return p;
}

async function generate(event) {
  event.preventDefault();
  showError("");
  const out = document.querySelector("#completion .generated");
  document.querySelector("#completion .prompt-echo").textContent = $("prompt").value;
  out.textContent = "";
  $("finish-reason").textContent = "…";
  $("gen-count").textContent = "0";
  $("gen-speed").textContent = "";
  generation = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let count = 0;
  try {
    const response = await fetch("/generate_stream", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({ inputs: $("prompt").value, parameters: generationParameters() }),
      signal: generation.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const lines = buffer.split(/\r?\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = JSON.parse(line.slice(5));
        if (data.error) throw new Error(data.error);
        out.textContent += data.token.text;
        count += 1;
        $("gen-count").textContent = String(count);
        if (data.details) $("finish-reason").textContent = data.details.finish_reason;
      }
    }
    const seconds = (performance.now() - start) / 1000;
    $("gen-speed").textContent = `${(count / seconds).toFixed(1)} tokens/s`;
  } catch (err) {
    if (err.name === "AbortError") $("finish-reason").textContent = "stopped";
    else { $("finish-reason").textContent = "error"; showError(err.message); }
  } finally {
    generation = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

// ---- fill-mask: softmax0 and softmax1 side by side --------------------------------------------

async function fillMask(event) {
  event.preventDefault();
  showError("");
  const target = $("fill-results");
  target.replaceChildren();
  try {
    const text = $("mask-text").value;
    const variants = new Set(models.filter((m) => m.kind === "mlm").map((m) => m.attention));
    const variant = variants.size > 1 ? "both" : [...variants][0] || "both"; // "both" when both are served
    const body = { inputs: text, variant, top_k: Number($("mask-topk").value) };
    const { results } = await (await post("/fill-mask", body)).json();
    for (const [modelId, result] of Object.entries(results)) {
      const model = models.find((m) => m.id === modelId);
      const column = document.createElement("div");
      column.className = "candidates";
      column.dataset.model = modelId;
      const title = document.createElement("h3");
      title.textContent = `${modelId} (${model ? model.attention : "?"})`;
      column.append(title);
      const perMask = Array.isArray(result[0]) ? result : [result];
      perMask.forEach((candidates, i) => {
        if (perMask.length > 1) {
          const h = document.createElement("h4");
          h.textContent = `mask ${i + 1}`;
          column.append(h);
        }
        const list = document.createElement("ol");
        for (const c of candidates) {
          const item = document.createElement("li");
          const bar = document.createElement("span");
          bar.className = "bar";
          bar.style.width = `${Math.max(2, c.score * 100)}%`;
          const label = document.createElement("span");
          label.className = "label";
          label.textContent = `${c.token_str.trim()}  ${(c.score * 100).toFixed(1)}%`;
          label.title = c.sequence;
          item.append(bar, label);
          list.append(item);
        }
        column.append(list);
      });
      target.append(column);
    }
  } catch (err) {
    showError(err.message);
  }
}

// ---- attention heatmap ------------------------------------------------------------------------

const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function colour(w) {
  const x = Math.min(1, Math.max(0, w)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const t = x - i;
  const c = VIRIDIS[i].map((v, k) => Math.round(v + t * (VIRIDIS[i + 1][k] - v)));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

function drawHeatmap(tokens, matrix) {
  const grid = $("heatmap");
  grid.style.gridTemplateColumns = `max-content repeat(${tokens.length}, 1.6rem)`;
  const cells = [document.createElement("span")];
  for (const t of tokens) {
    const head = document.createElement("span");
    head.className = "key";
    head.textContent = t;
    cells.push(head);
  }
  matrix.forEach((row, q) => {
    const label = document.createElement("span");
    label.className = "query";
    const nothing = 1 - row.reduce((a, b) => a + b, 0);
    label.textContent = tokens[q];
    label.title = `attends to nothing: ${(nothing * 100).toFixed(1)}%`;
    cells.push(label);
    row.forEach((w, k) => {
      const cell = document.createElement("span");
      cell.className = "cell";
      cell.style.background = colour(w);
      cell.dataset.weight = w.toFixed(4);
      const text = `${JSON.stringify(tokens[q])} → ${JSON.stringify(tokens[k])}: ${w.toFixed(4)}`;
      cell.title = text;
      cell.addEventListener("mouseenter", () => { $("hover-info").textContent = text; });
      cells.push(cell);
    });
  });
  grid.replaceChildren(...cells);
}

async function showAttention(event) {
  event.preventDefault();
  showError("");
  const body = {
    model: $("att-model").value,
    text: $("att-text").value,
    layers: [Number($("att-layer").value)],
    heads: [Number($("att-head").value)],
  };
  const link = $("png-link");
  try {
    const data = await (await post("/attention", body)).json();
    drawHeatmap(data.tokens, data.attention[0][0][0]);
    const sum = data.row_sums[0][0];
    $("hover-info").textContent = `${data.model} (${data.attention_variant}), layer ${body.layers[0]} head ${body.heads[0]}:`
      + ` mean row sum ${sum.toFixed(3)}. Hover a cell to see the weight.`;
    const png = await (await post("/attention", { ...body, format: "png" })).blob();
    if (link.href) URL.revokeObjectURL(link.href);
    link.href = URL.createObjectURL(png);
    link.hidden = false;
  } catch (err) {
    link.hidden = true;
    showError(err.message);
  }
}

// ---- wiring -----------------------------------------------------------------------------------

function selectTab(name) {
  for (const b of document.querySelectorAll("nav .tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === name);
}

document.addEventListener("DOMContentLoaded", () => {
  $("token").value = sessionStorage.getItem("tinyserve-token") || "";
  $("token").addEventListener("change", () => {
    sessionStorage.setItem("tinyserve-token", $("token").value);
    loadModels().then(() => showError(""), (err) => showError(err.message));
  });
  for (const b of document.querySelectorAll("nav .tab")) b.addEventListener("click", () => selectTab(b.dataset.tab));
  bindSliders();
  $("complete-form").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => generation && generation.abort());
  $("fillmask-form").addEventListener("submit", fillMask);
  $("attention-form").addEventListener("submit", showAttention);
  $("att-model").addEventListener("change", updateLayerHead);
  loadModels().catch((err) => showError(err.message));
});
