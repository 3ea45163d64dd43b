// chatgate admin page: tenants, masked keys, quotas with live usage (polled), usage chart.
// Talks only to /admin/* with "Authorization: Bearer <admin token>"; the token comes
// from the URL fragment (#token=..., removed at once) or the login form, and is kept
// in sessionStorage for this tab only.
"use strict";

const POLL_MS = 3000;
const QUOTAS = [
  ["requests_per_minute", "minute_requests"],
  ["tokens_per_minute", "minute_tokens"],
  ["max_concurrent_chats", "in_flight"],
  ["tokens_per_day", "day_tokens"],
  ["tokens_per_month", "month_tokens"],
];
const $ = (sel) => document.querySelector(sel);
let token = null;
let timer = null;

function takeToken() {
  const match = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (match) {
    sessionStorage.setItem("chatgate-admin-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("chatgate-admin-token");
}

async function api(path) {
  const answer = await fetch(path, { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  const body = await answer.json().catch(() => ({}));
  if (!answer.ok) {
    const error = new Error(body.error ? body.error.message : `HTTP ${answer.status}`);
    error.status = answer.status;
    throw error;
  }
  return body;
}

function status(text, isError = false) {
  const el = $("#status");
  el.textContent = text;
  el.classList.toggle("error", isError);
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function fmt(n) {
  return n === null || n === undefined ? "∞" : Number(n).toLocaleString("en-US");
}

function quotaCell(row, used, limit) {
  const td = cell(row, "", "quota");
  const text = document.createElement("span");
  text.className = "text";
  text.textContent = `${fmt(used)} / ${fmt(limit)}`;
  td.append(text);
  if (limit !== null && limit !== undefined) {
    const ratio = limit === 0 ? 1 : Math.min(1, used / limit);
    const bar = document.createElement("div");
    bar.className = "bar" + (ratio >= 1 ? " full" : ratio >= 0.8 ? " high" : "");
    const fill = document.createElement("span");
    fill.style.width = `${(ratio * 100).toFixed(1)}%`;
    bar.append(fill);
    td.append(bar);
  }
}

function renderTenants(tenants) {
  const body = $("#tenants tbody");
  body.replaceChildren();
  for (const t of tenants) {
    const row = body.insertRow();
    row.dataset.tenant = t.name;
    cell(row, t.name);
    cell(row, t.disabled ? "disabled" : "active", t.disabled ? "disabled" : "active");
    cell(row, String(t.weight), "num");
    cell(row, t.allowed_priorities.join(", "));
    const keys = cell(row, "");
    for (const k of t.keys) {
      const span = document.createElement("span");
      span.className = "key" + (k.revoked ? " revoked" : "");
      span.textContent = k.masked;
      span.title = k.revoked ? `revoked ${k.revoked_at}` : `last used ${k.last_used_at || "never"}`;
      keys.append(span);
    }
    const usage = t.usage || {};
    for (const [quota, counter] of QUOTAS) quotaCell(row, usage[counter] || 0, t.quotas[quota]);
  }
  const select = $("#chart-tenant");
  const current = select.value;
  const names = tenants.map((t) => t.name);
  if (names.join() !== [...select.options].map((o) => o.value).join()) {
    select.replaceChildren(...names.map((n) => new Option(n, n)));
    if (names.includes(current)) select.value = current;
  }
}

function drawChart(points, bucketMinutes) {
  const canvas = $("#chart");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = { l: 56, r: 44, t: 12, b: 28 };
  ctx.clearRect(0, 0, W, H);
  ctx.font = "11px system-ui, sans-serif";
  const tokens = points.map((p) => p.prompt_tokens + p.completion_tokens);
  const maxTok = Math.max(1, ...tokens);
  const maxReq = Math.max(1, ...points.map((p) => p.requests));
  const plotW = W - pad.l - pad.r, plotH = H - pad.t - pad.b;
  const bw = plotW / Math.max(1, points.length);
  ctx.strokeStyle = "#e5e7eb";
  ctx.fillStyle = "#6b7280";
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(W - pad.r, y); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(fmt(Math.round((maxTok * i) / 4)), pad.l - 6, y + 4);
    ctx.textAlign = "left"; ctx.fillText(fmt(Math.round((maxReq * i) / 4)), W - pad.r + 6, y + 4);
  }
  points.forEach((p, i) => {
    const x = pad.l + i * bw + 1, w = Math.max(1, bw - 2);
    const hp = (p.prompt_tokens / maxTok) * plotH, hc = (p.completion_tokens / maxTok) * plotH;
    ctx.fillStyle = "#93c5fd"; ctx.fillRect(x, pad.t + plotH - hp, w, hp);
    ctx.fillStyle = "#2563eb"; ctx.fillRect(x, pad.t + plotH - hp - hc, w, hc);
  });
  ctx.strokeStyle = "#d97706"; ctx.lineWidth = 2; ctx.beginPath();
  points.forEach((p, i) => {
    const x = pad.l + (i + 0.5) * bw, y = pad.t + plotH - (p.requests / maxReq) * plotH;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke(); ctx.lineWidth = 1;
  ctx.fillStyle = "#6b7280"; ctx.textAlign = "center";
  const every = Math.max(1, Math.ceil(points.length / 8));
  points.forEach((p, i) => {
    if (i % every === 0) ctx.fillText(p.start.slice(11, 16), pad.l + (i + 0.5) * bw, H - 8);
  });
  canvas.dataset.points = String(points.length);
  canvas.dataset.tokens = String(tokens.reduce((a, b) => a + b, 0));
  canvas.title = `tokens per ${bucketMinutes} min (UTC)`;
}

function renderRecent(rows) {
  const body = $("#recent tbody");
  body.replaceChildren();
  for (const r of rows) {
    const row = body.insertRow();
    cell(row, (r.created_at || "").replace("T", " ").slice(0, 19));
    cell(row, r.request_id);
    cell(row, r.priority);
    cell(row, fmt(r.prompt_tokens), "num");
    cell(row, fmt(r.completion_tokens), "num");
    cell(row, fmt(r.reserved_tokens), "num");
    cell(row, r.ttft_ms === null ? "-" : r.ttft_ms.toFixed(1), "num");
    cell(row, r.total_ms.toFixed(1), "num");
    cell(row, r.finish_reason);
  }
}

async function refresh() {
  try {
    const { tenants } = await api("/admin/tenants");
    renderTenants(tenants);
    const name = $("#chart-tenant").value;
    if (name) {
      const minutes = Number($("#chart-range").value);
      const bucket = Math.max(1, Math.round(minutes / 60));
      const series = await api(`/admin/tenants/${encodeURIComponent(name)}/usage?minutes=${minutes}&bucket_minutes=${bucket}`);
      drawChart(series.points, series.bucket_minutes);
      renderRecent(series.recent);
    }
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    status(`${tenants.length} tenant(s)`);
  } catch (error) {
    status(error.message, true);
    if (error.status === 401 || error.status === 404) stop(error.status === 401);
  }
}

function start() {
  $("#login").hidden = true;
  $("#dashboard").hidden = false;
  $("#logout").hidden = false;
  refresh();
  timer = setInterval(refresh, POLL_MS);
}

function stop(forget) {
  clearInterval(timer);
  if (forget) {
    sessionStorage.removeItem("chatgate-admin-token");
    token = null;
    $("#login").hidden = false;
    $("#dashboard").hidden = true;
    $("#logout").hidden = true;
  }
}

$("#login").addEventListener("submit", (event) => {
  event.preventDefault();
  token = $("#token").value.trim();
  if (!token) return;
  sessionStorage.setItem("chatgate-admin-token", token);
  $("#token").value = "";
  start();
});
$("#logout").addEventListener("click", () => { stop(true); status("token forgotten"); });
$("#chart-tenant").addEventListener("change", refresh);
$("#chart-range").addEventListener("change", refresh);

token = takeToken();
if (token) start(); else $("#login").hidden = false;
