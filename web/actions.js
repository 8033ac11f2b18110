// What people do: send a packet or a line, manage members, log in and out, read their packets.

import { $, group, me, state } from "./state.js";
import { parseCents, say, shares, uuid, yuan } from "./words.js";
import { api, refreshMe } from "./http.js";
import { connect, request } from "./live.js";
import { el, renderChat, renderGroups, showError, timeEl } from "./render.js";

export async function sendPacket(ev) {
  ev.preventDefault();
  const err = $("send-error");
  err.textContent = "";
  const kind = document.querySelector('input[name="kind"]:checked').value;
  const total = parseCents($("send-total").value);
  const count = kind === "exclusive" ? 1 : Number($("send-count").value);
  if (total === null || total <= 0) {
    err.textContent = say({ code: "amount_invalid" });
    return;
  }
  if (!Number.isInteger(count) || count < 1) {
    err.textContent = say({ code: "count_invalid" });
    return;
  }
  const target = kind === "exclusive" ? $("send-target").value || undefined : undefined;
  const btn = $("send-submit");
  btn.disabled = true;
  try {
    // One request id per dialog: a retry after a lost reply pays once.
    const form = $("send-form");
    form.dataset.requestId = form.dataset.requestId || uuid();
    await request("send", { group: state.current, kind, total, count, target, greeting: $("send-greeting").value,
      request_id: form.dataset.requestId });
    delete form.dataset.requestId;
    $("send-dialog").close();
    form.reset();
    await refreshMe();
  } catch (e) {
    err.textContent = say(e);
  } finally {
    btn.disabled = false;
  }
}

export async function sendChat(ev) {
  ev.preventDefault();
  const input = $("text");
  const text = input.value.trim();
  if (!text) return;
  try {
    await request("chat", { group: state.current, text });
    input.value = "";
  } catch (e) {
    showError(e);
  }
}

export async function makeAdmin(uid) {
  try {
    await api("POST", `/api/groups/${state.current}/admins/${uid}`);
  } catch (e) {
    showError(e);
  }
}

export async function removeMember(uid) {
  try {
    await api("DELETE", `/api/groups/${state.current}/members/${uid}`);
  } catch (e) {
    showError(e);
  }
}

export async function login(name) {
  $("login-error").textContent = "";
  try {
    const data = await api("POST", "/api/login", { name });
    state.token = data.token;
    sessionStorage.setItem("rp.token", data.token);
    sessionStorage.setItem("rp.name", data.name);
    start();
  } catch (e) {
    // A hub beside a chat backend (or beyond this machine) has no name login: the chat app signs you in.
    $("login-error").textContent =
      e.code === "disabled"
        ? "This server does not log in by name: open it from your chat app, which signs you in."
        : say(e);
  }
}

export function logout() {
  state.token = null;
  sessionStorage.removeItem("rp.token");
  const client = state.client;
  state.client = null;
  if (client) client.close();
  clearTimeout(state.expiryTimer);
  state.groups.clear();
  state.current = null;
  state.everOnline = false;
  state.me = null;
  for (const d of document.querySelectorAll("dialog[open]")) d.close();
  $("app").hidden = true;
  $("login").hidden = false;
}

export function start() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("app").dataset.view = "groups";
  renderGroups();
  renderChat();
  connect();
}

export const STATUS = { credited: "in your balance", grabbed: "on its way" };

export const SENT_STATUS = { finished: "all paid out", refunding: "expired, refund under way", refunded: "expired, the rest refunded" };

export async function showHistory() {
  let data;
  try {
    // The first page of each list: the newest 50 (docs/integration.md, "Lists").
    const [sent, received] = await Promise.all([api("GET", "/api/me/packets/sent"), api("GET", "/api/me/packets/received")]);
    data = { sent: sent.packets, received: received.packets };
  } catch (e) {
    showError(e);
    return;
  }
  const groupName = (id) => state.groups.get(id)?.info.name || `group ${id}`;
  const from = (r) => (r.sender_id === me() ? "You" : r.sender_name);
  $("history-received").replaceChildren(...data.received.map((r) => el("li", { "data-packet": r.packet_id },
    el("span", {}, `${from(r)} · ${r.greeting || "Best wishes!"}`, el("br"),
      el("span", { class: "status" }, `${groupName(r.group_id)} · `, timeEl(r.grabbed_ms), ` · ${STATUS[r.status] || r.status}`)),
    el("span", { class: "amount" }, yuan(r.amount)))));
  const sentState = (p) => (p.status in SENT_STATUS ? SENT_STATUS[p.status] : `${p.paid_out} of ${p.count} paid out`);
  $("history-sent").replaceChildren(...data.sent.map((p) => el("li", { "data-packet": p.packet_id },
    el("span", {}, `${p.greeting || "Best wishes!"}`, el("br"),
      el("span", { class: "status" }, `${groupName(p.group_id)} · `, timeEl(p.created_ms), ` · ${sentState(p)}`)),
    el("span", { class: "amount" }, `${yuan(p.total)} · ${shares(p.count)}`))));
  if (!data.received.length) $("history-received").append(el("li", { class: "status" }, "Nothing yet"));
  if (!data.sent.length) $("history-sent").append(el("li", { class: "status" }, "Nothing yet"));
  $("history-dialog").showModal();
}

export function openSendDialog() {
  $("send-error").textContent = "";
  const g = group(state.current);
  $("send-target").replaceChildren(...[...g.members.values()]
    .filter((m) => m.user_id !== me())
    .map((m) => el("option", { value: m.user_id }, m.name)));
  const members = g.members.size || g.info.members;
  const most = Math.min(state.limits.max_count, members || state.limits.max_count);
  $("send-total-hint").textContent = `Up to ${yuan(state.limits.max_total_cents)}.`;
  $("send-count-hint").textContent = `1 to ${most}: at most one for each of the group's ${members} members.`;
  kindChanged();
  $("send-dialog").showModal();
}

export function kindChanged() {
  // "For one person": one share, for a member picked from the group.
  const exclusive = document.querySelector('input[name="kind"]:checked').value === "exclusive";
  $("send-count-row").hidden = exclusive;
  $("send-count-hint").hidden = exclusive;
  $("send-target-row").hidden = !exclusive;
}
