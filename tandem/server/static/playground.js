// The playground: a chat against this server's /v1/chat/completions, streamed.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  history: [], // the conversation as OpenAI messages (no system prompt: that is a setting)
  controller: null, // the running stream's AbortController
  chat: 0, // bumped by "New chat": a turn that ends after it belongs to no conversation
};

// Chat-completions parameters the openai Python client takes as keywords; anything else
// the extra-body field adds goes in its extra_body.
const OPENAI_KEYWORDS = new Set([
  "model", "messages", "temperature", "top_p", "max_tokens", "max_completion_tokens", "stream",
  "stream_options", "response_format", "tools", "tool_choice", "seed", "stop", "n", "logprobs",
  "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user",
  "parallel_tool_calls", "reasoning_effort",
]);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function parseJson(id, what, want) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
  if (want === "array" && !Array.isArray(value)) throw new Error(`${what} must be a JSON array`);
  if (want === "object" && (value === null || typeof value !== "object" || Array.isArray(value))) {
    throw new Error(`${what} must be a JSON object`);
  }
  return value;
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

// The request body the next Send makes (with ``draft`` as the new user message, if any).
function buildBody(draft) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history);
  if (draft) messages.push({ role: "user", content: draft });
  const body = {
    model: state.model || "default",
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const [key, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"]]) {
    const v = number(id);
    if (v !== undefined) body[key] = v;
  }
  if ($("format").value === "json_schema") {
    const schema = parseJson("schema", "The JSON schema", "object");
    if (schema === undefined) throw new Error("The JSON schema is empty");
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  const tools = parseJson("tools", "Tools", "array");
  if (tools && tools.length) {
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
  const extra = parseJson("extra", "Extra body", "object");
  if (extra) Object.assign(body, extra);
  return body;
}

function settingsError(message) {
  const p = $("settings-error");
  p.textContent = message || "";
  p.hidden = !message;
}

// ---- rendering ---------------------------------------------------------------------------

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function addUser(text) {
  $("empty").hidden = true;
  const div = el("div", "msg user");
  div.append(el("div", "role", "You"), el("div", "content", text));
  $("messages").append(div);
  scrollDown();
}

function addToolResultsView(results) {
  const div = el("div", "msg tool");
  div.append(el("div", "role", "Tool results"));
  for (const r of results) div.append(el("pre", "tool-result", `${r.name}: ${r.content}`));
  $("messages").append(div);
}

// An assistant turn being streamed: reasoning (folded), text, tool calls, usage.
class AssistantView {
  constructor() {
    this.div = el("div", "msg assistant");
    this.div.append(el("div", "role", "Assistant"));
    this.reasoning = el("details", "reasoning");
    this.reasoningSummary = el("summary", null, "Reasoning");
    this.reasoningText = el("div", "reasoning-text");
    this.reasoning.append(this.reasoningSummary, this.reasoningText);
    this.reasoning.hidden = true;
    this.content = el("div", "content streaming");
    this.calls = el("div", "tool-calls");
    this.usage = el("div", "usage");
    this.div.append(this.reasoning, this.content, this.calls, this.usage);
    $("messages").append(this.div);
  }

  update(reasoning, content) {
    if (reasoning) {
      this.reasoning.hidden = false;
      this.reasoningText.textContent = reasoning;
      this.reasoningSummary.textContent = `Reasoning (${reasoning.length} characters)`;
    }
    this.content.textContent = content;
    scrollDown();
  }

  showCalls(calls) {
    this.calls.replaceChildren();
    for (const call of calls) {
      const card = el("div", "tool-call");
      card.dataset.name = call.function.name;
      card.append(el("div", "tool-name", `🔧 ${call.function.name}`));
      let args = call.function.arguments;
      try {
        args = JSON.stringify(JSON.parse(args), null, 2);
      } catch (e) {
        /* shown as streamed */
      }
      card.append(el("pre", "tool-args", args));
      this.calls.append(card);
    }
  }

  askResults(calls) {
    const form = el("div", "tool-results-form");
    const inputs = calls.map((call) => {
      const input = el("textarea", "tool-result-input");
      input.rows = 2;
      input.placeholder = `Result of ${call.function.name} (sent as a tool message)`;
      form.append(input);
      return input;
    });
    const button = el("button", "ghost", "Send tool results");
    button.type = "button";
    button.addEventListener("click", () => {
      form.remove();
      const results = calls.map((call, i) => ({
        role: "tool",
        tool_call_id: call.id,
        name: call.function.name,
        content: inputs[i].value,
      }));
      addToolResultsView(results);
      state.history.push(...results.map(({ name, ...m }) => m));
      runTurn();
    });
    form.append(button);
    this.calls.append(form);
  }

  showJson(content) {
    let parsed;
    try {
      parsed = JSON.parse(content);
    } catch (e) {
      this.content.append(el("div", "badge bad", "not valid JSON"));
      return;
    }
    this.content.replaceChildren(el("pre", "json", JSON.stringify(parsed, null, 2)));
    this.content.append(el("div", "badge good", "valid JSON"));
  }

  error(message) {
    this.div.append(el("div", "error", message));
  }

  done(usage, finish, seconds, chars) {
    this.content.classList.remove("streaming");
    this.div.dataset.finish = finish || "";
    const parts = [];
    if (usage) {
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`${usage.prompt_tokens} prompt tokens (${cached} cached)`);
      parts.push(`${usage.completion_tokens} completion tokens`);
      if (seconds > 0) parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
      this.usage.dataset.prompt = usage.prompt_tokens;
      this.usage.dataset.cached = cached;
      this.usage.dataset.completion = usage.completion_tokens;
    } else if (chars) {
      parts.push(`${chars} characters`);
    }
    if (finish) parts.push(finish === "stopped" ? "stopped" : `finish: ${finish}`);
    this.usage.textContent = parts.join(" · ");
  }
}

// ---- streaming ---------------------------------------------------------------------------

// The data lines of a server-sent-event stream, one string each.
async function* sseData(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

function mergeToolCalls(calls, deltas) {
  for (const d of deltas) {
    if (!calls[d.index]) {
      calls[d.index] = { id: d.id, type: "function", function: { name: "", arguments: "" } };
    }
    const call = calls[d.index];
    if (d.id) call.id = d.id;
    if (d.function && d.function.name) call.function.name += d.function.name;
    if (d.function && d.function.arguments) call.function.arguments += d.function.arguments;
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

async function runTurn() {
  let body;
  try {
    body = buildBody();
  } catch (e) {
    settingsError(e.message);
    return;
  }
  settingsError(null);
  const view = new AssistantView();
  const chat = state.chat;
  const jsonOut = body.response_format && body.response_format.type === "json_schema";
  state.controller = new AbortController();
  setBusy(true);
  let content = "";
  let reasoning = "";
  const calls = [];
  let usage = null;
  let finish = null;
  let first = null;
  try {
    const resp = await Tandem.api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!resp.ok) {
      view.error(await Tandem.errorText(resp));
      finish = "error";
    } else {
      for await (const data of sseData(resp)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          view.error(chunk.error.message || JSON.stringify(chunk.error));
          finish = "error";
          break;
        }
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if (first === null && (d.content || d.reasoning_content || d.tool_calls)) {
            first = performance.now();
          }
          reasoning += d.reasoning_content || "";
          content += d.content || "";
          if (d.tool_calls) {
            mergeToolCalls(calls, d.tool_calls);
            view.showCalls(calls);
          }
          finish = choice.finish_reason || finish;
        }
        view.update(reasoning, content);
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else {
      view.error(`request failed: ${e.message}`);
      finish = "error";
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  const seconds = first === null ? 0 : (performance.now() - first) / 1000;
  view.done(usage, finish, seconds, content.length);
  if (jsonOut && content && finish !== "stopped") view.showJson(content);
  if (chat !== state.chat) return; // "New chat" was pressed while it streamed
  if (finish === "error" && !content && !calls.length) return;
  // An assistant message needs content or tool calls: an empty answer (stopped at once,
  // or all its tokens spent reasoning) goes back as "".
  const message = { role: "assistant", content: calls.length ? content || null : content };
  if (calls.length) message.tool_calls = calls;
  state.history.push(message);
  if (calls.length && finish !== "stopped") view.askResults(calls);
}

function send(event) {
  if (event) event.preventDefault();
  if (state.controller) return;
  const text = $("prompt").value.trim();
  if (!text) return;
  try {
    buildBody(text); // settings errors show before the message is taken
  } catch (e) {
    settingsError(e.message);
    return;
  }
  $("prompt").value = "";
  addUser(text);
  state.history.push({ role: "user", content: text });
  runTurn();
}

// ---- copy as code ------------------------------------------------------------------------

function pyLiteral(v, indent = "") {
  const next = indent + "    ";
  if (v === null || v === undefined) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "number" || typeof v === "string") return JSON.stringify(v);
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return `[\n${v.map((x) => next + pyLiteral(x, next)).join(",\n")},\n${indent}]`;
  }
  const keys = Object.keys(v);
  if (!keys.length) return "{}";
  const items = keys.map((k) => `${next}${JSON.stringify(k)}: ${pyLiteral(v[k], next)}`);
  return `{\n${items.join(",\n")},\n${indent}}`;
}

function shellQuote(s) {
  return `'${s.replace(/'/g, `'"'"'`)}'`;
}

function asCurl(body) {
  const lines = [`curl -N ${location.origin}/v1/chat/completions`, `  -H 'Content-Type: application/json'`];
  if (Tandem.key()) lines.push(`  -H "Authorization: Bearer $TANDEM_API_KEY"`);
  lines.push(`  -d ${shellQuote(JSON.stringify(body, null, 2))}`);
  return lines.join(" \\\n");
}

function asPython(body) {
  const args = [];
  const extra = {};
  for (const [k, v] of Object.entries(body)) {
    if (OPENAI_KEYWORDS.has(k)) args.push(`    ${k}=${pyLiteral(v, "    ")},`);
    else extra[k] = v;
  }
  if (Object.keys(extra).length) args.push(`    extra_body=${pyLiteral(extra, "    ")},`);
  const key = Tandem.key() ? 'os.environ["TANDEM_API_KEY"]' : '"unused"';
  return [
    "import os",
    "",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url="${location.origin}/v1", api_key=${key})`,
    "stream = client.chat.completions.create(",
    ...args,
    ")",
    "for chunk in stream:",
    "    for choice in chunk.choices:",
    '        print(choice.delta.content or "", end="", flush=True)',
    "print()",
  ].join("\n");
}

function showCode(kind) {
  let body;
  try {
    body = buildBody($("prompt").value.trim());
  } catch (e) {
    settingsError(e.message);
    return;
  }
  settingsError(null);
  const text = kind === "curl" ? asCurl(body) : asPython(body);
  $("code-title").textContent =
    kind === "curl" ? "The next request, as curl" : "The next request, with the openai package";
  $("code").textContent = text;
  $("code-note").textContent = Tandem.key()
    ? "Set TANDEM_API_KEY to the server's API key first."
    : "";
  navigator.clipboard?.writeText(text).then(
    () => ($("code-note").textContent += " Copied to the clipboard."),
    () => {},
  );
  $("code-dialog").showModal();
}

// ---- start ---------------------------------------------------------------------------------

async function loadModel() {
  const resp = await Tandem.api("/v1/models");
  if (!resp.ok) {
    $("model-name").textContent = `(models: ${await Tandem.errorText(resp)})`;
    return;
  }
  const body = await resp.json();
  const m = body.data[0];
  state.model = m.id;
  $("model-name").textContent = `${m.id} · context ${m.max_model_len}`;
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) send(e);
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("format").addEventListener("change", () => {
    $("schema-field").hidden = $("format").value !== "json_schema";
  });
  $("clear").addEventListener("click", () => {
    state.chat += 1;
    if (state.controller) state.controller.abort();
    state.history = [];
    $("messages").replaceChildren($("empty"));
    $("empty").hidden = false;
  });
  $("copy-curl").addEventListener("click", () => showCode("curl"));
  $("copy-python").addEventListener("click", () => showCode("python"));
  $("code-copy").addEventListener("click", () => navigator.clipboard?.writeText($("code").textContent));
  loadModel();
});
