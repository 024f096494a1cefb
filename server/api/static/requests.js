// What each tab sends: one request object per tab, read from its form. The page sends it, the API panel
// prints it as curl / Python / cog, and a shared link carries the form fields it is made from.

import { $ } from "./api.js";

export const served = { models: [] }; // GET /models' data, once loaded
// the chat view's turns so far ({role, content}, an assistant's tool_calls), and the call the next message answers
export const conversation = { messages: [], pendingCall: null };

/** Each tab's inputs: the key in a shared link -> the form element's id. */
export const FIELDS = {
  complete: {
    model: "gen-model", prompt: "prompt", temperature: "temperature", top_k: "top_k", top_p: "top_p",
    max_new_tokens: "max_new_tokens", eos_bias: "eos_bias", eos_bias_decay: "eos_bias_decay", seed: "seed",
    constrain: "constrain", constraint: "constraint", steer: "steer", steer_layer: "steer-layer",
    steer_scale: "steer-scale", steer_positive: "steer-positive", steer_negative: "steer-negative",
  },
  fillmask: { text: "mask-text", top_k: "mask-topk" },
  attention: { model: "att-model", layer: "att-layer", head: "att-head", text: "att-text" },
  inside: {
    model: "in-model", view: "in-view", text: "in-text", heads: "in-heads", corrupt: "in-corrupt", answer: "in-answer",
    foil: "in-foil",
  },
  card: { model: "card-model" },
};

const num = (id) => Number($(id).value);

/** Whether the selected completion model has a chat template (GET /models: tasks has "chat"). */
export function chatModel() {
  const m = served.models.find((x) => x.id === $("gen-model").value);
  return Boolean(m && m.tasks.includes("chat"));
}

/** The Completion tab's request: a chat turn in the chat view, a TGI completion otherwise. */
export function completeRequest() {
  return $("chat-mode").checked && chatModel() ? chatRequest() : completionRequest();
}

export const CONTRAST_VECTOR = "page-contrast"; // the name the page keeps its two prompts' vector under

/** The Steer row's `steer` field: the two prompts' vector (made first: steeringVectorRequest) at its block, or a
 * named vector of the model (every block it has); null for nothing. */
export function steerField() {
  const chosen = $("steer").value;
  if (!chosen) return null;
  if (chosen === "contrast") return [{ name: CONTRAST_VECTOR, scale: num("steer-scale") }];
  return [{ name: chosen, scale: num("steer-scale") }];
}

/** POST /inspect/steering-vector for the two prompts, at the chosen block, kept under CONTRAST_VECTOR. */
export function steeringVectorRequest() {
  const layer = num("steer-layer");
  const pairs = [{ positive: $("steer-positive").value, negative: $("steer-negative").value }];
  return { path: "/inspect/steering-vector",
    body: { model: $("gen-model").value, pairs, layers: [layer, layer], name: CONTRAST_VECTOR } };
}

/** The sliders' sampling fields both APIs share: top-k and top-p when sampling, the EOS bias, its decay, the seed,
 * and the steer. */
function samplingFields(temperature) {
  const f = {};
  const steer = steerField();
  if (steer) f.steer = steer;
  if (temperature > 0) {
    if (num("top_k") > 0) f.top_k = num("top_k");
    if (num("top_p") < 1) f.top_p = num("top_p");
  }
  f.eos_bias = num("eos_bias");
  if (num("eos_bias_decay") < 1) f.eos_bias_decay = num("eos_bias_decay");
  if ($("seed").value !== "") f.seed = num("seed");
  return f;
}

/** POST /v1/chat/completions' body (OpenAI's): the conversation so far and the message typed; the page
 * streams the same body with `stream: true`. */
export function chatRequest() {
  const temperature = num("temperature");
  const call = conversation.pendingCall;
  const typed = call ? { role: "tool", tool_call_id: call.id, content: $("prompt").value }
    : { role: "user", content: $("prompt").value };
  const messages = [...conversation.messages, typed];
  const body = { model: $("gen-model").value, messages, max_tokens: num("max_new_tokens"), temperature,
    ...samplingFields(temperature) };
  const tools = $("chat-tools").value.trim();
  if (tools) { // sent as typed: a list that is not JSON is the server's 4xx to show
    try { body.tools = JSON.parse(tools); } catch { body.tools = tools; }
    body.tool_choice = $("tool-choice").value;
    body.parallel_tool_calls = false; // the page answers one call at a time
  }
  const grammar = grammarField();
  if (grammar && grammar.type === "json") {
    body.response_format = { type: "json_schema", json_schema: { name: "constrain", schema: grammar.value } };
  } else if (grammar) body.structured_outputs = { regex: grammar.value };
  return { path: "/v1/chat/completions", body };
}

/** POST /generate's body (TGI format); the page streams the same body from /generate_stream. */
export function completionRequest() {
  const temperature = num("temperature");
  const p = { model: $("gen-model").value, max_new_tokens: num("max_new_tokens"), do_sample: temperature > 0 };
  if (temperature > 0) p.temperature = temperature;
  Object.assign(p, samplingFields(temperature));
  const grammar = grammarField();
  if (grammar) p.grammar = grammar;
  return { path: "/generate", body: { inputs: $("prompt").value, parameters: p } };
}

const regexEscape = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");

/** TGI's `grammar` for the Constrain field: a JSON schema (sent as typed when it is not JSON: the API names
 * the field), a regex, or "one of" the lines as a regex alternation. */
function grammarField() {
  const kind = $("constrain").value;
  const text = $("constraint").value;
  if (!kind) return null;
  if (kind === "regex") return { type: "regex", value: text };
  if (kind === "choices") {
    const lines = text.split("\n").map((l) => l.trim()).filter(Boolean);
    return { type: "regex", value: `(?:${lines.map(regexEscape).join("|")})` };
  }
  try {
    return { type: "json", value: JSON.parse(text) };
  } catch (_) {
    return { type: "json", value: text };
  }
}

/** POST /fill-mask: both EsperBERTo variants side by side when both are served. */
export function fillMaskRequest() {
  const variants = new Set(served.models.filter((m) => m.kind === "mlm").map((m) => m.attention));
  const variant = variants.size > 1 ? "both" : [...variants][0] || "both";
  return { path: "/fill-mask", body: { inputs: $("mask-text").value, variant, top_k: num("mask-topk") } };
}

/** POST /attention: every head of the selected layer (the grid); the head selector picks the big one. */
export function attentionRequest() {
  return { path: "/attention", body: { model: $("att-model").value, text: $("att-text").value, layers: [num("att-layer")] } };
}

/** "each", or the [[layer, head], ...] typed (sent as typed when it is not JSON: the API names the field). */
function headsField() {
  const text = $("in-heads").value.trim();
  if (text === "each") return "each";
  try {
    return JSON.parse(text);
  } catch (_) {
    return text;
  }
}

/** POST /inspect/logit-lens, /inspect/ablate or /inspect/patch, by the view chosen. */
export function insideRequest() {
  const model = $("in-model").value;
  const text = $("in-text").value;
  const view = $("in-view").value;
  if (view === "ablate") return { path: "/inspect/ablate", body: { model, text, heads: headsField() } };
  if (view === "patch") {
    const body = { model, clean: text, corrupt: $("in-corrupt").value, answer: $("in-answer").value, foil: $("in-foil").value };
    return { path: "/inspect/patch", body };
  }
  return { path: "/inspect/logit-lens", body: { model, text } };
}

/** GET /models/{id}: the selected model's summary, configuration and card. */
export function cardRequest() {
  return { path: `/models/${encodeURIComponent($("card-model").value)}`, body: null };
}

export const REQUESTS = {
  complete: completeRequest, fillmask: fillMaskRequest, attention: attentionRequest, inside: insideRequest, card: cardRequest,
};

/** The first completion model: what POST / and /generate use when a request names none. */
export function defaultCompletionModel() {
  const m = served.models.find((x) => x.kind === "causal");
  return m ? m.id : null;
}
