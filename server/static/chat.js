"use strict";
// The chat page: one conversation kept in the page, each reply streamed from /v1/chat/completions
// (server-sent events read through fetch). The API key the user types is kept in localStorage and
// sent as "Authorization: Bearer"; the page itself needs none.

const KEY_STORE = "strata-desk.api-key";
const HEALTH_POLL_MS = 1000;

const $ = (id) => document.getElementById(id);
const messages = []; // the conversation, sent whole with every request: {role, content}
let controller = null; // aborts the reply being streamed (Stop, New chat)
let chat = 0; // counts "New chat"s: a reply that ends after one belongs to no conversation
let healthTimer = null;

class RequestError extends Error {}

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

// What a refused request says, in the server's words (OpenAI's error shape), with what to do.
async function refusal(resp) {
  let message = "";
  let code = "";
  try {
    const body = await resp.json();
    message = body.error?.message ?? "";
    code = body.error?.code ?? "";
  } catch {
    // not JSON: the status line says enough
  }
  if (resp.status === 401) {
    if (code === "missing_api_key") return "This server needs an API key: type it in the API key field.";
    return "The server refused the API key (" + (message || "invalid API key") + "): check the API key field.";
  }
  if (resp.status === 503) watchHealth();
  return (message || resp.statusText || "the request failed") + " (HTTP " + resp.status + ")";
}

// The header's status dot from the public /health; polled until the model is ready.
async function checkHealth() {
  const status = $("status");
  let ready = false;
  try {
    const resp = await fetch("/health", { cache: "no-store" });
    const health = await resp.json();
    ready = health.status === "ok";
    $("api-key").placeholder = health.api_key ? "this server needs one" : "not needed by this server";
    if (ready) {
      status.textContent = "ready";
      status.className = "status ok";
    } else if (health.status === "loading") {
      status.textContent = "loading the model (" + Math.round(health.elapsed_s ?? 0) + " s)";
      status.className = "status loading";
    } else {
      status.textContent = "error: " + (health.error ?? "the engine is down");
      status.className = "status down";
    }
  } catch (err) {
    status.textContent = "cannot reach the server";
    status.className = "status down";
  }
  return ready;
}

function watchHealth() {
  if (healthTimer !== null) return;
  const poll = async () => {
    if (await checkHealth()) {
      healthTimer = null;
      return;
    }
    healthTimer = setTimeout(poll, HEALTH_POLL_MS);
  };
  healthTimer = setTimeout(poll, 0);
}

async function loadModels() {
  const select = $("model");
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: apiHeaders(), cache: "no-store" });
  } catch (err) {
    showError("Cannot reach the server: " + err.message);
    return;
  }
  if (!resp.ok) {
    showError(await refusal(resp));
    return;
  }
  const { data } = await resp.json();
  const chosen = select.value;
  select.replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  if (data.some((m) => m.id === chosen)) select.value = chosen;
  showError("");
}

function setBusy(busy) {
  document.body.dataset.busy = String(busy);
}

// One message's view: the role, an optional reasoning block, the text, a note under it.
function addMessage(role, text) {
  $("empty").hidden = true;
  const root = document.createElement("div");
  root.className = "message " + role;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  root.append(label, content);
  $("conversation").append(root);
  scrollDown();
  return { root, content, reasoning: null };
}

function addReasoning(view) {
  const details = document.createElement("details");
  details.className = "reasoning";
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const text = document.createElement("div");
  text.className = "reasoning-text";
  details.append(summary, text);
  view.root.insertBefore(details, view.content);
  view.reasoning = text;
  return text;
}

function addNote(view, text) {
  const note = document.createElement("div");
  note.className = "note";
  note.textContent = text;
  view.root.append(note);
}

function scrollDown() {
  const main = $("conversation");
  main.scrollTop = main.scrollHeight;
}

// Reads the SSE body; calls onDelta with each chunk's delta; returns the finish reason.
async function readStream(resp, onDelta) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new RequestError("the reply stopped before its end (the server went away?)");
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).replace(/\r$/, "");
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue; // blank separators and ": keepalive" comments
      const data = line.slice(5).trim();
      if (data === "[DONE]") return finish;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new RequestError(chunk.error.message ?? "the engine failed");
      const choice = chunk.choices?.[0];
      if (!choice) continue; // the usage chunk
      onDelta(choice.delta ?? {});
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
}

function requestBody() {
  const body = { messages, stream: true };
  const model = $("model").value;
  if (model) body.model = model;
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return JSON.stringify(body);
}

async function send(text) {
  const mine = chat;
  showError("");
  messages.push({ role: "user", content: text });
  const asked = addMessage("user", text);
  const view = addMessage("assistant", "");
  view.root.dataset.state = "streaming";
  const reply = { content: "", reasoning: "" };
  controller = new AbortController();
  setBusy(true);
  let state = "done";
  let note = "";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: requestBody(), signal: controller.signal,
    });
    if (!resp.ok) throw new RequestError(await refusal(resp));
    const finish = await readStream(resp, (delta) => {
      if (delta.reasoning_content) {
        reply.reasoning += delta.reasoning_content;
        (view.reasoning ?? addReasoning(view)).textContent = reply.reasoning;
      }
      if (delta.content) {
        reply.content += delta.content;
        view.content.textContent = reply.content;
      }
      scrollDown();
    });
    if (finish === "length") note = "cut at the max tokens limit";
  } catch (err) {
    if (err.name === "AbortError") {
      state = "stopped";
      note = "stopped";
    } else {
      state = "error";
      if (err instanceof RequestError) showError(err.message);
      else if (err instanceof TypeError) showError("Cannot reach the server: " + err.message);
      else showError("The reply could not be read: " + err.message);
    }
  } finally {
    controller = null;
    setBusy(false);
  }
  if (chat !== mine) return;
  if (!reply.content && !reply.reasoning && state !== "done") {
    // nothing came back: take the question back into the box, to send again
    messages.pop();
    asked.root.remove();
    view.root.remove();
    $("empty").hidden = messages.length > 0;
    $("prompt").value = text;
  } else {
    messages.push({ role: "assistant", content: reply.content });
    if (state === "error") note = "the reply broke off";
    if (note) addNote(view, note);
    view.root.dataset.state = state;
  }
  $("prompt").focus();
}

function newChat() {
  controller?.abort();
  chat += 1;
  messages.length = 0;
  $("conversation").querySelectorAll(".message").forEach((m) => m.remove());
  $("empty").hidden = false;
  showError("");
  $("prompt").focus();
}

function submit() {
  const text = $("prompt").value.trim();
  if (!text || controller !== null) return;
  $("prompt").value = "";
  send(text);
}

function start() {
  const key = $("api-key");
  key.value = localStorage.getItem(KEY_STORE) ?? "";
  key.addEventListener("change", () => {
    localStorage.setItem(KEY_STORE, key.value.trim());
    loadModels();
  });
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  $("stop").addEventListener("click", () => controller?.abort());
  $("new-chat").addEventListener("click", newChat);
  watchHealth();
  loadModels();
  $("prompt").focus();
}

start();
