// The chat page: a client of /v1/models and /v1/chat/completions like any other, so it works
// straight to the server and through the proxy (with a token) alike. No framework, no build step.
"use strict";

// sessionStorage, not localStorage: the token goes away with the tab.
const TOKEN_KEY = "inference-server.token";
// fetch's statusText is empty over HTTP/2 and on some proxies: name the statuses the API answers ourselves.
const REASONS = {
  400: "Bad request",
  401: "Unauthorized",
  404: "Not found",
  405: "Method not allowed",
  413: "Request too large",
  502: "Bad gateway",
  503: "Service unavailable",
  504: "Gateway timeout",
};
// The sampling controls, by their element id, which is also the API's field name.
const SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "max_tokens"];

const $ = (id) => document.getElementById(id);

const state = {
  messages: [], // the conversation as the API takes it: {role, content}
  model: null, // the served model's id, from /v1/models
  controller: null, // the AbortController of the answer under way
};

/** An error whose message is already fit to show. */
class ReadableError extends Error {}

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const token = $("token").value.trim();
  if (token) headers.Authorization = `Bearer ${token}`;
  return headers;
}

/** The server's own message from an error response, whichever shape it has (native, OpenAI, proxy). */
async function responseError(response) {
  const text = await response.text();
  let message;
  try {
    const body = JSON.parse(text);
    message = body?.error?.message ?? body?.message;
  } catch {
    message = text.trim().slice(0, 300);
  }
  const reason = REASONS[response.status] || response.statusText || "Error";
  let line = `${response.status} ${reason}: ${message || "no details"}`;
  if (response.status === 401) line += "\nSet a valid token in the Token field.";
  const retryAfter = response.headers.get("Retry-After");
  if (response.status === 503 && retryAfter) line += `\nTry again in ${retryAfter} s.`;
  return new ReadableError(line);
}

function readable(error) {
  if (error instanceof ReadableError) return error.message;
  if (error instanceof TypeError) return `Cannot reach the server: ${error.message}`; // fetch's network error
  return String(error);
}

async function fetchModel() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: requestHeaders() });
  } catch (error) {
    throw new ReadableError(readable(error));
  }
  if (!response.ok) throw await responseError(response);
  const body = await response.json();
  return body.data[0].id;
}

/** Loads the model's name into the header, or shows why it cannot (a 401 through the proxy, say). */
async function showModel() {
  const label = $("model");
  state.model = null;
  try {
    state.model = await fetchModel();
    label.textContent = state.model;
    label.classList.remove("error");
  } catch (error) {
    label.textContent = readable(error);
    label.classList.add("error");
  }
  return state.model;
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text; // text, never HTML: the model's output is not trusted markup
  element.append(label, body);
  $("conversation").append(element);
  scrollDown();
  return element;
}

function scrollDown() {
  const conversation = $("conversation");
  conversation.scrollTop = conversation.scrollHeight;
}

/** One answer on the page: its text as it streams in, its timings and its end. */
class Answer {
  constructor() {
    this.element = addMessage("assistant", "");
    this.element.classList.add("streaming");
    this.text = "";
    this.started = performance.now();
    this.first = null; // when the first text arrived
    this.last = null;
    this.pieces = 0;
    this.usage = null; // the server's count, from the last chunk (stream_options.include_usage)
  }

  append(content) {
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.pieces += 1;
    this.text += content;
    this.element.querySelector(".text").textContent = this.text;
    scrollDown();
  }

  /** Time to first token, and tokens per second from the first token to the last. */
  finish(note) {
    this.element.classList.remove("streaming");
    const parts = [];
    if (this.first !== null) {
      parts.push(`first token ${Math.round(this.first - this.started)} ms`);
      const tokens = this.usage?.completion_tokens ?? this.pieces;
      parts.push(`${tokens} tokens`);
      const seconds = (this.last - this.first) / 1000;
      if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
    }
    if (note) parts.push(note);
    const stats = document.createElement("div");
    stats.className = "stats";
    stats.textContent = parts.join(" · ");
    this.element.append(stats);
  }

  fail(message) {
    this.element.classList.remove("streaming");
    const error = document.createElement("div");
    error.className = "error";
    error.setAttribute("role", "alert");
    error.textContent = message;
    this.element.append(error);
    scrollDown();
  }
}

/** The data of each server-sent event, as it arrives. The server ends every event with a blank line. */
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {}); // already cancelled if the request was aborted
  }
}

function requestBody(model) {
  const body = {
    model,
    messages: state.messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const field of SAMPLING_FIELDS) {
    const value = $(field).value.trim();
    if (value !== "") body[field] = Number(value); // the server checks the ranges and names the field
  }
  return body;
}

async function streamAnswer(answer, signal) {
  const model = state.model ?? (await showModel());
  if (!model) throw new ReadableError($("model").textContent);
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: requestHeaders(),
    body: JSON.stringify(requestBody(model)),
    signal,
  });
  if (!response.ok) throw await responseError(response);
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ReadableError(`The server could not finish the answer: ${chunk.error.message}`);
    if (chunk.usage) answer.usage = chunk.usage;
    const content = chunk.choices?.[0]?.delta?.content;
    if (content) answer.append(content);
  }
  throw new ReadableError("The connection ended before the answer was complete.");
}

function setBusy(controller) {
  state.controller = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt");
  const text = prompt.value;
  if (!text.trim() || state.controller) return;
  prompt.value = "";
  const turns = state.messages; // "New chat" mid-answer swaps in a new one: this answer stays here
  turns.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = new Answer();
  const controller = new AbortController();
  setBusy(controller);
  try {
    await streamAnswer(answer, controller.signal);
    answer.finish();
  } catch (error) {
    if (error.name === "AbortError") {
      // Aborting closes the connection: the server frees the row at its next step.
      answer.finish("stopped");
    } else if (answer.text) {
      answer.fail(readable(error));
    } else {
      // Nothing came: take the turn back, so that the prompt can be sent again as it was.
      answer.fail(readable(error));
      turns.pop();
      if (!prompt.value) prompt.value = text;
    }
  } finally {
    if (answer.text) turns.push({ role: "assistant", content: answer.text });
    setBusy(null);
  }
}

function newChat() {
  state.controller?.abort();
  state.messages = [];
  $("conversation").replaceChildren();
  $("prompt").focus();
}

function saveToken() {
  const token = $("token").value.trim();
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
}

function start() {
  $("token").value = sessionStorage.getItem(TOKEN_KEY) ?? "";
  $("token").addEventListener("input", saveToken);
  $("token").addEventListener("change", showModel);
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("prompt").focus();
  showModel();
}

start();
