// The Completion tab: a prompt completed over server-sent events from POST /generate_stream, or, for a
// model with a chat template, a conversation whose replies stream from POST /v1/chat/completions.

import { $, post } from "./api.js";
import { REQUESTS, chatModel, conversation, steerField, steeringVectorRequest } from "./requests.js";

let generation = null; // AbortController of the running stream

export function stopGeneration() {
  if (generation) generation.abort();
}

/** Each `data:` line's JSON of a server-sent event stream, until it ends or says [DONE]. */
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      if (line.slice(5).trim() === "[DONE]") return;
      const data = JSON.parse(line.slice(5));
      if (data.error) throw new Error(typeof data.error === "string" ? data.error : data.error.message);
      yield data;
    }
  }
}

/** Run one stream, `run(signal, token)`: the Stop button aborts it; token() counts a token on the meta line. */
async function streamed(run) {
  $("finish-reason").textContent = "…";
  $("gen-count").textContent = "0";
  $("gen-speed").textContent = "";
  generation = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let count = 0;
  try {
    await run(generation.signal, () => { count += 1; $("gen-count").textContent = String(count); });
    $("gen-speed").textContent = `${(count / ((performance.now() - start) / 1000)).toFixed(1)} tokens/s`;
  } catch (err) {
    if (err.name === "AbortError") $("finish-reason").textContent = "stopped";
    else { $("finish-reason").textContent = "error"; throw err; }
  } finally {
    generation = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

/** The two prompts' steering vector, made (and kept by name) before a request that names it. */
async function madeSteeringVector() {
  if ($("steer").value !== "contrast") return;
  const { path, body } = steeringVectorRequest();
  const made = await post(path, body);
  if (!made.ok) throw new Error((await made.json()).error);
}

async function complete() {
  const out = document.querySelector("#completion .generated");
  document.querySelector("#completion .prompt-echo").textContent = $("prompt").value;
  out.textContent = "";
  const { body } = REQUESTS.complete();
  const steered = Boolean(steerField());
  $("plain-box").hidden = !steered;
  $("completion-plain").textContent = "";
  await madeSteeringVector();
  await streamed(async (signal, token) => {
    for await (const data of events(await post("/generate_stream", body, signal))) {
      out.textContent += data.token.text;
      token();
      if (data.details) $("finish-reason").textContent = data.details.finish_reason;
    }
  });
  if (steered) { // the same request without its steer, beside it
    const { steer, ...plain } = body.parameters;
    const answer = await (await post("/generate", { ...body, parameters: plain })).json();
    $("completion-plain").textContent = body.inputs + answer.generated_text;
  }
}

function addTurn(role, content) {
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const text = document.createElement("span");
  text.className = "content";
  text.textContent = content;
  turn.append(label, text);
  $("chat-log").append(turn);
  return text;
}

/** The message typed as the user's turn (or as the result of the call it answers), and the model's reply
 * streamed into the conversation; a call the reply makes is shown, and the next message answers it. */
async function chatTurn() {
  const { body } = REQUESTS.complete();
  const message = body.messages[body.messages.length - 1];
  const asked = addTurn(message.role, message.content);
  const reply = addTurn("assistant", "");
  const calls = [];
  $("prompt").value = "";
  await madeSteeringVector();
  const untold = () => { // a failed turn leaves the conversation as it was, the message back in its box
    asked.parentElement.remove();
    reply.parentElement.remove();
    $("prompt").value = message.content;
  };
  await streamed(async (signal, token) => {
    for await (const chunk of events(await post("/v1/chat/completions", { ...body, stream: true }, signal))) {
      const choice = chunk.choices[0];
      if (!choice) continue; // the usage chunk
      if (choice.delta.content) {
        reply.textContent += choice.delta.content;
        token();
      }
      for (const call of choice.delta.tool_calls || []) { // each call comes whole, once it parses
        calls.push({ id: call.id, type: "function", function: call.function });
        const shown = document.createElement("span");
        shown.className = "call";
        shown.textContent = `${call.function.name}(${call.function.arguments})`;
        reply.parentElement.append(shown);
        token();
      }
      if (choice.finish_reason) $("finish-reason").textContent = choice.finish_reason;
    }
  }).catch((err) => { untold(); throw err; });
  const said = { role: "assistant", content: reply.textContent || null };
  conversation.messages.push(message, calls.length ? { ...said, tool_calls: calls } : said);
  conversation.pendingCall = calls[0] || null;
  $("prompt-label").textContent = calls.length ? `Result of ${calls[0].function.name}` : "Message";
}

export function generate() {
  return $("chat-mode").checked && chatModel() ? chatTurn() : complete();
}

/** The chat view for a model with a chat template: its checkbox, the conversation in place of the completion. */
export function showChatView() {
  const can = chatModel();
  $("chat-toggle").hidden = !can;
  const on = can && $("chat-mode").checked;
  $("chat-log").hidden = !on;
  $("chat-clear").hidden = !on;
  $("tools-box").hidden = !on;
  $("completion").hidden = on;
  const call = conversation.pendingCall;
  $("prompt-label").textContent = !on ? "Prompt" : call ? `Result of ${call.function.name}` : "Message";
}

export function clearConversation() {
  conversation.messages = [];
  conversation.pendingCall = null;
  showChatView();
  $("chat-log").replaceChildren();
}
