// The chat page of mlx-trio-server: talks to the server's own OpenAI API.
// State: the conversation (`messages`, kept in localStorage) and one
// AbortController while a reply streams. Everything shown is built with
// textContent (never innerHTML), so model output cannot inject markup.
"use strict";

const STORE = "mlx-trio-chat.";
const SETTINGS = ["system", "temperature", "max-tokens", "api-key", "tools"];
const DEMO_TOOLS = [
  { type: "function", function: {
    name: "get_weather", description: "Get the current weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } } },
  { type: "function", function: {
    name: "get_time", description: "Get the current time in a timezone",
    parameters: { type: "object", properties: { timezone: { type: "string" } },
                  required: ["timezone"] } } },
];

const $ = (id) => document.getElementById(id);
let messages = [];       // {role: user|assistant|tool|error, content, ...}
let controller = null;   // the AbortController of the reply in flight
const views = new Map(); // message -> its <article>

// ---------------------------------------------------------------- storage

function load(key, fallback) {
  try {
    const value = localStorage.getItem(STORE + key);
    return value === null ? fallback : JSON.parse(value);
  } catch {
    return fallback;
  }
}

function store(key, value) {
  try {
    localStorage.setItem(STORE + key, JSON.stringify(value));
  } catch (err) {
    setStatus(`Could not save to this browser's storage: ${err.message}`);
  }
}

const saveConversation = () => store("messages", messages);

// ---------------------------------------------------------------- the API

function headers() {
  const out = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

function describeError(error) {
  if (!error || typeof error !== "object") return String(error);
  const param = error.param ? ` (${error.param})` : "";
  return `${error.message || error.type || "error"}${param}`;
}

async function httpError(response) {
  let detail = response.statusText;
  try {
    detail = describeError((await response.json()).error);
  } catch {
    // not a JSON error body: keep the status text
  }
  return new Error(`HTTP ${response.status}: ${detail}`);
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw await httpError(response);
    const ids = (await response.json()).data.map((card) => card.id);
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    const saved = load("model", "");
    if (ids.includes(saved)) select.value = saved;
  } catch (err) {
    select.replaceChildren(new Option("(server default)", ""));
    addError(`Could not list the models: ${err.message}`);
  }
}

// Server-sent events: one JSON object per `data:` line. Comment lines
// (`: keepalive`, sent while a long prompt is processed) and blank lines are
// skipped; `data: [DONE]` ends the stream.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the stream ended before data: [DONE]");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/\r$/, "");
      buffer = buffer.slice(end + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function requestBody() {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  if ($("model").value) body.model = $("model").value;
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of messages) {
    if (m.role === "user") body.messages.push({ role: "user", content: m.content });
    if (m.role === "tool") {
      body.messages.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
    }
    if (m.role === "assistant" && (m.content || m.tool_calls.length)) {
      const out = { role: "assistant", content: m.content };
      if (m.tool_calls.length) out.tool_calls = m.tool_calls;
      body.messages.push(out);
    }
  }
  for (const [field, id] of [["temperature", "temperature"], ["max_tokens", "max-tokens"]]) {
    const text = $(id).value.trim();
    if (text !== "") body[field] = Number(text); // the server checks ranges and names the field
  }
  const tools = $("tools").value.trim();
  if (tools) {
    try {
      body.tools = JSON.parse(tools);
    } catch (err) {
      throw new Error(`The tools are not valid JSON: ${err.message}`);
    }
  }
  return body;
}

function mergeToolCall(message, delta) {
  const index = delta.index ?? message.tool_calls.length;
  const call = (message.tool_calls[index] ??= {
    id: "", type: "function", function: { name: "", arguments: "" },
  });
  if (delta.id) call.id = delta.id;
  call.function.name += delta.function?.name ?? "";
  call.function.arguments += delta.function?.arguments ?? "";
}

// After a reply: tokens over the whole request (prompt processing included:
// a tool call's tokens arrive in one chunk, so a decode-only rate would lie),
// the prompt tokens the server's prompt cache reused, the time to first token.
function statsText(usage, started, firstToken, ended) {
  if (!usage) return "";
  const tokens = usage.completion_tokens;
  const seconds = (ended - started) / 1000;
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  return [
    `${tokens} tokens in ${seconds.toFixed(2)} s (${(tokens / seconds).toFixed(1)} tokens/s)`,
    `${cached} of ${usage.prompt_tokens} prompt tokens cached`,
    firstToken ? `first token after ${((firstToken - started) / 1000).toFixed(2)} s` : null,
  ].filter(Boolean).join(" · ");
}

async function generate() {
  let body;
  try {
    body = requestBody();
  } catch (err) {
    addError(err.message);
    return;
  }
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], stats: "" };
  controller = new AbortController();
  setBusy(true);
  setStatus("Waiting for the model…");
  const started = performance.now();
  let firstToken = null;
  let usage = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw await httpError(response);
    messages.push(reply);
    paint(reply);
    for await (const chunk of sseData(response)) {
      if (chunk.error) throw new Error(`The server stopped the reply: ${describeError(chunk.error)}`);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      firstToken ??= performance.now();
      reply.reasoning += delta.reasoning ?? delta.reasoning_content ?? "";
      reply.content += delta.content ?? "";
      for (const call of delta.tool_calls ?? []) mergeToolCall(reply, call);
      setStatus("Generating… (Esc or Stop to stop)");
      paint(reply);
    }
    reply.stats = statsText(usage, started, firstToken, performance.now());
    setStatus(reply.stats ? `Done: ${reply.stats}` : "Done.");
  } catch (err) {
    if (err.name === "AbortError") {
      reply.stopped = true;
      setStatus("Stopped.");
    } else {
      addError(err instanceof TypeError ? `Network error: ${err.message}` : err.message);
      setStatus("Failed.");
    }
  } finally {
    controller = null;
    setBusy(false);
    if (messages.includes(reply)) paint(reply);
    saveConversation();
  }
}

function stop() {
  if (controller) controller.abort();
}

// ---------------------------------------------------------------- rendering

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function answered(callId) {
  return messages.some((m) => m.role === "tool" && m.tool_call_id === callId);
}

function toolCard(call, streaming) {
  const card = el("section", "tool-card");
  card.setAttribute("aria-label", `Tool call ${call.function.name}`);
  const title = el("h3", "", "Tool call ");
  title.append(el("code", "", call.function.name));
  card.append(title, el("pre", "tool-args", prettyJson(call.function.arguments)));
  if (!streaming && call.id && !answered(call.id)) card.append(toolResultForm(call));
  return card;
}

function toolResultForm(call) {
  const form = el("form", "tool-result");
  const label = el("label", "", "Result to send back");
  const input = el("input");
  input.name = "result";
  input.placeholder = '{"temperature": 12, "condition": "rainy"}';
  label.append(input);
  const button = el("button", "", "Send result");
  button.type = "submit";
  button.disabled = controller !== null;
  form.append(label, button);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (controller) return;
    messages.push({ role: "tool", tool_call_id: call.id, name: call.function.name,
                    content: input.value.trim() || "{}" });
    repaintAll();
    saveConversation();
    const owner = messages.find((m) => m.role === "assistant" && m.tool_calls.includes(call));
    if (owner.tool_calls.every((c) => answered(c.id))) generate();
  });
  return form;
}

function render(message) {
  const article = el("article", `msg ${message.role}`);
  const who = { user: "You", assistant: "Model", tool: "Tool result", error: "Error" }[message.role];
  article.append(el("h2", "who", who));
  if (message.role === "error") {
    article.setAttribute("role", "alert");
    article.append(el("p", "text", message.content));
    return article;
  }
  if (message.role === "tool") {
    article.append(el("p", "text", `${message.name ?? "tool"} → ${message.content}`));
    return article;
  }
  const streaming = message === messages.at(-1) && controller !== null;
  if (message.reasoning) {
    const details = el("details", "reasoning");
    details.open = Boolean(message.showReasoning); // kept across repaints and reloads
    details.addEventListener("toggle", () => {
      message.showReasoning = details.open;
      saveConversation();
    });
    details.append(el("summary", "", streaming && !message.content ? "Thinking…" : "Reasoning"),
                   el("pre", "", message.reasoning.trim()));
    article.append(details);
  }
  if (message.content || message.role === "user") {
    article.append(el("div", "text", message.role === "user" ? message.content
                                                             : message.content.trim()));
  }
  for (const call of message.tool_calls ?? []) article.append(toolCard(call, streaming));
  if (message.stopped) article.append(el("p", "meta stopped", "Stopped."));
  else if (message.stats) article.append(el("p", "meta stats", message.stats));
  return article;
}

function paint(message) {
  const transcript = $("transcript");
  const nearBottom = transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 80;
  const fresh = render(message);
  const old = views.get(message);
  if (old) old.replaceWith(fresh);
  else transcript.append(fresh);
  views.set(message, fresh);
  if (nearBottom || !old) transcript.scrollTop = transcript.scrollHeight;
}

function repaintAll() {
  views.clear();
  $("transcript").replaceChildren();
  messages.forEach(paint);
}

function addError(text) {
  const message = { role: "error", content: text };
  messages.push(message);
  paint(message);
  saveConversation();
}

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  for (const button of document.querySelectorAll(".tool-result button")) button.disabled = busy;
}

// ---------------------------------------------------------------- wiring

function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  const message = { role: "user", content: text };
  messages.push(message);
  paint(message);
  saveConversation();
  $("prompt").value = "";
  generate();
}

function newChat() {
  stop();
  messages = [];
  saveConversation();
  repaintAll();
  setStatus("New chat.");
  $("prompt").focus();
}

function init() {
  for (const id of SETTINGS) {
    $(id).value = load(id, "");
    $(id).addEventListener("input", () => store(id, $(id).value));
  }
  $("model").addEventListener("change", () => store("model", $("model").value));
  $("tools-preset").addEventListener("click", () => {
    $("tools").value = JSON.stringify(DEMO_TOOLS, null, 2);
    store("tools", $("tools").value);
  });
  $("settings-form").addEventListener("submit", (event) => event.preventDefault());
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && controller) {
      event.preventDefault();
      stop();
    }
  });
  messages = load("messages", []);
  if (!Array.isArray(messages)) messages = [];
  repaintAll();
  loadModels();
  $("prompt").focus();
}

init();
