// The chat page: a client of /v1/models and /v1/chat/completions like any other, so it works
// straight to the server and through the proxy (with a token) alike. No framework, no build step.
"use strict";

// sessionStorage, not localStorage: the token goes away with the tab.
const TOKEN_KEY = "inference-server.token";
// localStorage: the conversation is still there after a reload, until "New chat".
const CONVERSATION_KEY = "inference-server.conversation";
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
  // The conversation: {role, content} as the API takes it; an answer also keeps a reasoning model's
  // thoughts (thoughts, shown, not sent back), its statistics line (stats) or the error that cut it
  // short (error).
  turns: [],
  model: null, // the served model's id, from /v1/models
  controller: null, // the AbortController of the answer under way
  failed: [], // the elements of an exchange that got no answer: on the page until the next send
};

// The model's output is not trusted markup. Raw HTML in it is shown as text; the HTML that marked
// makes from the Markdown goes through DOMPurify, which keeps only what Markdown needs. No images
// (their alt text stands in): one would make the browser fetch whatever address the model wrote.
const escapeHtml = (text) =>
  text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const markdown = new marked.Marked({
  gfm: true,
  breaks: true, // a chat's single line breaks are meant
  renderer: {
    html: ({ text, block }) =>
      block ? `<p>${escapeHtml(text.trim()).replaceAll("\n", "<br>")}</p>` : escapeHtml(text),
    image: ({ text }) => escapeHtml(text),
  },
});
const SANITIZE = {
  ALLOWED_TAGS: [
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "code", "pre",
    "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td",
  ],
  ALLOWED_ATTR: ["href", "title", "start", "align"],
  ALLOWED_URI_REGEXP: /^https?:/i, // links to the web only: no javascript:, data:, or paths of this server
  ADD_URI_SAFE_ATTR: ["start", "align"], // not addresses: not held to the pattern above
};
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Markdown to safe HTML: what an answer's text element holds. */
function renderMarkdown(text) {
  return DOMPurify.sanitize(markdown.parse(text), SANITIZE);
}

/** An error whose message is already fit to show, with the HTTP status where a response gave it. */
class ReadableError extends Error {
  constructor(message, status = null) {
    super(message);
    this.status = status;
  }
}

// Through the proxy with no token yet: what the page asks for instead of showing the 401.
const ASK_FOR_TOKEN = "Paste your token in the Token field (make token TEAM=... prints one).";

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
  return new ReadableError(line, response.status);
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
    const noToken = error.status === 401 && !$("token").value.trim();
    label.textContent = noToken ? ASK_FOR_TOKEN : readable(error);
    label.classList.toggle("error", !noToken); // not yet wrong: nothing was given
    if (noToken) $("token").focus();
  }
  return state.model;
}

/** A message on the page. A user's text is shown as written, an answer's as Markdown. */
function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  element.append(label, body);
  setText(element, text);
  $("conversation").append(element);
  scrollDown();
  return element;
}

/** A reasoning model's thoughts, in a fold above its answer: open while it thinks, as plain text. */
function setThoughts(element, thoughts) {
  let fold = element.querySelector(".thoughts");
  if (!fold) {
    fold = document.createElement("details");
    fold.className = "thoughts";
    fold.open = element.classList.contains("streaming");
    const summary = document.createElement("summary");
    summary.textContent = "Thoughts";
    const body = document.createElement("div");
    body.className = "thinking";
    fold.append(summary, body);
    element.querySelector(".text").before(fold);
  }
  fold.querySelector(".thinking").textContent = thoughts;
}

function setText(element, text) {
  const body = element.querySelector(".text");
  body.dataset.source = text; // the text as written, which the rendered Markdown no longer spells out
  if (element.classList.contains("assistant")) body.innerHTML = renderMarkdown(text);
  else body.textContent = text;
}

/** A line under a message: an answer's statistics, or an error. */
function addNote(element, className, text) {
  const note = document.createElement("div");
  note.className = className;
  if (className === "error") note.setAttribute("role", "alert");
  note.textContent = text;
  element.append(note);
  scrollDown(); // the note is the last thing on the page: below the fold until scrolled to
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
    this.thoughts = ""; // a reasoning model's (the API's reasoning_content), before its text
    this.started = performance.now();
    this.first = null; // when the first text arrived
    this.last = null;
    this.pieces = 0;
    this.usage = null; // the server's count, from the last chunk (stream_options.include_usage)
    this.stats = null;
    this.error = null;
    this.pending = null; // a render to come (render)
    this.closeThoughts = false; // at the next render: the answer has begun after thoughts
  }

  append(content) {
    if (!this.text && this.thoughts) this.closeThoughts = true; // the answer begins: fold them away
    this.text += content;
    this.arrived();
  }

  think(thoughts) {
    this.thoughts += thoughts;
    this.arrived();
  }

  arrived() {
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.pieces += 1;
    // Rendered when the page is next free, once for every piece come by then: the whole text is
    // rendered again each time (an open code block or list closes later), and a long answer rendered
    // once a piece fell behind the stream on a busy machine, holding Stop's click back to the end.
    this.pending ??= setTimeout(() => this.render(), 0);
  }

  render() {
    clearTimeout(this.pending);
    this.pending = null;
    if (this.thoughts) setThoughts(this.element, this.thoughts);
    if (this.closeThoughts) this.element.querySelector(".thoughts").open = false;
    this.closeThoughts = false;
    setText(this.element, this.text);
    scrollDown();
  }

  /** Time to first token, and tokens per second from the first token to the last. */
  finish(note) {
    this.render();
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
    this.stats = parts.join(" · ");
    addNote(this.element, "stats", this.stats);
  }

  fail(message) {
    this.render();
    this.element.classList.remove("streaming");
    this.error = message;
    addNote(this.element, "error", message);
  }

  get turn() {
    const turn = { role: "assistant", content: this.text };
    if (this.thoughts) turn.thoughts = this.thoughts;
    if (this.stats) turn.stats = this.stats;
    if (this.error) turn.error = this.error;
    return turn;
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

function requestBody(model, turns) {
  const body = {
    model,
    messages: turns.map(({ role, content }) => ({ role, content })),
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const field of SAMPLING_FIELDS) {
    const value = $(field).value.trim();
    if (value !== "") body[field] = Number(value); // the server checks the ranges and names the field
  }
  return body;
}

async function streamAnswer(answer, turns, signal) {
  const model = state.model ?? (await showModel());
  if (!model) throw new ReadableError($("model").textContent);
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: requestHeaders(),
    body: JSON.stringify(requestBody(model, turns)),
    signal,
  });
  if (!response.ok) throw await responseError(response);
  for await (const data of sseData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ReadableError(`The server could not finish the answer: ${chunk.error.message}`);
    if (chunk.usage) answer.usage = chunk.usage;
    const delta = chunk.choices?.[0]?.delta;
    if (delta?.reasoning_content) answer.think(delta.reasoning_content);
    if (delta?.content) answer.append(delta.content);
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
  // An exchange that failed before goes: its prompt, given back, is being sent again or replaced.
  state.failed.forEach((element) => element.remove());
  state.failed = [];
  const turns = state.turns; // "New chat" mid-answer swaps in a new list: this answer stays out of it
  turns.push({ role: "user", content: text });
  const question = addMessage("user", text);
  const answer = new Answer();
  const controller = new AbortController();
  setBusy(controller);
  try {
    await streamAnswer(answer, turns, controller.signal);
    answer.finish();
  } catch (error) {
    // Aborting closes the connection: the server frees the row at its next step.
    if (error.name === "AbortError") answer.finish("stopped");
    else answer.fail(readable(error));
  } finally {
    if (state.controller === controller) setBusy(null);
  }
  if (turns !== state.turns) return; // "New chat" came in between
  if (answer.text || answer.thoughts) {
    turns.push(answer.turn);
    saveConversation();
  } else {
    // Nothing came (neither text nor thoughts): the turn is taken back and the prompt given back, whole
    // and selected, so that Enter sends it again and typing replaces it (rather than adding to it).
    turns.pop();
    state.failed = [question, answer.element];
    prompt.value = text;
    prompt.focus();
    prompt.select();
  }
}

function saveConversation() {
  try {
    localStorage.setItem(CONVERSATION_KEY, JSON.stringify({ turns: state.turns }));
  } catch (error) {
    console.warn("the conversation could not be kept in localStorage:", error); // full, or disabled
  }
}

/** The conversation kept by the last visit, or none if there is none or it cannot be read. */
function storedTurns() {
  try {
    const turns = JSON.parse(localStorage.getItem(CONVERSATION_KEY))?.turns;
    const valid = (turn) => ["user", "assistant"].includes(turn?.role) && typeof turn.content === "string";
    return Array.isArray(turns) && turns.every(valid) ? turns : [];
  } catch {
    return [];
  }
}

function showConversation(turns) {
  state.turns = turns;
  for (const turn of turns) {
    const element = addMessage(turn.role, turn.content);
    if (typeof turn.thoughts === "string") setThoughts(element, turn.thoughts);
    if (turn.stats) addNote(element, "stats", turn.stats);
    if (turn.error) addNote(element, "error", turn.error);
  }
}

function newChat() {
  state.controller?.abort();
  setBusy(null);
  state.turns = [];
  state.failed = [];
  $("conversation").replaceChildren();
  $("prompt").value = "";
  try {
    localStorage.removeItem(CONVERSATION_KEY);
  } catch {} // storage disabled: nothing was kept
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
  showConversation(storedTurns());
  $("prompt").focus();
  showModel();
}

start();
