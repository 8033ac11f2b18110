// The redpacket demo page: plain JavaScript, no build step, an ES module. It talks to the hub through the
// JavaScript client (clients/js, served at /client/: the socket in JSON mode, reconnection, sync from the
// last offset of each group, requests by id; docs/protocol.md) and the HTTP API for what is not live.
import { RedPacketClient, verifyPacket } from "/client/redpacket.js";

const $ = (id) => document.getElementById(id);
const phone = window.matchMedia("(max-width: 700px)");

// ---- words: what people see instead of error codes ------------------------------------------------------

const listOf = (names) => (names.length < 2 ? names.join("") : `${names.slice(0, -1).join(", ")} and ${names.at(-1)}`);

// A message, or a function of the error's extra fields (`limit`, `names`: docs/protocol.md).
const MESSAGES = {
  insufficient_funds: "Not enough balance for this packet. Add demo money first.",
  not_member: "You are not a member of this group.",
  not_admin: "Only the group's admins can send red packets here.",
  not_target: "This red packet is for someone else.",
  packet_expired: "This red packet has expired.",
  packet_empty: "Too slow, all grabbed.",
  packet_not_found: "This red packet is no longer available.",
  rate_limited: "You are going too fast. Wait a moment and try again.",
  blocked: "Grabbing is paused for your account for now.",
  amount_invalid: "Enter an amount such as 8.88.",
  amount_too_large: (e) => `A red packet holds at most ${yuan(e.limit ?? state.limits.max_total_cents)}.`,
  count_invalid: "Enter how many people can grab it (at least 1).",
  count_too_large: (e) => {
    const limit = e.limit ?? state.limits.max_count;
    return limit < state.limits.max_count
      ? `At most ${shares(limit)}: one for each member of the group.`
      : `At most ${shares(limit)} in one red packet.`;
  },
  count_exceeds_amount: "Every share needs at least ¥0.01: lower the number of shares.",
  equal_not_divisible: "Equal shares must split exactly: change the amount or the number of shares.",
  greeting_too_long: (e) => `The greeting is too long (${e.limit ?? state.limits.max_greeting_chars} characters at most).`,
  greeting_invalid: "The greeting may not contain control characters or direction overrides.",
  text_invalid: "A message is 1 to 2,000 characters.",
  user_not_found: (e) =>
    e.names?.length
      ? `No one called ${listOf(e.names)} has used redpacket yet. Each person must log in once before an ` +
        "admin can add them; nobody was added."
      : "There is no such user.",
  name_invalid: "A name is 1 to 64 characters, with no control or invisible characters.",
  disabled: "That is switched off on this server.",
  redis_unavailable: "The service is busy. Try again in a moment.",
  database_unavailable: "The service is busy. Try again in a moment.",
  idempotency_key_reused: "That request was already made with other details.",
  offline: "You are offline. Wait until the connection is back.",
  timeout: "No answer from the server. Try again in a moment.",
};

function say(err) {
  const m = MESSAGES[err.code];
  if (typeof m === "function") return m(err.details || {});
  return m || err.message || "Something went wrong. Please try again.";
}

class ApiError extends Error {
  constructor(code, message, details = {}) {
    super(message);
    this.code = code;
    this.details = details;
  }
}

function apiError(error) {
  const { code, message, ...details } = error || {};
  return new ApiError(code || "internal", message || "", details);
}

// ---- money: integer cents everywhere; yuan only on screen --------------------------------------------

function yuan(cents) {
  const sign = cents < 0 ? "-" : "";
  const c = Math.abs(cents);
  return `${sign}¥${Math.floor(c / 100)}.${String(c % 100).padStart(2, "0")}`;
}

function parseCents(text) {
  // "8", "8.8", "8.88" → cents, without floating point.
  const m = /^\s*(\d{1,7})(?:\.(\d{1,2}))?\s*$/.exec(text);
  if (!m) return null;
  return Number(m[1]) * 100 + Number((m[2] || "").padEnd(2, "0"));
}

const shares = (n) => `${n} share${n === 1 ? "" : "s"}`;

const uuid = () => (crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`.slice(0, 60));

// ---- time: the hub's clock (an event's offset is its time, docs/protocol.md), shown in the reader's ---

const serverNow = () => Date.now() + state.skewMs;
const offsetMs = (offset) => Number(String(offset).split("-")[0]);

function when(ms) {
  // "10:31", "yesterday 10:31", "tomorrow 10:31", or "3 Jan 10:31".
  const d = new Date(ms);
  const clock = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  const day = (x) => new Date(x.getFullYear(), x.getMonth(), x.getDate()).getTime();
  const days = Math.round((day(d) - day(new Date())) / 86_400_000);
  if (days === 0) return clock;
  if (days === -1) return `yesterday ${clock}`;
  if (days === 1) return `tomorrow ${clock}`;
  return `${d.toLocaleDateString([], { day: "numeric", month: "short" })} ${clock}`;
}

const timeEl = (ms) => el("time", { datetime: new Date(ms).toISOString(), title: new Date(ms).toLocaleString() }, when(ms));

// ---- state ---------------------------------------------------------------------------------------------

const state = {
  token: sessionStorage.getItem("rp.token"),
  me: null, // {user_id, name, balance, groups}
  groups: new Map(), // id (every id is its decimal string: redpacket.v2) → {info, offset, members: Map id→{name, role}, online: Set, items: [], packets: Map, unread}
  current: null,
  client: null, // the RedPacketClient of this log-in
  connState: "offline",
  everOnline: false,
  shownBefore: 0, // lines of the rooms before a welcome's sync: what it filled in is the difference
  names: new Map(), // user id → name, across groups
  skewMs: 0, // the hub's clock minus this browser's, from the welcome
  limits: { max_count: 100, max_total_cents: 20_000, max_greeting_chars: 64, packet_ttl_seconds: 86_400 },
  shown: { group: null, packet: null }, // the packet in the packet sheet
  expiryTimer: null,
};
window.state = state; // a module's names are its own: the console (and the tests) look at the page's state

function group(id) {
  let g = state.groups.get(id);
  if (!g) {
    g = { info: { group_id: id, name: `group ${id}`, role: "member" }, members: new Map(),
      online: new Set(), items: [], packets: new Map(), unread: 0, synced: false };
    state.groups.set(id, g);
  }
  return g;
}

const me = () => state.me?.user_id;
const nameOf = (user) => (user === me() ? "You" : state.names.get(user) || `user ${user}`);

// ---- HTTP ----------------------------------------------------------------------------------------------

async function api(method, path, body) {
  // Ids as strings, as the websocket's (redpacket.v2) are: exact beyond 2^53, and one type for the Maps' keys.
  const headers = { "content-type": "application/json", "redpacket-ids": "string" };
  if (state.token) headers.authorization = `Bearer ${state.token}`;
  let r;
  try {
    r = await fetch(path, { method, headers, body: body ? JSON.stringify(body) : undefined });
  } catch (e) {
    throw new ApiError("offline", String(e));
  }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    if (r.status === 401) logout();
    throw apiError(data.error || { message: r.statusText });
  }
  return data;
}

async function refreshMe() {
  const data = await api("GET", "/api/me");
  const before = state.me?.balance;
  state.me = data;
  state.names.set(data.user_id, data.name);
  for (const info of data.groups) group(info.group_id).info = info;
  for (const id of [...state.groups.keys()]) {
    if (!data.groups.some((g) => g.group_id === id)) state.groups.delete(id);
  }
  $("me-name").textContent = data.name;
  $("balance").textContent = yuan(data.balance);
  if (before !== undefined && before !== data.balance) {
    const b = $("balance").parentElement;
    b.classList.remove("bump");
    void b.offsetWidth;
    b.classList.add("bump");
  }
  renderGroups();
}

async function loadMembers(id) {
  const data = await api("GET", `/api/groups/${id}/members`);
  const g = group(id);
  g.members = new Map(data.members.map((m) => [m.user_id, m]));
  for (const m of data.members) state.names.set(m.user_id, m.name);
  if (id === state.current) renderMembers();
}

// ---- the websocket -------------------------------------------------------------------------------------

function setConn(s) {
  state.connState = s;
  const badge = $("conn");
  badge.dataset.state = s;
  badge.textContent = { connecting: "Connecting…", online: "Online", reconnecting: "Reconnecting…", offline: "Offline" }[s];
  $("missed").hidden = s !== "reconnecting";
  $("missed").textContent = "Connection lost. Reconnecting… what happens meanwhile will be filled in.";
  for (const c of $("composer").querySelectorAll("input, button")) c.disabled = s !== "online";
}

function device() {
  let d = localStorage.getItem("rp.device");
  if (!d) {
    d = uuid().slice(0, 32);
    localStorage.setItem("rp.device", d);
  }
  return d;
}

function connect() {
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

function request(type, fields) {
  if (!state.client) return Promise.reject(new ApiError("offline", "not connected"));
  return state.client.request(type, fields);
}

const shownLines = () => [...state.groups.values()].reduce((n, g) => n + g.items.length, 0);

// The client awaits this after each welcome, before it syncs (the hub holds the groups' events until then).
async function onWelcome(msg) {
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
function onSynced({ groups, reason }) {
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
function onReset({ group: id, packets, tooOld, previous }) {
  const g = group(id);
  if (tooOld && previous) {
    g.items.push({ kind: "system", text: "Some older messages could not be loaded; here is what is open now." });
  }
  for (const view of packets) addPacketView(id, view);
}

function presence(id) {
  request("presence", { group: id })
    .then((data) => {
      group(id).online = new Set(data.online);
      if (id === state.current) renderMembers();
    })
    .catch(() => {});
}

// The grabs a grabs event (or a big room's finished event) lists. A big room lists only the latest
// grabs of an interval: "more" says how many it left out.
function addGrabs(g, d, ms, added) {
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

function onEvent(msg) {
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

function addPacketView(groupId, view) {
  const g = group(groupId);
  if (g.packets.has(view.packet_id)) {
    Object.assign(g.packets.get(view.packet_id), { remaining: view.remaining, mine: view.mine || g.packets.get(view.packet_id).mine });
    return;
  }
  g.packets.set(view.packet_id, { ...view, sender: view.sender_id, finished: view.remaining === 0 });
  g.items.push({ kind: "packet", packet_id: view.packet_id, user: view.sender_id, ms: view.created_ms });
}

// ---- what a line of the room says ---------------------------------------------------------------------

function grabText(g, item) {
  // "Li opened Wang's red packet", "You opened your own red packet", "Li opened your red packet".
  const p = g.packets.get(item.packet_id);
  let whose = "a red packet";
  if (p && p.sender === item.user) whose = item.user === me() ? "your own red packet" : "their own red packet";
  else if (p && p.sender === me()) whose = "your red packet";
  else if (p) whose = `${nameOf(p.sender)}'s red packet`;
  const left = p ? ` · ${item.remaining} of ${p.count} left` : "";
  return `${nameOf(item.user)} opened ${whose}${left}`;
}

function itemText(g, item) {
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
function announce(text) {
  // Only the new line goes to the live region: re-rendering the room must not read it all out again.
  const box = $("announcer");
  box.textContent = "";
  clearTimeout(announceTimer);
  announceTimer = setTimeout(() => (box.textContent = text), 50);
}

// ---- rendering -----------------------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== null && v !== undefined && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function renderGroups() {
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

function selectGroup(id) {
  state.current = id;
  $("app").dataset.view = id === null ? "groups" : "chat";
  if (id !== null) group(id).unread = 0;
  $("add-error").textContent = "";
  layoutMembers(false);
  renderGroups();
  renderChat();
}

function layoutMembers(open) {
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

const expired = (p) => Boolean(p.expires_ms) && serverNow() > p.expires_ms;

// An exclusive packet whose target is someone else (a packet known only from a sync has no target).
const forSomeoneElse = (p) => p.kind === "exclusive" && Boolean(p.target) && p.target !== me();

function grabbable(p) {
  // A packet that opens to its card (開) rather than straight to its result.
  if (p.mine || p.remaining === 0 || p.finished || expired(p)) return false;
  return !forSomeoneElse(p);
}

function packetState(p) {
  if (p.mine) return `You got ${yuan(p.mine.amount)}`;
  if (p.remaining === 0) return "All grabbed";
  if (expired(p)) return "Expired";
  if (forSomeoneElse(p)) return `For ${nameOf(p.target)}`;
  return "Tap to open";
}

function renderChat() {
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

function packetBubble(groupId, p) {
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

function renderMembers() {
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
function toast(text) {
  const t = $("toast");
  t.textContent = text;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (t.hidden = true), 3500);
}

function showError(e) {
  toast(say(e));
}

// ---- the packet sheet: its card (sender, greeting, 開), then its result (amount, who got how much) ------

// Refusals that are the packet's answer (shown as its result); any other leaves the card up to try again.
const FINAL_REFUSALS = ["packet_empty", "packet_expired", "not_target", "packet_not_found"];

function fromLine(sender) {
  return sender === me() ? "Your red packet" : `${nameOf(sender)}'s red packet`;
}

async function openPacket(groupId, packetId) {
  const p = group(groupId).packets.get(packetId);
  if (!p) return;
  state.shown = { group: groupId, packet: packetId };
  if (grabbable(p)) showCard(p);
  else await showResult(groupId, packetId, null);
}

function showCard(p) {
  const dlg = $("packet-dialog");
  dlg.dataset.face = "card";
  $("pd-from").textContent = fromLine(p.sender);
  $("pd-greeting").textContent = p.greeting || "Best wishes!";
  $("pd-amount").textContent = "";
  $("pd-note").textContent = "";
  $("pd-expiry").textContent = p.expires_ms ? `Open before ${when(p.expires_ms)}` : "";
  setOpening(p.grabbing);
  if (!dlg.open) dlg.showModal();
  $("pd-open").focus();
}

function setOpening(on) {
  // The coin spins while the grab is in flight. It stays enabled (a disabled button would drop keyboard
  // focus); a second press meanwhile is ignored.
  const coin = $("pd-open");
  coin.classList.toggle("spinning", Boolean(on));
  coin.setAttribute("aria-busy", String(Boolean(on)));
}

async function pressOpen() {
  const { group: groupId, packet: packetId } = state.shown;
  const p = groupId === null ? null : group(groupId).packets.get(packetId);
  if (!p || p.grabbing) return;
  p.grabbing = true;
  setOpening(true);
  $("pd-note").textContent = "";
  renderChat();
  let won = null;
  let refusal = null;
  try {
    const r = await request("grab", { group: groupId, packet: packetId });
    p.mine = { amount: r.amount };
    p.remaining = Math.min(p.remaining, r.remaining);
    if (r.outcome === "won") won = r;
  } catch (e) {
    if (e.code === "packet_empty") p.remaining = 0;
    refusal = e;
  } finally {
    p.grabbing = false;
    renderChat();
  }
  const stillShown = $("packet-dialog").open && state.shown.packet === packetId;
  if (stillShown) setOpening(false);
  if (won) waitForCredit(packetId, won.amount);
  if (!stillShown) {
    if (refusal && !FINAL_REFUSALS.includes(refusal.code)) showError(refusal);
    return;
  }
  if (refusal && !FINAL_REFUSALS.includes(refusal.code)) {
    $("pd-note").textContent = say(refusal);
    return;
  }
  await showResult(groupId, packetId, refusal);
}

async function showResult(groupId, packetId, refusal) {
  // The commitment the page's client heard before the seed was shown (the send reply, the packet event,
  // a view while active): what binds the revealed seed to the send (docs/protocol.md, "Keep the commitment").
  const kept = state.client?.commitment(packetId);
  let view;
  try {
    view = await request("open", { group: groupId, packet: packetId });
  } catch (e) {
    if ($("packet-dialog").open) $("pd-note").textContent = say(e);
    else showError(e);
    return;
  }
  const p = group(groupId).packets.get(packetId);
  if (p && view.mine) p.mine = { amount: view.mine.amount };
  const done = view.duration_ms !== null && view.duration_ms !== undefined;
  const over = !done && serverNow() > view.expires_ms;
  let note = "";
  if (view.mine) note = "Goes to your balance";
  else if (refusal) note = say(refusal);
  else if (p && forSomeoneElse(p)) note = say({ code: "not_target" });
  else if (over) note = say({ code: "packet_expired" });
  else if (view.remaining === 0 && view.sender_id !== me()) note = say({ code: "packet_empty" });
  $("pd-from").textContent = fromLine(view.sender_id);
  $("pd-greeting").textContent = view.greeting || "Best wishes!";
  $("pd-amount").textContent = view.mine ? yuan(view.mine.amount) : "";
  $("pd-note").textContent = note;
  const owner = view.sender_id === me() ? "you" : nameOf(view.sender_id);
  const left = view.remaining;
  $("pd-expiry").textContent = done ? ""
    : over ? `Expired ${when(view.expires_ms)}: the ${shares(left)} left go back to ${owner}.`
    : `Shares not opened by ${when(view.expires_ms)} go back to ${owner}.`;
  $("pd-summary").textContent = done
    ? `${shares(view.count)}, ${yuan(view.total)}, all grabbed in ${(view.duration_ms / 1000).toFixed(1)} s`
    : `${view.grabs.length} of ${shares(view.count)} grabbed, ${yuan(view.total)} in all`;
  // Best luck means something only where amounts were left to luck.
  const best = done && view.best_luck && view.kind === "lucky" && view.count > 1 ? view.best_luck.user_id : null;
  $("pd-grabs").replaceChildren(...view.grabs.map((gr) => el("li", { "data-user": gr.user_id },
    el("span", {}, nameOf(gr.user_id), timeEl(gr.grabbed_ms)),
    el("span", {}, yuan(gr.amount), gr.user_id === best ? el("span", { class: "best" }, "★ Best luck") : null))));
  showFairness(view, kept, done || over);
  const dlg = $("packet-dialog");
  dlg.dataset.face = "result";
  if (!dlg.open) dlg.showModal();
  $("packet-close").focus();
}

// Provably fair packets (docs/protocol.md): once a packet is finished or refunded its view reveals the seed
// its shares were drawn from, and the client recomputes them here, in the browser, and checks the view's
// commitment against the one the page kept from before the seed was shown. "fair ✓", or "fair ✗ mismatch"
// with what is wrong; "not verifiable" for a packet sent before packets were provably fair. A page that
// never heard of the packet while it was active (opened after it finished) kept none: "fair ✓" then says
// in its proof that the commitment was checked against the one shown now only.
const FAIR_WORDS = { verified: "fair ✓", mismatch: "fair ✗ mismatch" };

function fairText(verdict) {
  if (verdict.status !== "verified") return "Checked here, the packet's proof does not hold:";
  const drawn = "Recomputed here from this seed, the shares match every grab, in order.";
  if (verdict.againstSend) {
    return "The shares were drawn at send from this seed: its SHA-256, the commitment, is the one this page" +
      ` received before the seed was shown. ${drawn}`;
  }
  return `${drawn} This page did not see the packet sent, so the commitment was checked against the one` +
    " shown now only: compare it with the one published at send.";
}

function showFairness(view, kept, settled) {
  const box = $("pd-fair");
  const proof = $("pd-proof");
  proof.hidden = true;
  proof.replaceChildren();
  box.replaceChildren();
  let verdict;
  try {
    verdict = verifyPacket(view, kept);
  } catch (e) {
    verdict = { status: "mismatch", problems: [`the packet view cannot be checked: ${e.message}`], shares: [],
      againstSend: kept !== undefined };
  }
  // Nothing to say while the packet is active (or its refund is not closed yet): the seed is still secret.
  box.hidden = verdict.status === "not_revealed" || (verdict.status === "not_verifiable" && !settled);
  if (box.hidden) return;
  if (verdict.status === "not_verifiable") {
    box.append(el("span", { class: "fair-muted", title: "Sent before packets were provably fair" }, "not verifiable"));
    return;
  }
  const ok = verdict.status === "verified";
  const toggle = el("button", { type: "button", class: `fair-badge ${ok ? "ok" : "bad"}`, "aria-expanded": "false",
    "aria-controls": "pd-proof", "aria-label": `${FAIR_WORDS[verdict.status]}: show the proof`,
    "data-against-send": String(verdict.againstSend) }, FAIR_WORDS[verdict.status]);
  toggle.addEventListener("click", () => {
    proof.hidden = !proof.hidden;
    toggle.setAttribute("aria-expanded", String(!proof.hidden));
  });
  box.append(toggle);
  const code = (text) => el("code", {}, String(text));
  proof.append(
    el("p", { class: verdict.againstSend ? "" : "unkept" }, fairText(verdict)),
    el("ul", { class: "problems" }, ...verdict.problems.map((x) => el("li", {}, x))),
    el("dl", {},
      el("dt", {}, "Seed"), el("dd", { class: "seed" }, code(view.seed)),
      el("dt", {}, "Commitment shown now"), el("dd", { class: "commitment" }, code(view.commitment)),
      el("dt", {}, "Commitment received before the seed"),
      el("dd", { class: "kept" }, kept === undefined ? "none: this page did not see the packet sent" : code(kept)),
      el("dt", {}, "Shares in order"), el("dd", { class: "shares" }, verdict.shares.map(yuan).join(" · ") || "—")));
}

async function waitForCredit(packetId, amount) {
  // The worker credits the grab into the ledger a moment later; show the balance when it has.
  for (let i = 0; i < 120; i++) {
    await new Promise((r) => setTimeout(r, 500));
    try {
      const detail = await api("GET", `/api/packets/${packetId}`);
      const mine = detail.grabs.find((x) => x.user_id === me());
      if (mine && mine.status === "credited") {
        await refreshMe();
        toast(`${yuan(amount)} landed in your balance`);
        return;
      }
    } catch {
      // offline for a moment: keep waiting
    }
  }
}

// ---- actions -------------------------------------------------------------------------------------------

async function sendPacket(ev) {
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

async function sendChat(ev) {
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

async function makeAdmin(uid) {
  try {
    await api("POST", `/api/groups/${state.current}/admins/${uid}`);
  } catch (e) {
    showError(e);
  }
}

async function removeMember(uid) {
  try {
    await api("DELETE", `/api/groups/${state.current}/members/${uid}`);
  } catch (e) {
    showError(e);
  }
}

async function login(name) {
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

function logout() {
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

function start() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("app").dataset.view = "groups";
  renderGroups();
  renderChat();
  connect();
}

const STATUS = { credited: "in your balance", grabbed: "on its way" };
const SENT_STATUS = { finished: "all paid out", refunding: "expired, refund under way", refunded: "expired, the rest refunded" };

async function showHistory() {
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

function openSendDialog() {
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

function kindChanged() {
  // "For one person": one share, for a member picked from the group.
  const exclusive = document.querySelector('input[name="kind"]:checked').value === "exclusive";
  $("send-count-row").hidden = exclusive;
  $("send-count-hint").hidden = exclusive;
  $("send-target-row").hidden = !exclusive;
}

// ---- wiring --------------------------------------------------------------------------------------------

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  login($("login-name").value.trim());
});
for (const name of ["alice", "bob", "carol", "dave"]) {
  $("quick-names").append(el("button", { class: "small", type: "button", onclick: () => login(name) }, name));
}
$("logout").addEventListener("click", logout);
$("back").addEventListener("click", () => selectGroup(null));
$("composer").addEventListener("submit", sendChat);
$("open-send").addEventListener("click", openSendDialog);
for (const radio of document.querySelectorAll('input[name="kind"]')) radio.addEventListener("change", kindChanged);
$("send-cancel").addEventListener("click", () => $("send-dialog").close());
$("send-form").addEventListener("submit", sendPacket);
$("pd-open").addEventListener("click", pressOpen);
$("packet-close").addEventListener("click", () => $("packet-dialog").close());
$("packet-dialog").addEventListener("close", () => {
  // Back to the packet's bubble (drawn anew since it was pressed), for the keyboard.
  const id = state.shown.packet;
  state.shown = { group: null, packet: null };
  if (id !== null) document.querySelector(`#messages .packet[data-packet="${id}"]`)?.focus();
});
$("my-packets").addEventListener("click", showHistory);
$("history-close").addEventListener("click", () => $("history-dialog").close());
$("members-toggle").addEventListener("click", () => layoutMembers($("members-pane").hidden));
$("members-close").addEventListener("click", () => layoutMembers(false));
$("scrim").addEventListener("click", () => layoutMembers(false));
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && phone.matches && !$("members-pane").hidden && !document.querySelector("dialog[open]")) {
    layoutMembers(false);
  }
});
phone.addEventListener("change", () => layoutMembers(false));
$("topup").addEventListener("click", async () => {
  try {
    await api("POST", "/api/topup", { amount: 10_000, request_id: uuid() });
    await refreshMe();
    toast("¥100.00 of demo money added");
  } catch (e) {
    showError(e);
  }
});
$("new-group").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const data = await api("POST", "/api/groups", { name: $("new-group-name").value.trim(),
      members_can_send: $("new-group-open").checked });
    $("new-group").reset();
    await refreshMe();
    selectGroup(data.group_id);
  } catch (e) {
    showError(e);
  }
});
$("add-member").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const names = $("add-names").value.split(",").map((s) => s.trim()).filter(Boolean);
  try {
    $("add-error").textContent = "";
    await api("POST", `/api/groups/${state.current}/members`, { names });
    $("add-names").value = "";
    await loadMembers(state.current);
  } catch (e) {
    $("add-error").textContent = say(e);
  }
});

if (state.token) start();
else $("login").hidden = false;
