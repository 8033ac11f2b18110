// Rendering: the groups, the room, the members, and the toast.

import { $, group, me, nameOf, phone, serverNow, state } from "./state.js";
import { say, shares, when, yuan } from "./words.js";
import { itemText } from "./live.js";
import { openPacket } from "./sheet.js";
import { makeAdmin, removeMember } from "./actions.js";

export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

export const timeEl = (ms) => el("time", { datetime: new Date(ms).toISOString(), title: new Date(ms).toLocaleString() }, when(ms));

export function renderGroups() {
  const list = $("group-list");
  list.replaceChildren();
  for (const [id, g] of state.groups) {
    const label = [g.info.name, g.info.role === "admin" ? "admin" : null, g.unread ? `${g.unread} unread` : null];
    list.append(el("li", {},
      el("button", { "aria-current": String(id === state.current), "data-group": id, "aria-label": label.filter(Boolean).join(", "),
        onclick: () => selectGroup(id) },
        el("span", {}, g.info.name, " ", el("span", { class: "role" }, g.info.role === "admin" ? "admin" : "")),
        g.unread ? el("span", { class: "unread" }, String(g.unread)) : null)));
  }
  $("no-groups").hidden = state.groups.size > 0;
}

export function selectGroup(id) {
  state.current = id;
  $("app").dataset.view = id === null ? "groups" : "chat";
  if (id !== null) group(id).unread = 0;
  $("add-error").textContent = "";
  layoutMembers(false);
  renderGroups();
  renderChat();
}

export function layoutMembers(open) {
  // A desktop shows the members beside the chat whenever a group is open; a phone shows them as a drawer,
  // opened by the Members button and closed by ×, Escape or a tap outside it.
  const pane = $("members-pane");
  const wasOpen = phone.matches && !pane.hidden;
  const show = state.current !== null && (!phone.matches || open);
  pane.hidden = !show;
  $("scrim").hidden = !(show && phone.matches);
  $("members-toggle").setAttribute("aria-expanded", String(show));
  pane.setAttribute("role", phone.matches ? "dialog" : "complementary");
  if (phone.matches && open) $("members-close").focus();
  else if (wasOpen && !show && state.current !== null) $("members-toggle").focus();
}

export const expired = (p) => Boolean(p.expires_ms) && serverNow() > p.expires_ms;

// An exclusive packet whose target is someone else (a packet known only from a sync has no target).
export const forSomeoneElse = (p) => p.kind === "exclusive" && Boolean(p.target) && p.target !== me();

export function grabbable(p) {
  // A packet that opens to its card (開) rather than straight to its result.
  if (p.mine || p.remaining === 0 || p.finished || expired(p)) return false;
  return !forSomeoneElse(p);
}

export function packetState(p) {
  if (p.mine) return `You got ${yuan(p.mine.amount)}`;
  if (p.remaining === 0) return "All grabbed";
  if (expired(p)) return "Expired";
  if (forSomeoneElse(p)) return `For ${nameOf(p.target)}`;
  return "Tap to open";
}

export function renderChat() {
  const id = state.current;
  const g = id === null ? null : state.groups.get(id);
  $("group-title").textContent = g ? g.info.name : "Pick a group";
  $("composer").hidden = !g;
  $("members-toggle").hidden = !g;
  const list = $("messages");
  if (!g) {
    layoutMembers(false);
    list.replaceChildren();
    return;
  }
  const canSend = g.info.role === "admin" || g.info.members_can_send;
  $("open-send").hidden = !canSend;
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  // The room is drawn anew on every change: keep keyboard focus on the packet that had it.
  const focused = list.contains(document.activeElement) ? document.activeElement.dataset.packet : undefined;
  list.replaceChildren();
  let soonest = Infinity;
  for (const item of g.items) {
    if (item.kind === "system" || item.kind === "grab") {
      const text = itemText(g, item);
      list.append(el("li", { class: "system" }, el("span", { class: item.luck ? "luck" : "", title: item.ms ? when(item.ms) : null }, text)));
      continue;
    }
    const mine = item.user === me();
    const author = el("span", { class: "author" }, nameOf(item.user), item.ms ? timeEl(item.ms) : null);
    const li = el("li", { class: mine ? "mine" : "" }, author);
    if (item.kind === "chat") li.append(el("div", { class: "bubble" }, item.text));
    else {
      const p = g.packets.get(item.packet_id);
      li.append(packetBubble(id, p));
      if (grabbable(p) && p.expires_ms) soonest = Math.min(soonest, p.expires_ms);
    }
    list.append(li);
  }
  if (focused !== undefined) list.querySelector(`.packet[data-packet="${focused}"]`)?.focus({ preventScroll: true });
  if (atBottom || list.dataset.group !== String(id)) list.scrollTop = list.scrollHeight;
  list.dataset.group = String(id);
  // Draw again when the next open packet expires, so that it says so without an event.
  clearTimeout(state.expiryTimer);
  if (soonest < Infinity) state.expiryTimer = setTimeout(renderChat, Math.min(2 ** 31 - 1, soonest - serverNow() + 50));
  renderMembers();
}

export function packetBubble(groupId, p) {
  const cls = ["packet"];
  if (p.mine) cls.push("opened");
  else if (!grabbable(p)) cls.push("gone");
  if (p.grabbing) cls.push("grabbing");
  const what = p.kind === "exclusive" && p.target
    ? `for ${p.target === me() ? "you" : nameOf(p.target)}`
    : `${p.kind === "equal" ? "equal shares" : "lucky"} · ${shares(p.count)}`;
  const status = packetState(p);
  const until = grabbable(p) && p.expires_ms ? `until ${when(p.expires_ms)}` : null;
  const label = `Red packet from ${p.sender === me() ? "you" : nameOf(p.sender)}, ${what}: ${p.greeting || "Best wishes!"}. ` +
    `${status}${until ? `, ${until}` : ""}.`;
  return el("button", { class: cls.join(" "), "data-packet": p.packet_id, "aria-label": label,
    onclick: () => openPacket(groupId, p.packet_id) },
    el("div", { class: "face" }, el("img", { src: "packet.svg", alt: "" }),
      el("div", {}, el("div", { class: "greeting" }, p.greeting || "Best wishes!"),
        el("div", { class: "state" }, status),
        until ? el("div", { class: "state until" }, until) : null)),
    el("div", { class: "foot" }, `Red packet · ${what}`));
}

export function renderMembers() {
  const g = state.current === null ? null : state.groups.get(state.current);
  if (!g) return;
  const list = $("member-list");
  list.replaceChildren();
  for (const [uid, m] of g.members) {
    const admin = g.info.role === "admin" && uid !== me();
    const on = g.online.has(uid);
    list.append(el("li", { "data-user": uid },
      el("span", { class: `dot${on ? " on" : ""}`, title: on ? "online" : "offline" }),
      el("span", { class: "name" }, m.name, el("span", { class: "sr-only" }, on ? " (online)" : " (offline)")),
      m.role === "admin" ? el("span", { class: "tag" }, "admin") : null,
      admin && m.role !== "admin"
        ? el("button", { class: "small ghost", "aria-label": `Make ${m.name} an admin`, onclick: () => makeAdmin(uid) }, "Make admin")
        : null,
      admin ? el("button", { class: "small ghost", "aria-label": `Remove ${m.name}`, onclick: () => removeMember(uid) }, "×") : null));
  }
  $("add-member").hidden = g.info.role !== "admin";
}

let toastTimer = null;

export function toast(text) {
  const t = $("toast");
  t.textContent = text;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (t.hidden = true), 3500);
}

export function showError(e) {
  toast(say(e));
}
