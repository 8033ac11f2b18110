// The websocket, through the JavaScript client (/client/redpacket.js): what each event does to the rooms,
// and what a line of the room says.

import { RedPacketClient } from "/client/redpacket.js";
import { $, group, me, nameOf, offsetMs, phone, state } from "./state.js";
import { ApiError, shares, uuid, yuan } from "./words.js";
import { loadMembers, refreshMe } from "./http.js";
import { renderChat, renderGroups, renderMembers, selectGroup, showError, toast } from "./render.js";
import { logout } from "./actions.js";

export function setConn(s) {
  state.connState = s;
  const badge = $("conn");
  badge.dataset.state = s;
  badge.textContent = { connecting: "Connecting…", online: "Online", reconnecting: "Reconnecting…", offline: "Offline" }[s];
  $("missed").hidden = s !== "reconnecting";
  $("missed").textContent = "Connection lost. Reconnecting… what happens meanwhile will be filled in.";
  for (const c of $("composer").querySelectorAll("input, button")) c.disabled = s !== "online";
}

export function device() {
  let d = localStorage.getItem("rp.device");
  if (!d) {
    d = uuid().slice(0, 32);
    localStorage.setItem("rp.device", d);
  }
  return d;
}

export function connect() {
  setConn(state.everOnline ? "reconnecting" : "connecting");
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  // The client sends the token as a subprotocol, not in the URL (docs/protocol.md, "Connecting"), backs
  // off with jitter up to 10 s between tries, and syncs every group from its last offset after each welcome.
  const client = new RedPacketClient({
    url: `${proto}//${location.host}/ws`,
    token: state.token,
    device: device(),
    format: "json",
    firstOffset: "0-0", // a group seen for the first time: its recent history
    minDelayMs: 500,
    maxDelayMs: 10_000,
    beforeSync: onWelcome,
  });
  state.client = client;
  const mine = (handler) => (x) => state.client === client && handler(x);
  client.on("status", mine(({ status }) => {
    if (status === "reconnecting" || (status === "connecting" && state.everOnline)) setConn("reconnecting");
  }));
  client.on("close", mine((e) => {
    // Too many windows on this account (4030): the client tries again every 5–10 s and gets in once one of
    // them closes; the badge stays "Connecting…" or "Reconnecting…" meanwhile.
    if (e.code === 4030) {
      toast("Too many windows are open on this account: close one and this one connects by itself.");
    }
    if (e.willRetry) return;
    // A token the hub refuses (4001), or a user it does not have (4004): log in again.
    if (e.code === 4001 || e.code === 4004) logout();
    else setConn("offline");
  }));
  client.on("event", mine(onEvent));
  client.on("reset", mine(onReset));
  client.on("synced", mine(onSynced));
  client.on("added", mine((msg) => refreshMe().then(() => client.sync([msg.group])).catch(showError)));
  client.on("removed", mine((msg) => {
    state.groups.delete(msg.group);
    if (state.current === msg.group) selectGroup(null);
    toast("You were removed from a group.");
    refreshMe().catch(showError);
  }));
  // A gap notice: the client syncs the group itself; its reply comes as "synced".
  client.connect().catch(() => {}); // a final close is handled above
}

export function request(type, fields) {
  if (!state.client) return Promise.reject(new ApiError("offline", "not connected"));
  return state.client.request(type, fields);
}

export const shownLines = () => [...state.groups.values()].reduce((n, g) => n + g.items.length, 0);

// The client awaits this after each welcome, before it syncs (the hub holds the groups' events until then).
export async function onWelcome(msg) {
  for (const info of msg.groups) group(info.group_id).info = { ...group(info.group_id).info, ...info };
  state.skewMs = msg.server_ms - Date.now();
  if (msg.limits) state.limits = msg.limits;
  state.everOnline = true;
  setConn("online");
  try {
    await refreshMe();
  } catch (e) {
    showError(e);
  }
  state.shownBefore = shownLines();
}

// A sync's reply (after its replayed events): after a welcome, a gap, or a group added.
export function onSynced({ groups, reason }) {
  for (const [key, res] of Object.entries(groups)) {
    if (res.error) continue;
    const g = group(key);
    if (!g.synced) {
      g.synced = true;
      g.unread = 0;
    }
    loadMembers(key).catch(() => {});
    presence(key);
  }
  renderGroups();
  if (state.current !== null) renderChat();
  if (reason !== "welcome" && reason !== "reconnect") return;
  // What the reader sees that is new: presence comings and goings not counted.
  const missed = shownLines() - state.shownBefore;
  if (reason === "reconnect") {
    toast(missed > 0 ? `Back online: ${missed} missed update${missed === 1 ? "" : "s"} filled in.` : "Back online.");
  }
  if (state.current === null && state.groups.size && !phone.matches) selectGroup([...state.groups.keys()][0]);
}

// The hub no longer holds everything since our offset: start again from its open packets.
export function onReset({ group: id, packets, tooOld, previous }) {
  const g = group(id);
  if (tooOld && previous) {
    g.items.push({ kind: "system", text: "Some older messages could not be loaded; here is what is open now." });
  }
  for (const view of packets) addPacketView(id, view);
}

export function presence(id) {
  request("presence", { group: id })
    .then((data) => {
      group(id).online = new Set(data.online);
      if (id === state.current) renderMembers();
    })
    .catch(() => {});
}

// The grabs a grabs event (or a big room's finished event) lists. A big room lists only the latest
// grabs of an interval: "more" says how many it left out.
export function addGrabs(g, d, ms, added) {
  if (d.more) added.push({ kind: "system", ms, text: `${d.more} more ${d.more === 1 ? "person" : "people"} opened red packets` });
  for (const [pid, left] of Object.entries(d.remaining || {})) {
    const p = g.packets.get(pid);
    if (p) p.remaining = Math.min(p.remaining, left);
  }
  for (const x of d.grabs || []) {
    const p = g.packets.get(x.packet_id);
    if (p) p.remaining = Math.min(p.remaining, x.remaining);
    if (p && x.user === me()) p.mine = p.mine || { amount: x.amount };
    added.push({ kind: "grab", user: x.user, packet_id: x.packet_id, remaining: x.remaining, ms: x.ms || ms });
  }
}

export function onEvent(msg) {
  // Each event comes once, in order: the client drops what it has seen (an overlap after a reconnect).
  const g = group(msg.group);
  const d = msg.data;
  const ms = offsetMs(msg.offset);
  const added = [];
  switch (msg.event) {
    case "chat":
      added.push({ kind: "chat", user: d.user, text: d.text, ms });
      break;
    case "packet":
      addPacketView(msg.group, { packet_id: d.packet_id, sender_id: d.sender, kind: d.kind, total: d.total, target: d.target,
        count: d.count, greeting: d.greeting, remaining: d.count, created_ms: d.created_ms, expires_ms: d.expires_ms,
        grabs: [], mine: null });
      break;
    case "grabs":
      addGrabs(g, d, ms, added);
      break;
    case "finished": {
      addGrabs(g, d, ms, added); // a big room's last grabs of the packet ride on its finished event
      const p = g.packets.get(d.packet_id);
      if (p) {
        p.remaining = 0;
        p.finished = true;
      }
      const secs = (d.duration_ms / 1000).toFixed(1);
      const lucky = d.best_luck && d.count > 1 && (!p || p.kind === "lucky");
      const best = lucky ? ` · best luck: ${nameOf(d.best_luck.user)} (${yuan(d.best_luck.amount)})` : "";
      const all = d.count === 1 ? "The only share" : `All ${shares(d.count)}`;
      added.push({ kind: "system", luck: true, ms, text: `${all} grabbed in ${secs} s${best}` });
      break;
    }
    case "member_added":
    case "member_removed":
    case "member_role": {
      const what = { member_added: "joined the group", member_removed: "left the group", member_role: "is now an admin" }[msg.event];
      added.push({ kind: "system", user: d.user, text: what, ms });
      loadMembers(msg.group).then(() => msg.group === state.current && renderChat()).catch(() => {});
      break;
    }
    case "presence":
      if (d.online) g.online.add(d.user);
      else g.online.delete(d.user);
      if (msg.group === state.current) renderMembers();
      return;
    default:
      return;
  }
  g.items.push(...added);
  if (msg.group === state.current) {
    renderChat();
    if (g.synced) announce(msg.event === "packet" ? itemText(g, g.items.at(-1)) : added.map((i) => itemText(g, i)).join(". "));
  } else {
    g.unread += 1;
    renderGroups();
  }
}

export function addPacketView(groupId, view) {
  const g = group(groupId);
  if (g.packets.has(view.packet_id)) {
    Object.assign(g.packets.get(view.packet_id), { remaining: view.remaining, mine: view.mine || g.packets.get(view.packet_id).mine });
    return;
  }
  g.packets.set(view.packet_id, { ...view, sender: view.sender_id, finished: view.remaining === 0 });
  g.items.push({ kind: "packet", packet_id: view.packet_id, user: view.sender_id, ms: view.created_ms });
}

export function grabText(g, item) {
  // "Li opened Wang's red packet", "You opened your own red packet", "Li opened your red packet".
  const p = g.packets.get(item.packet_id);
  let whose = "a red packet";
  if (p && p.sender === item.user) whose = item.user === me() ? "your own red packet" : "their own red packet";
  else if (p && p.sender === me()) whose = "your red packet";
  else if (p) whose = `${nameOf(p.sender)}'s red packet`;
  const left = p ? ` · ${item.remaining} of ${p.count} left` : "";
  return `${nameOf(item.user)} opened ${whose}${left}`;
}

export function itemText(g, item) {
  // Names are looked up when shown: a member's name may load after the event that names them.
  switch (item.kind) {
    case "grab":
      return grabText(g, item);
    case "chat":
      return `${nameOf(item.user)}: ${item.text}`;
    case "packet": {
      const p = g.packets.get(item.packet_id);
      return `${nameOf(item.user)} sent a red packet: ${p.greeting || "Best wishes!"}`;
    }
    default:
      return item.user === undefined ? item.text : `${nameOf(item.user)} ${item.text}`;
  }
}

let announceTimer = null;

export function announce(text) {
  // Only the new line goes to the live region: re-rendering the room must not read it all out again.
  const box = $("announcer");
  box.textContent = "";
  clearTimeout(announceTimer);
  announceTimer = setTimeout(() => (box.textContent = text), 50);
}
