// The demo page: plain browser modules against the public HTTP API (no build step, no CDN).

import { $, get, post, showError, token } from "./api.js";
import { drawHeadGrid, drawHeatmap } from "./attention.js";
import { showCard } from "./card.js";
import { drawAblated, drawEachHead, drawLens, drawPatch } from "./inside.js";
import { clearConversation, generate, showChatView, stopGeneration } from "./complete.js";
import { CONTRAST_VECTOR, REQUESTS, defaultCompletionModel, served } from "./requests.js";
import { applyState, linkFor, readState, stateOf } from "./share.js";
import { snippets } from "./snippets.js";

let layerView = null; // the last POST /attention answer: every head of one layer
let defaultEosBias = 0; // GET /info's, for the InferenceClient snippet
// a shared link opens once the models load (after the token, on a protected server), unless a run came first; the
// link is the address the page was opened at (each run rewrites the address to its own state)
const openedAt = location.hash;
let linkOpened = false;
let modelLoads = 0; // only the latest load of the model list reports (an earlier one, without the token, may end later)

const currentTab = () => document.querySelector("nav .tab.active").dataset.tab;

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
  served.models = (await (await get("/models")).json()).data;
  const fill = (select, list) => {
    const chosen = select.value;
    select.replaceChildren(...list.map((m) => new Option(`${m.id} (${describe(m)})`, m.id)));
    if (list.some((m) => m.id === chosen)) select.value = chosen;
  };
  fill($("gen-model"), served.models.filter((m) => m.kind === "causal"));
  showChatView();
  loadVectors();
  fill($("att-model"), served.models);
  fill($("in-model"), served.models);
  fill($("card-model"), served.models);
  updateLayerHead();
  try {
    defaultEosBias = (await (await get("/info")).json()).default_eos_bias;
  } catch (_) { /* the snippets then assume 0 */ }
  updateApiPanel();
  try {  // the other checkpoints load behind the default one: list them as they arrive
    if (((await (await get("/health")).json()).loading || []).length) setTimeout(loadModels, 2000);
  } catch (_) { /* not ready or draining: the lists stay as they are */ }
}

function updateLayerHead() {
  const m = served.models.find((x) => x.id === $("att-model").value);
  const range = (n) => Array.from({ length: n || 0 }, (_, i) => new Option(String(i), String(i)));
  $("att-layer").replaceChildren(...range(m && m.layers));
  const selfHeads = m && m.attention_settings && m.attention_settings.n_relational_head
    ? m.attention_settings.n_head : Infinity;
  $("att-head").replaceChildren(...range(m && m.heads).map((o, i) => {
    if (i >= selfHeads) o.text = `${i} (relational)`;
    return o;
  }));
}

/** The Steer row's inputs for what is chosen: the block and the two prompts for a contrast, the scale for any. */
function showSteer() {
  const chosen = $("steer").value;
  for (const box of document.querySelectorAll(".steer-box")) box.hidden = !chosen;
  $("steer-layer").parentElement.hidden = chosen !== "contrast";
  $("steer-prompts").hidden = chosen !== "contrast";
}

/** The selected model's named vectors as Steer choices (GET /inspect/steering-vectors), its blocks as the range. */
async function loadVectors() {
  const model = served.models.find((m) => m.id === $("gen-model").value);
  const select = $("steer");
  const keep = [...select.options].slice(0, 2);
  const steerable = model && model.kind === "causal" && model.layers > 1;
  select.parentElement.hidden = !steerable;
  if (!steerable) { select.value = ""; showSteer(); return; }
  $("steer-layer").max = String(model.layers - 1);
  let names = [];
  try {
    const listed = await get(`/inspect/steering-vectors?model=${encodeURIComponent(model.id)}`);
    if (listed.ok) names = (await listed.json()).vectors.filter((n) => n !== CONTRAST_VECTOR);
  } catch (_) { /* no vectors listed: the two prompts remain */ }
  const chosen = select.value;
  select.replaceChildren(...keep, ...names.map((n) => new Option(`vector: ${n}`, n)));
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
  showSteer();
}

function bindSliders() {
  for (const out of document.querySelectorAll("output[for]")) {
    const input = $(out.htmlFor.value);
    const show = () => { out.textContent = input.value; };
    input.addEventListener("input", show);
    show();
  }
}

// ---- fill-mask: softmax0 and softmax1 side by side --------------------------------------------

async function fillMask() {
  const target = $("fill-results");
  target.replaceChildren();
  const { results } = await (await post("/fill-mask", REQUESTS.fillmask().body)).json();
  for (const [modelId, result] of Object.entries(results)) {
    const model = served.models.find((m) => m.id === modelId);
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
}

// ---- attention: every head of a layer, one enlarged -------------------------------------------

let ablatedHeads = new Set(); // heads of the layer on screen zeroed in the ablation view

/** Toggle a head of the layer on screen in the ablation and show the next token with and without them. */
async function toggleAblation(head) {
  const data = layerView;
  if (ablatedHeads.has(head)) ablatedHeads.delete(head);
  else ablatedHeads.add(head);
  for (const cell of document.querySelectorAll("#head-grid .head-cell")) {
    cell.classList.toggle("ablated", ablatedHeads.has(Number(cell.dataset.head)));
  }
  $("ablate-result").hidden = ablatedHeads.size === 0;
  if (!ablatedHeads.size) return;
  const heads = [...ablatedHeads].sort((a, b) => a - b).map((h) => [data.layers[0], data.heads[h]]);
  const answer = await (await post("/inspect/ablate", { model: data.model, text: data.text, heads })).json();
  drawAblated($("ablate-lists"), $("ablate-info"), answer, heads);
}

async function showAttention() {
  const request = REQUESTS.attention();
  $("png-link").hidden = true;
  ablatedHeads = new Set();
  $("ablate-result").hidden = true;
  layerView = { ...(await (await post(request.path, request.body)).json()), text: request.body.text };
  await pickHead(Number($("att-head").value));
}

async function pickHead(head) {
  const data = layerView;
  $("att-head").value = String(head);
  const onPick = (h) => ($("ablate-mode").checked ? toggleAblation(h) : pickHead(h)).catch((err) => showError(err.message));
  drawHeadGrid($("head-grid"), data, head, onPick);
  for (const cell of document.querySelectorAll("#head-grid .head-cell")) {
    cell.classList.toggle("ablated", ablatedHeads.has(Number(cell.dataset.head)));
  }
  const layer = data.layers[0];
  drawHeatmap($("heatmap"), $("hover-info"), data.tokens, data.attention[0][0][head]);
  $("hover-info").textContent = `${data.model} (${data.attention_variant}), layer ${layer} head ${head}:`
    + ` mean row sum ${data.row_sums[0][head].toFixed(3)}. Hover a cell or a token.`;
  const link = $("png-link");
  const body = { model: data.model, text: data.text, layers: [layer], heads: [head], format: "png" };
  const png = await (await post("/attention", body)).blob();
  if (link.href) URL.revokeObjectURL(link.href);
  link.href = URL.createObjectURL(png);
  link.hidden = false;
}

// ---- looking inside: logit lens, head ablation, activation patching ----------------------------

/** The form's rows for the view chosen (heads for ablation; corrupt text, answer and foil for patching). */
function showViewFields() {
  const view = $("in-view").value;
  for (const el of document.querySelectorAll(".only-ablate")) el.hidden = view !== "ablate";
  for (const el of document.querySelectorAll(".only-patch")) el.hidden = view !== "patch";
}

async function lookInside() {
  const request = REQUESTS.inside();
  const data = await (await post(request.path, request.body)).json();
  const box = $("inside-result");
  const info = $("inside-info");
  if (request.path.endsWith("logit-lens")) drawLens(box, info, data);
  else if (request.path.endsWith("patch")) drawPatch(box, info, data);
  else if (data.each) {
    drawEachHead(box, info, data, (layer, head) => { // a head of the grid: ablate it alone
      $("in-heads").value = JSON.stringify([[layer, head]]);
      updateApiPanel();
      run("inside");
    });
  } else drawAblated(box, info, data, request.body.heads);
}

// ---- tabs, the API panel, sharing, examples ---------------------------------------------------

const RUN = {
  complete: () => generate().then(updateApiPanel), fillmask: fillMask, attention: showAttention, inside: lookInside,
  card: () => showCard($("card-body"), $("card-model").value),
};

/** Run a tab's request; the URL then holds its inputs, ready to share. */
async function run(tab) {
  linkOpened = true;
  showError("");
  history.replaceState(null, "", `#${stateOf(tab)}`);
  try {
    await RUN[tab]();
  } catch (err) {
    if (tab === "attention") $("png-link").hidden = true;
    showError(err.message);
  }
}

function selectTab(name, showCardNow = true) {
  const modelOf = { complete: "gen-model", attention: "att-model", inside: "in-model" };
  if (name === "card" && modelOf[currentTab()]) $("card-model").value = $(modelOf[currentTab()]).value;
  for (const b of document.querySelectorAll("nav .tab")) {
    b.classList.toggle("active", b.dataset.tab === name);
    b.setAttribute("aria-selected", String(b.dataset.tab === name));
  }
  for (const p of document.querySelectorAll(".panel")) p.classList.toggle("active", p.id === name);
  updateApiPanel();
  if (name === "card" && showCardNow) run("card");
}

function updateApiPanel() {
  const tab = currentTab();
  const ctx = { origin: location.origin, auth: Boolean(token()), defaultModel: defaultCompletionModel(), defaultEosBias };
  const blocks = snippets(tab, REQUESTS[tab](), ctx).map(({ kind, label, text }) => {
    const block = document.createElement("div");
    block.className = "snippet";
    block.dataset.kind = kind;
    const head = document.createElement("div");
    head.className = "snippet-head";
    const title = document.createElement("span");
    title.textContent = label;
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", `Copy the ${label} snippet`);
    copy.addEventListener("click", () => copyText(text, copy));
    const pre = document.createElement("pre");
    pre.textContent = text;
    head.append(title, copy);
    block.append(head, pre);
    return block;
  });
  $("snippets").replaceChildren(...blocks);
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
    button.textContent = "Copied";
  } catch (_) { // no clipboard outside a secure context: the text stays selectable on the page
    button.textContent = "Select and copy";
  }
  setTimeout(() => { button.textContent = button.classList.contains("share") ? "Share" : "Copy"; }, 1500);
}

async function loadExamples() {
  const examples = await (await fetch("/static/examples.json")).json();
  for (const [tab, list] of Object.entries(examples)) {
    const box = $(`examples-${tab}`);
    if (!box) continue;
    box.replaceChildren(...list.map((ex) => {
      const item = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.className = "example";
      button.textContent = ex.title;
      button.addEventListener("click", () => openState(readState(ex.link), true));
      const output = document.createElement("span");
      output.className = "example-output";
      output.textContent = ex.output;
      item.append(button, output);
      return item;
    }));
  }
}

/** Restore a shared state; run it when asked, or when it reproduces (a seeded or greedy completion, any other tab). */
function openState(state, force = false) {
  if (!state) return;
  selectTab(state.tab, false);
  applyState(state, (tab) => {
    if (tab === "attention") updateLayerHead();
    if (tab === "complete") showChatView();
  });
  updateApiPanel();
  const reproduces = state.values.seed !== undefined || Number(state.values.temperature) === 0; // seeded or greedy
  if (force || state.tab !== "complete" || reproduces) run(state.tab);
}

function openLink() {
  if (linkOpened) return;
  linkOpened = true;
  openState(readState(openedAt));
}

function loadModelsThenLink() {
  const load = ++modelLoads;
  loadModels().then(
    () => load === modelLoads && openLink(),
    (err) => load === modelLoads && showError(err.message),
  );
}

document.addEventListener("DOMContentLoaded", () => {
  $("token").value = sessionStorage.getItem("tinyserve-token") || "";
  $("token").addEventListener("change", () => {
    sessionStorage.setItem("tinyserve-token", $("token").value);
    showError("");
    loadModelsThenLink();
  });
  for (const b of document.querySelectorAll("nav .tab")) b.addEventListener("click", () => selectTab(b.dataset.tab));
  bindSliders();
  const forms = [["complete", "complete-form"], ["fillmask", "fillmask-form"], ["attention", "attention-form"],
    ["inside", "inside-form"], ["card", "card-form"]];
  for (const [tab, form] of forms) {
    $(form).addEventListener("submit", (event) => { event.preventDefault(); run(tab); });
    $(form).addEventListener("input", updateApiPanel);
    $(form).addEventListener("change", updateApiPanel);
  }
  $("stop").addEventListener("click", stopGeneration);
  $("att-model").addEventListener("change", updateLayerHead);
  $("gen-model").addEventListener("change", () => { clearConversation(); showChatView(); loadVectors(); updateApiPanel(); });
  $("chat-mode").addEventListener("change", () => { showChatView(); updateApiPanel(); });
  $("chat-clear").addEventListener("click", () => { clearConversation(); updateApiPanel(); });
  $("constrain").addEventListener("change", () => { $("constraint-box").hidden = !$("constrain").value; });
  $("steer").addEventListener("change", showSteer);
  $("constrain").addEventListener("input", () => { $("constraint-box").hidden = !$("constrain").value; });
  $("in-view").addEventListener("change", showViewFields);
  $("in-view").addEventListener("input", showViewFields);
  showViewFields();
  $("att-head").addEventListener("change", () => { // the layer on screen: enlarge another of its heads
    const shown = layerView && layerView.model === $("att-model").value && layerView.text === $("att-text").value
      && String(layerView.layers[0]) === $("att-layer").value;
    if (shown) pickHead(Number($("att-head").value)).catch((err) => showError(err.message));
  });
  $("card-model").addEventListener("change", () => run("card"));
  $("share").addEventListener("click", () => {
    const link = linkFor(currentTab());
    $("share-link").value = link;
    $("share-box").hidden = false;
    history.replaceState(null, "", link);
    copyText(link, $("share"));
  });
  loadExamples().catch((err) => showError(`examples: ${err.message}`));
  loadModelsThenLink();
});
