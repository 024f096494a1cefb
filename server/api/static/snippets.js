// The API panel's snippets: the request the page would send, as curl, Python and `cog run`.
// Each is printed from the same request object the page sends (requests.js), so what runs in a shell
// is what ran on screen. The token is never printed: snippets read $TINYSERVE_API_TOKEN.

/** A word for a POSIX shell, single-quoted unless it is plainly safe. */
export function shellWord(s) {
  const text = String(s);
  return /^[A-Za-z0-9_./:=@%+,-]+$/.test(text) ? text : `'${text.replace(/'/g, "'\\''")}'`;
}

/** A JSON value as a Python literal (JSON strings are valid Python strings). */
export function pyLiteral(v) {
  if (v === null || v === undefined) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "number") return String(v);
  if (typeof v === "string") return JSON.stringify(v);
  if (Array.isArray(v)) return `[${v.map(pyLiteral).join(", ")}]`;
  return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${pyLiteral(x)}`).join(", ")}}`;
}

function pyCall(head, args) {
  const lines = Object.entries(args).map(([k, v]) => `    ${k}=${pyLiteral(v)},`);
  return `${head}(\n${lines.join("\n")}\n)`;
}

function curl({ path, body }, ctx) {
  const parts = [`curl -s ${shellWord(ctx.origin + path)}`];
  if (ctx.auth) parts.push(`-H "Authorization: Bearer $TINYSERVE_API_TOKEN"`);
  if (body) parts.push("-H 'Content-Type: application/json'", `-d ${shellWord(JSON.stringify(body))}`);
  return parts.join(" \\\n  ");
}

function httpxSnippet({ path, body }, ctx) {
  const args = [`    ${JSON.stringify(ctx.origin + path)},`];
  if (body) args.push(`    json=${pyLiteral(body)},`);
  if (ctx.auth) args.push(`    headers={"Authorization": f"Bearer {os.environ['TINYSERVE_API_TOKEN']}"},`);
  args.push("    timeout=120,");
  return ["import os", "", "import httpx", "", `response = httpx.${body ? "post" : "get"}(`, ...args, ")",
    "response.raise_for_status()", "print(response.json())"].join("\n");
}

/** A call through the openai client, pointed at this server's /v1. */
function openaiCall(ctx, call, args, printed) {
  return [
    "import os", "", "from openai import OpenAI", "",
    `client = OpenAI(base_url=${JSON.stringify(`${ctx.origin}/v1`)}, api_key=os.environ.get("TINYSERVE_API_TOKEN", "none"))`,
    pyCall(call, args), printed,
  ].join("\n");
}

function openaiSnippet({ body }, ctx) {
  const p = body.parameters;
  const args = { model: p.model, prompt: body.inputs, max_tokens: p.max_new_tokens, temperature: p.do_sample ? p.temperature : 0 };
  if (p.top_p !== undefined) args.top_p = p.top_p;
  if (p.seed !== undefined) args.seed = p.seed;
  const extra = {};
  for (const k of ["top_k", "eos_bias", "eos_bias_decay", "steer"]) if (p[k] !== undefined) extra[k] = p[k];
  if (p.grammar) extra.structured_outputs = { [p.grammar.type]: p.grammar.value }; // vLLM's, on /v1
  if (Object.keys(extra).length) args.extra_body = extra; // tinyserve's extensions of the OpenAI format
  return openaiCall(ctx, "completion = client.completions.create", args, "print(completion.choices[0].text)");
}

/** The chat request through the openai client: OpenAI's fields as arguments, tinyserve's in extra_body. */
function openaiChatSnippet({ body }, ctx) {
  const args = {};
  const extra = {};
  for (const [k, v] of Object.entries(body)) {
    if (["top_k", "eos_bias", "eos_bias_decay", "structured_outputs", "steer"].includes(k)) extra[k] = v;
    else args[k] = v;
  }
  if (Object.keys(extra).length) args.extra_body = extra;
  return openaiCall(ctx, "reply = client.chat.completions.create", args, "print(reply.choices[0].message.content)");
}

function inferenceClientSnippet({ body }, ctx) {
  const p = body.parameters;
  const args = { max_new_tokens: p.max_new_tokens, do_sample: p.do_sample };
  for (const k of ["temperature", "top_k", "top_p", "seed", "grammar"]) if (p[k] !== undefined) args[k] = p[k];
  const lost = [];
  if (p.model !== ctx.defaultModel) lost.push(`model=${p.model}`);
  if (p.eos_bias !== ctx.defaultEosBias) lost.push(`eos_bias=${p.eos_bias}`);
  if (p.eos_bias_decay !== undefined) lost.push(`eos_bias_decay=${p.eos_bias_decay}`);
  if (p.steer !== undefined) lost.push("steer");
  const lines = ["import os", "", "from huggingface_hub import InferenceClient", ""];
  if (lost.length) {
    lines.push(`# text_generation() has no argument for ${lost.join(", ")}: this call gets the server's defaults`,
      "# (the first completion model, the default EOS bias); the openai and curl snippets send them.");
  }
  lines.push(`client = InferenceClient(base_url=${JSON.stringify(ctx.origin)}, api_key=os.environ.get("TINYSERVE_API_TOKEN"))`,
    pyCall("text = client.text_generation", { prompt: body.inputs, ...args }), "print(text)");
  return lines.join("\n");
}

/** `cog run` with the packaged model's inputs (predict.py): the same request, run in the Cog image. */
function cogSnippet(tab, { body }) {
  const inputs = [];
  if (tab === "complete" && body.messages) {
    // `prompt` is required by the predictor and ignored beside `messages`
    inputs.push(["prompt", body.messages.at(-1).content], ["messages", JSON.stringify(body.messages)], ["model", body.model], ["max_new_tokens", body.max_tokens],
      ["temperature", body.temperature]);
    for (const k of ["top_k", "top_p", "seed", "eos_bias", "eos_bias_decay"]) if (body[k] !== undefined) inputs.push([k, body[k]]);
    if (body.response_format) inputs.push(["json_schema", JSON.stringify(body.response_format.json_schema.schema)]);
    if (body.structured_outputs) inputs.push(["regex", body.structured_outputs.regex]);
    if (body.tools) inputs.push(["tools", JSON.stringify(body.tools)], ["tool_choice", body.tool_choice]);
    if (body.steer) inputs.push(["steer", JSON.stringify(body.steer)]);
  } else if (tab === "complete") {
    const p = body.parameters;
    inputs.push(["prompt", body.inputs], ["model", p.model], ["max_new_tokens", p.max_new_tokens],
      ["temperature", p.do_sample ? p.temperature : 0]);
    if (p.top_k !== undefined) inputs.push(["top_k", p.top_k]);
    if (p.top_p !== undefined) inputs.push(["top_p", p.top_p]);
    if (p.seed !== undefined) inputs.push(["seed", p.seed]);
    inputs.push(["eos_bias", p.eos_bias]);
    if (p.eos_bias_decay !== undefined) inputs.push(["eos_bias_decay", p.eos_bias_decay]);
    if (p.grammar) {
      const value = typeof p.grammar.value === "string" ? p.grammar.value : JSON.stringify(p.grammar.value);
      inputs.push([p.grammar.type === "json" ? "json_schema" : "regex", value]);
    }
    if (p.steer) inputs.push(["steer", JSON.stringify(p.steer)]);
  } else if (tab === "fillmask") {
    inputs.push(["task", "fill-mask"], ["prompt", body.inputs], ["top_n", body.top_k]);
  } else if (tab === "attention") {
    inputs.push(["task", "attention"], ["prompt", body.text], ["model", body.model], ["layer", body.layers[0]]);
  } else if (tab === "inside" && body.heads !== undefined) {
    const heads = body.heads === "each" ? "each" : JSON.stringify(body.heads);
    inputs.push(["task", "ablate"], ["prompt", body.text], ["model", body.model], ["heads", heads]);
  } else if (tab === "inside" && body.clean !== undefined) {
    inputs.push(["task", "patch"], ["prompt", body.clean], ["model", body.model], ["corrupt", body.corrupt],
      ["answer", body.answer], ["foil", body.foil]);
  } else if (tab === "inside") {
    inputs.push(["task", "logit_lens"], ["prompt", body.text], ["model", body.model]);
  } else {
    return null;
  }
  return ["cog run", ...inputs.map(([k, v]) => `-i ${shellWord(`${k}=${v}`)}`)].join(" \\\n  ");
}

/** [{kind, label, text}] for a tab's request; ctx: {origin, auth, defaultModel, defaultEosBias}. */
export function snippets(tab, request, ctx) {
  const list = [{ kind: "curl", label: "curl", text: curl(request, ctx) }];
  if (tab === "complete" && request.body.messages) {
    list.push({ kind: "openai", label: "Python: openai (/v1/chat/completions)", text: openaiChatSnippet(request, ctx) });
  } else if (tab === "complete") {
    list.push({ kind: "openai", label: "Python: openai (/v1/completions)", text: openaiSnippet(request, ctx) });
    list.push({ kind: "inference-client", label: "Python: huggingface_hub InferenceClient (/generate)",
      text: inferenceClientSnippet(request, ctx) });
  } else {
    list.push({ kind: "httpx", label: "Python: httpx", text: httpxSnippet(request, ctx) });
  }
  const cog = cogSnippet(tab, request);
  if (cog) list.push({ kind: "cog", label: "Cog (the packaged model)", text: cog });
  return list;
}
