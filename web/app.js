// chatgate chat page: one WebSocket to /v1/ws (protocol: docs/protocol.md), no build step.
"use strict";

const KEY_STORE = "chatgate.key";
const CONV_STORE = "chatgate.conversations";
const CURRENT_STORE = "chatgate.current";
const PARAMS_STORE = "chatgate.params";
const BACKOFF_MIN_MS = 500;
const BACKOFF_MAX_MS = 30000;

const $ = (id) => document.getElementById(id);
const state = {
  ws: null,
  ready: false,
  attempt: 0,          // reconnect attempts since the last successful auth
  retryTimer: null,
  conversations: load(CONV_STORE, []),
  currentId: localStorage.getItem(CURRENT_STORE),
  active: null,        // the chat streaming now: {chatId, conv, msg, el, renderQueued}
};

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}
function save() {
  localStorage.setItem(CONV_STORE, JSON.stringify(state.conversations));
  if (state.currentId) localStorage.setItem(CURRENT_STORE, state.currentId);
}
const newId = () => (crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random());

// ------------------------------------------------------------------ API key

function takeKeyFromFragment() {
  const m = location.hash.match(/(?:^#|&)key=([^&]+)/);
  if (!m) return;
  localStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
  // Remove the key from the address bar and from the history entry.
  history.replaceState(null, "", location.pathname + location.search);
}

function askForKey(message) {
  $("key-error").hidden = !message;
  $("key-error").textContent = message || "";
  $("key-input").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// ------------------------------------------------------------------ connection

function connect() {
  clearTimeout(state.retryTimer);
  const key = localStorage.getItem(KEY_STORE);
  if (!key) { setStatus("disconnected", "no API key"); askForKey(); return; }
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  setStatus("connecting", state.attempt ? `reconnecting (attempt ${state.attempt})…` : "connecting…");
  const ws = new WebSocket(`${scheme}://${location.host}/v1/ws`, ["chatgate.v1"]);
  state.ws = ws;
  ws.onopen = () => ws.send(JSON.stringify({ type: "auth", api_key: key }));
  ws.onmessage = (ev) => { if (ws === state.ws) onEvent(JSON.parse(ev.data)); };
  ws.onclose = (ev) => { if (ws === state.ws) onClose(ev); };
}

function onClose(ev) {
  state.ws = null;
  state.ready = false;
  if (state.active) finishActive({ error: "connection lost before the answer finished" });
  if (ev.code === 4401) {
    localStorage.removeItem(KEY_STORE);
    setStatus("disconnected", "not authenticated");
    askForKey(`The server refused the key: ${ev.reason || "invalid API key"}`);
    return;
  }
  const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** state.attempt) * (0.8 + 0.4 * Math.random());
  state.attempt += 1;
  const why = ev.reason ? `${ev.reason} (code ${ev.code})` : `code ${ev.code}`;
  setStatus("disconnected", "disconnected");
  showBanner(`Connection closed: ${why}. Reconnecting in ${(delay / 1000).toFixed(1)} s (attempt ${state.attempt})…`, "info");
  state.retryTimer = setTimeout(connect, delay);
}

function send(obj) {
  if (!state.ws || !state.ready) return false;
  state.ws.send(JSON.stringify(obj));
  return true;
}

function onEvent(ev) {
  switch (ev.type) {
    case "ready":
      state.ready = true;
      state.attempt = 0;
      hideBanner();
      $("model").textContent = `${ev.model} · tenant ${ev.tenant}`;
      setStatus("connected", "connected");
      break;
    case "chat.delta":
      if (state.active && state.active.chatId === ev.id) {
        state.active.msg.content += ev.text;
        scheduleRender();
      }
      break;
    case "chat.done":
      if (state.active && state.active.chatId === ev.id) finishActive({ done: ev });
      break;
    case "error":
      if (ev.id && state.active && state.active.chatId === ev.id) finishActive({ error: `${ev.code}: ${ev.message}` });
      else showBanner(`Server error ${ev.code}: ${ev.message}`);
      break;
    case "pong":
      break;
  }
}

// ------------------------------------------------------------------ chats

function currentConversation() {
  let conv = state.conversations.find((c) => c.id === state.currentId);
  if (!conv) {
    conv = { id: newId(), title: "New chat", messages: [], updated: Date.now() };
    state.conversations.unshift(conv);
    state.currentId = conv.id;
  }
  return conv;
}

function submit(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.active) return;
  if (!state.ready) { showBanner("Not connected yet: the message was not sent."); return; }
  const params = readParams();
  const conv = currentConversation();
  if (conv.messages.length === 0) conv.title = text.slice(0, 60);
  conv.messages.push({ role: "user", content: text });
  const history = conv.messages.map(({ role, content }) => ({ role, content }));
  const msg = { role: "assistant", content: "", meta: null };
  conv.messages.push(msg);
  conv.updated = Date.now();
  const chatId = newId();
  send({ type: "chat.create", id: chatId, messages: history, params, priority: "interactive" });
  $("prompt").value = "";
  renderConversation();
  const el = $("messages").lastElementChild;
  el.classList.add("streaming");
  state.active = { chatId, conv, msg, el, renderQueued: false };
  setBusy(true);
  save();
}

function stop() {
  if (state.active) send({ type: "chat.cancel", id: state.active.chatId });
}

function finishActive({ done, error }) {
  const { conv, msg, el } = state.active;
  state.active = null;
  if (error && !msg.content) {
    // Nothing came back: drop the empty answer so the conversation can be retried as is.
    conv.messages.splice(conv.messages.indexOf(msg), 1);
    const userMsg = conv.messages.pop();
    if (userMsg && !$("prompt").value) $("prompt").value = userMsg.content;
    showBanner(`The answer failed: ${error}`);
  } else {
    msg.meta = done ? metaFromDone(done) : { error };
  }
  el.classList.remove("streaming");
  setBusy(false);
  save();
  renderConversation();
}

function metaFromDone(done) {
  return {
    finish_reason: done.finish_reason,
    ttft_ms: done.timings.ttft_ms,
    tokens_per_s: done.timings.tokens_per_s,
    prompt_tokens: done.usage.prompt_tokens,
    completion_tokens: done.usage.completion_tokens,
  };
}

function readParams() {
  const temperature = Number($("temperature").value);
  const max_tokens = Math.round(Number($("max-tokens").value));
  localStorage.setItem(PARAMS_STORE, JSON.stringify({ temperature, max_tokens }));
  return { temperature, max_tokens };
}

// ------------------------------------------------------------------ rendering

// Close an unfinished code fence so a half-streamed block renders as code, not as prose.
function closeOpenFence(text) {
  let open = null;
  for (const line of text.split("\n")) {
    const m = line.match(/^ {0,3}(`{3,}|~{3,})/);
    if (!m) continue;
    if (open === null) open = m[1];
    else if (m[1][0] === open[0] && m[1].length >= open.length && line.trim() === m[1]) open = null;
  }
  return open === null ? text : `${text}\n${open}`;
}

function renderMarkdown(el, text) {
  const html = marked.parse(closeOpenFence(text), { gfm: true, breaks: false });
  el.innerHTML = DOMPurify.sanitize(html);
  el.querySelectorAll("pre code").forEach((block) => hljs.highlightElement(block));
}

function scheduleRender() {
  const active = state.active;
  if (active.renderQueued) return;
  active.renderQueued = true;
  requestAnimationFrame(() => {
    active.renderQueued = false;
    if (state.active !== active) return;
    renderMarkdown(active.el.querySelector(".content"), active.msg.content);
    scrollToEnd();
  });
}

function messageElement(m) {
  const el = document.createElement("div");
  el.className = `msg ${m.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role;
  const content = document.createElement("div");
  content.className = "content";
  if (m.role === "assistant") renderMarkdown(content, m.content);
  else content.textContent = m.content;
  el.append(role, content);
  if (m.meta) el.append(metaElement(m.meta));
  return el;
}

function metaElement(meta) {
  const el = document.createElement("div");
  el.className = "meta";
  if (meta.error) {
    const span = document.createElement("span");
    span.className = "error";
    span.textContent = `⚠ ${meta.error}`;
    el.append(span);
    return el;
  }
  const parts = [];
  if (meta.ttft_ms != null) parts.push(`TTFT ${Math.round(meta.ttft_ms)} ms`);
  if (meta.tokens_per_s != null) parts.push(`${meta.tokens_per_s.toFixed(1)} tokens/s`);
  parts.push(`${meta.completion_tokens} tokens`);
  parts.push(meta.finish_reason === "abort" ? "stopped" : meta.finish_reason === "length" ? "hit max tokens" : "done");
  el.textContent = parts.join(" · ");
  return el;
}

function renderConversation() {
  const conv = state.conversations.find((c) => c.id === state.currentId);
  const box = $("messages");
  box.replaceChildren(...(conv ? conv.messages.map(messageElement) : []));
  if (state.active && conv === state.active.conv) {
    state.active.el = box.lastElementChild;
    state.active.el.classList.add("streaming");
  }
  renderList();
  scrollToEnd();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren(...state.conversations.map((c) => {
    const li = document.createElement("li");
    if (c.id === state.currentId) li.classList.add("active");
    const a = document.createElement("a");
    a.textContent = c.title;
    a.onclick = () => { if (!state.active) { state.currentId = c.id; save(); renderConversation(); } };
    const del = document.createElement("button");
    del.textContent = "✕";
    del.title = "Delete conversation";
    del.onclick = () => {
      if (state.active && state.active.conv === c) return;
      state.conversations = state.conversations.filter((x) => x !== c);
      if (state.currentId === c.id) state.currentId = state.conversations[0]?.id ?? null;
      save();
      renderConversation();
    };
    li.append(a, del);
    return li;
  }));
}

function scrollToEnd() { $("messages").scrollTop = $("messages").scrollHeight; }

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

function setStatus(kind, text) {
  $("status").className = `status ${kind}`;
  $("status").textContent = text;
}
function showBanner(text, kind = "error") {
  $("banner").className = kind === "info" ? "info" : "";
  $("banner").textContent = text;
  $("banner").hidden = false;
}
function hideBanner() { $("banner").hidden = true; }

// ------------------------------------------------------------------ start

function init() {
  const params = load(PARAMS_STORE, null);
  if (params) {
    $("temperature").value = params.temperature;
    $("max-tokens").value = params.max_tokens;
  }
  takeKeyFromFragment();
  $("composer").addEventListener("submit", submit);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").onclick = stop;
  $("new-chat").onclick = () => { if (!state.active) { state.currentId = null; currentConversation(); save(); renderConversation(); } };
  $("change-key").onclick = () => askForKey();
  $("key-form").addEventListener("submit", () => {
    const key = $("key-input").value.trim();
    if (!key) return;
    localStorage.setItem(KEY_STORE, key);
    state.attempt = 0;
    if (state.ws) state.ws.close(1000, "key changed");
    state.ws = null;
    connect();
  });
  marked.use({ gfm: true });
  renderConversation();
  connect();
}

document.addEventListener("DOMContentLoaded", init);
