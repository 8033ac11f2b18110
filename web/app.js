// The redpacket demo page: plain JavaScript, no build step. It speaks the hub's websocket protocol in
// JSON mode (subprotocol redpacket.v1.json, docs/protocol.md) and the HTTP API for what is not live.
"use strict";

const $ = (id) => document.getElementById(id);
const SUBPROTOCOL = "redpacket.v1.json";

// What people see instead of error codes.
const MESSAGES = {
  insufficient_funds: "Not enough balance for this packet. Add demo money first.",
  not_member: "You are not a member of this group.",
  not_admin: "Only the group's admins can send red packets here.",
  not_target: "This red packet is for someone else.",
  packet_expired: "This red packet has expired.",
  packet_empty: "Too late: every share has been taken.",
  packet_not_found: "This red packet is no longer available.",
  rate_limited: "You are going too fast. Wait a moment and try again.",
  blocked: "Grabbing is paused for your account for now.",
  amount_invalid: "Enter an amount such as 8.88.",
  amount_too_large: "That is more than one red packet may hold.",
  count_invalid: "Enter how many people can grab it (at least 1).",
  count_too_large: "More shares than there are people in the group.",
  count_exceeds_amount: "Every share needs at least ¥0.01: lower the number of shares.",
  equal_not_divisible: "Equal shares must split exactly: change the amount or the number of shares.",
  greeting_too_long: "The greeting is too long (64 characters at most).",
  greeting_invalid: "The greeting may not contain control characters or direction overrides.",
  text_invalid: "A message is 1 to 2,000 characters.",
  user_not_found: "There is no user with that name.",
  name_invalid: "A name is 1 to 64 characters, with no control or invisible characters.",
  disabled: "That is switched off on this server.",
  redis_unavailable: "The service is busy. Try again in a moment.",
  database_unavailable: "The service is busy. Try again in a moment.",
  idempotency_key_reused: "That request was already made with other details.",
  offline: "You are offline. Wait until the connection is back.",
};
const say = (code, fallback) => MESSAGES[code] || fallback || "Something went wrong. Please try again.";

class ApiError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
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

// ---- state ---------------------------------------------------------------------------------------------

const state = {
  token: sessionStorage.getItem("rp.token"),
  me: null, // {user_id, name, balance, groups}
  groups: new Map(), // id → {info, offset, members: Map id→{name, role}, online: Set, items: [], packets: Map, unread}
  current: null,
  ws: null,
  connState: "offline",
  everOnline: false,
  nextId: 1,
  pending: new Map(),
  retryMs: 500,
  retryTimer: null,
  names: new Map(), // user id → name, across groups
};

function group(id) {
  let g = state.groups.get(id);
  if (!g) {
    g = { info: { group_id: id, name: `group ${id}`, role: "member" }, offset: null, members: new Map(),
      online: new Set(), items: [], packets: new Map(), unread: 0, synced: false };
    state.groups.set(id, g);
  }
  return g;
}

const nameOf = (user) => (user === state.me?.user_id ? "You" : state.names.get(user) || `user ${user}`);

// ---- HTTP ----------------------------------------------------------------------------------------------

async function api(method, path, body) {
  const headers = { "content-type": "application/json" };
  if (state.token) headers.authorization = `Bearer ${state.token}`;
  let r;
  try {
    r = await fetch(path, { method, headers, body: body ? JSON.stringify(body) : undefined });
  } catch (e) {
    throw new ApiError("offline", String(e));
  }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const err = data.error || {};
    if (r.status === 401) logout();
    throw new ApiError(err.code || "internal", err.message || r.statusText);
  }
  return data;
}

async function refreshMe() {
  const me = await api("GET", "/api/me");
  const before = state.me?.balance;
  state.me = me;
  state.names.set(me.user_id, me.name);
  for (const info of me.groups) group(info.group_id).info = info;
  for (const id of [...state.groups.keys()]) {
    if (!me.groups.some((g) => g.group_id === id)) state.groups.delete(id);
  }
  $("me-name").textContent = me.name;
  $("balance").textContent = yuan(me.balance);
  if (before !== undefined && before !== me.balance) {
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
  const el = $("conn");
  el.dataset.state = s;
  el.textContent = { connecting: "Connecting…", online: "Online", reconnecting: "Reconnecting…", offline: "Offline" }[s];
  $("missed").hidden = s !== "reconnecting";
  $("missed").textContent = "Connection lost. Reconnecting… what happens meanwhile will be filled in.";
  const composer = $("composer");
  for (const el of composer.querySelectorAll("input, button")) el.disabled = s !== "online";
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
  clearTimeout(state.retryTimer);
  setConn(state.everOnline ? "reconnecting" : "connecting");
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${proto}//${location.host}/ws?token=${encodeURIComponent(state.token)}&device=${device()}`;
  const ws = new WebSocket(url, [SUBPROTOCOL]);
  state.ws = ws;
  ws.onmessage = (e) => {
    let msg;
    try {
      msg = JSON.parse(e.data);
    } catch {
      return;
    }
    onMessage(msg);
  };
  ws.onclose = (e) => {
    if (state.ws !== ws) return;
    state.ws = null;
    for (const p of state.pending.values()) p.reject(new ApiError("offline", "connection lost"));
    state.pending.clear();
    if (e.code === 4001) {
      logout();
      return;
    }
    if (!state.token) return;
    setConn("reconnecting");
    // Back off, with jitter, up to 10 s; the hub says 1012 when it restarts: come back soon.
    const wait = e.code === 1012 ? 200 : state.retryMs;
    state.retryMs = Math.min(10_000, state.retryMs * 2);
    state.retryTimer = setTimeout(connect, wait * (0.75 + Math.random() / 2));
  };
}

function request(type, fields) {
  return new Promise((resolve, reject) => {
    const ws = state.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN || state.connState !== "online") {
      reject(new ApiError("offline", "not connected"));
      return;
    }
    const id = state.nextId++;
    state.pending.set(id, { resolve, reject });
    ws.send(JSON.stringify({ id, type, ...fields }));
  });
}

function onMessage(msg) {
  switch (msg.type) {
    case "welcome":
      onWelcome(msg);
      break;
    case "reply": {
      const p = state.pending.get(msg.id);
      if (!p) return;
      state.pending.delete(msg.id);
      if (msg.ok) p.resolve(msg.data);
      else p.reject(new ApiError(msg.error.code, msg.error.message));
      break;
    }
    case "event":
      onEvent(msg);
      break;
    case "added":
      refreshMe().then(() => syncGroups([msg.group])).catch(showError);
      break;
    case "removed":
      state.groups.delete(msg.group);
      if (state.current === msg.group) selectGroup(null);
      toast("You were removed from a group.");
      refreshMe().catch(showError);
      break;
    case "gap":
      syncGroups([msg.group]).catch(showError);
      break;
  }
}

async function onWelcome(msg) {
  for (const info of msg.groups) group(info.group_id).info = { ...group(info.group_id).info, ...info };
  const reconnect = state.everOnline;
  state.everOnline = true;
  state.retryMs = 500;
  setConn("online");
  try {
    await refreshMe();
    const missed = await syncGroups(msg.groups.map((g) => g.group_id));
    if (reconnect) {
      toast(missed > 0 ? `Back online: ${missed} missed update${missed === 1 ? "" : "s"} filled in.` : "Back online.");
    }
    if (state.current === null && state.groups.size && window.innerWidth > 700) selectGroup([...state.groups.keys()][0]);
    else if (state.current !== null) renderChat();
  } catch (e) {
    showError(e);
  }
}

async function syncGroups(ids) {
  // A group seen before: what was missed since its last offset. A new one: its recent history ("0-0").
  const wanted = {};
  for (const id of ids) wanted[String(id)] = group(id).offset || "0-0";
  const shown = () => ids.reduce((n, id) => n + group(id).items.length, 0);
  const before = shown();
  // Replayed events arrive (and are shown) before this reply.
  const data = await request("sync", { groups: wanted });
  for (const [key, res] of Object.entries(data.groups)) {
    const g = group(Number(key));
    if (res.error) continue;
    if (res.too_old) {
      // The hub no longer holds everything since our offset: start again from its open packets.
      if (g.offset) {
        g.items.push({ kind: "system", text: "Some older messages could not be loaded; here is what is open now." });
      }
      for (const view of res.packets || []) addPacketView(Number(key), view);
      g.offset = res.offset;
    }
    if (!g.synced) {
      g.synced = true;
      g.unread = 0;
    }
    loadMembers(Number(key)).catch(() => {});
    presence(Number(key));
  }
  renderGroups();
  if (state.current !== null) renderChat();
  return shown() - before; // what the reader sees that is new: presence comings and goings not counted
}

function presence(id) {
  request("presence", { group: id })
    .then((data) => {
      group(id).online = new Set(data.online);
      if (id === state.current) renderMembers();
    })
    .catch(() => {});
}

function newer(a, b) {
  // Offsets compare as (milliseconds, sequence) pairs.
  if (!b) return true;
  const [am, as] = a.split("-").map(Number);
  const [bm, bs] = b.split("-").map(Number);
  return am > bm || (am === bm && as > bs);
}

function onEvent(msg) {
  const g = group(msg.group);
  if (!newer(msg.offset, g.offset)) return;
  g.offset = msg.offset;
  const d = msg.data;
  switch (msg.event) {
    case "chat":
      g.items.push({ kind: "chat", user: d.user, text: d.text });
      break;
    case "packet":
      addPacketView(msg.group, { packet_id: d.packet_id, sender_id: d.sender, kind: d.kind, total: d.total, target: d.target,
        count: d.count, greeting: d.greeting, remaining: d.count, expires_ms: d.expires_ms, grabs: [], mine: null });
      break;
    case "grabs":
      // A big room lists only the latest grabs of an interval: "more" says how many it left out.
      if (d.more) g.items.push({ kind: "system", text: `${d.more} more ${d.more === 1 ? "person" : "people"} grabbed a red packet` });
      for (const [pid, left] of Object.entries(d.remaining || {})) {
        const p = g.packets.get(Number(pid));
        if (p) p.remaining = Math.min(p.remaining, left);
      }
      for (const x of d.grabs) {
        const p = g.packets.get(x.packet_id);
        if (p) p.remaining = Math.min(p.remaining, x.remaining);
        if (p && x.user === state.me?.user_id) p.mine = p.mine || { amount: x.amount };
        const count = p ? p.count : "?";
        g.items.push({ kind: "system", user: x.user, text: `grabbed a red packet, ${x.remaining} of ${count} left` });
      }
      break;
    case "finished": {
      const p = g.packets.get(d.packet_id);
      if (p) {
        p.remaining = 0;
        p.finished = true;
      }
      const secs = (d.duration_ms / 1000).toFixed(1);
      const best = d.best_luck ? ` · best luck: ${nameOf(d.best_luck.user)} (${yuan(d.best_luck.amount)})` : "";
      g.items.push({ kind: "system", luck: true, text: `All ${shares(d.count)} grabbed in ${secs} s${best}` });
      break;
    }
    case "member_added":
    case "member_removed":
    case "member_role": {
      const what = { member_added: "joined the group", member_removed: "left the group", member_role: "is now an admin" }[msg.event];
      g.items.push({ kind: "system", user: d.user, text: what });
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
  if (msg.group === state.current) renderChat();
  else {
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
  g.items.push({ kind: "packet", packet_id: view.packet_id, user: view.sender_id });
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
    list.append(el("li", {},
      el("button", { "aria-current": String(id === state.current), "data-group": id, onclick: () => selectGroup(id) },
        el("span", {}, g.info.name, " ", el("span", { class: "role" }, g.info.role === "admin" ? "admin" : "")),
        g.unread ? el("span", { class: "unread" }, String(g.unread)) : null)));
  }
  $("no-groups").hidden = state.groups.size > 0;
}

function selectGroup(id) {
  state.current = id;
  $("app").dataset.view = id === null ? "groups" : "chat";
  if (id !== null) group(id).unread = 0;
  // Desktop shows the members beside the chat; a phone opens them with the Members button.
  $("members-pane").hidden = id === null || window.innerWidth <= 700;
  renderGroups();
  renderChat();
}

function packetState(p) {
  if (p.mine) return `You got ${yuan(p.mine.amount)}`;
  if (p.remaining === 0) return "All grabbed";
  if (p.expires_ms && Date.now() > p.expires_ms) return "Expired";
  return "Tap to open";
}

function renderChat() {
  const id = state.current;
  const g = id === null ? null : state.groups.get(id);
  $("group-title").textContent = g ? g.info.name : "Pick a group";
  $("composer").hidden = !g;
  $("members-toggle").hidden = !g;
  if (!g) {
    $("members-pane").hidden = true;
    $("messages").replaceChildren();
    return;
  }
  const canSend = g.info.role === "admin" || g.info.members_can_send;
  $("open-send").hidden = !canSend;
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  list.replaceChildren();
  for (const item of g.items) {
    if (item.kind === "system") {
      // Names are looked up when shown: a member's name may load after the event that names them.
      const text = item.user === undefined ? item.text : `${nameOf(item.user)} ${item.text}`;
      list.append(el("li", { class: "system" }, el("span", { class: item.luck ? "luck" : "" }, text)));
      continue;
    }
    const mine = item.user === state.me?.user_id;
    const li = el("li", { class: mine ? "mine" : "" }, el("span", { class: "author" }, nameOf(item.user)));
    if (item.kind === "chat") li.append(el("div", { class: "bubble" }, item.text));
    else li.append(packetBubble(id, g.packets.get(item.packet_id)));
    list.append(li);
  }
  if (atBottom || list.dataset.group !== String(id)) list.scrollTop = list.scrollHeight;
  list.dataset.group = String(id);
  renderMembers();
}

function packetBubble(groupId, p) {
  const cls = ["packet"];
  if (p.mine) cls.push("opened");
  else if (p.remaining === 0) cls.push("gone");
  if (p.grabbing) cls.push("grabbing");
  return el("button", { class: cls.join(" "), "data-packet": p.packet_id, onclick: () => openPacket(groupId, p.packet_id) },
    el("div", { class: "face" }, el("img", { src: "packet.svg", alt: "" }),
      el("div", {}, el("div", { class: "greeting" }, p.greeting || "Best wishes!"),
        el("div", { class: "state" }, packetState(p)))),
    el("div", { class: "foot" }, p.kind === "exclusive" && p.target
      ? `Red packet · for ${p.target === state.me?.user_id ? "you" : nameOf(p.target)}`
      : `Red packet · ${p.kind === "equal" ? "equal shares" : "lucky"} · ${shares(p.count)}`));
}

function renderMembers() {
  const g = state.current === null ? null : state.groups.get(state.current);
  if (!g) return;
  const list = $("member-list");
  list.replaceChildren();
  for (const [uid, m] of g.members) {
    const admin = g.info.role === "admin" && uid !== state.me.user_id;
    list.append(el("li", { "data-user": uid },
      el("span", { class: `dot${g.online.has(uid) ? " on" : ""}`, title: g.online.has(uid) ? "online" : "offline" }),
      el("span", { class: "name" }, m.name),
      m.role === "admin" ? el("span", { class: "tag" }, "admin") : null,
      admin && m.role !== "admin" ? el("button", { class: "small ghost", onclick: () => makeAdmin(uid) }, "Make admin") : null,
      admin ? el("button", { class: "small ghost", title: "Remove", onclick: () => removeMember(uid) }, "×") : null));
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
  toast(say(e.code, e.message));
}

// ---- actions -------------------------------------------------------------------------------------------

async function openPacket(groupId, packetId) {
  const g = group(groupId);
  const p = g.packets.get(packetId);
  if (!p || p.grabbing) return;
  let won = null;
  let refusal = null;
  if (!p.mine && p.remaining !== 0) {
    p.grabbing = true;
    renderChat();
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
    if (refusal && !["packet_empty", "packet_expired", "not_target"].includes(refusal.code)) {
      showError(refusal);
      return;
    }
  }
  let view;
  try {
    view = await request("open", { group: groupId, packet: packetId });
  } catch (e) {
    showError(e);
    return;
  }
  showPacket(view, refusal);
  if (won) waitForCredit(packetId, won.amount);
}

function showPacket(view, refusal) {
  const mine = view.sender_id === state.me?.user_id;
  $("pd-from").textContent = mine ? "Your red packet" : `${nameOf(view.sender_id)}'s red packet`;
  $("pd-greeting").textContent = view.greeting || "Best wishes!";
  $("pd-amount").textContent = view.mine ? yuan(view.mine.amount) : "";
  $("pd-note").textContent = view.mine ? "Goes to your balance" : refusal ? say(refusal.code) : "";
  const taken = view.grabs.length;
  const done = view.duration_ms !== null && view.duration_ms !== undefined;
  $("pd-summary").textContent = done
    ? `${shares(view.count)}, ${yuan(view.total)}, all grabbed in ${(view.duration_ms / 1000).toFixed(1)} s`
    : `${taken} of ${shares(view.count)} grabbed, ${yuan(view.total)} in all`;
  const best = done && view.best_luck ? view.best_luck.user_id : null;
  const list = $("pd-grabs");
  list.replaceChildren();
  for (const gr of view.grabs) {
    list.append(el("li", { "data-user": gr.user_id },
      el("span", {}, nameOf(gr.user_id), el("time", {}, new Date(gr.grabbed_ms).toLocaleTimeString())),
      el("span", {}, yuan(gr.amount), gr.user_id === best ? el("span", { class: "best" }, "★ Best luck") : null)));
  }
  const dlg = $("packet-dialog");
  if (!dlg.open) dlg.showModal();
}

async function waitForCredit(packetId, amount) {
  // The worker credits the grab into the ledger a moment later; show the balance when it has.
  for (let i = 0; i < 120; i++) {
    await new Promise((r) => setTimeout(r, 500));
    try {
      const detail = await api("GET", `/api/packets/${packetId}`);
      const mine = detail.grabs.find((x) => x.user_id === state.me.user_id);
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

async function sendPacket(ev) {
  ev.preventDefault();
  const err = $("send-error");
  err.textContent = "";
  const kind = document.querySelector('input[name="kind"]:checked').value;
  const total = parseCents($("send-total").value);
  const count = kind === "exclusive" ? 1 : Number($("send-count").value);
  if (total === null || total <= 0) {
    err.textContent = say("amount_invalid");
    return;
  }
  if (!Number.isInteger(count) || count < 1) {
    err.textContent = say("count_invalid");
    return;
  }
  const target = kind === "exclusive" ? Number($("send-target").value) : undefined;
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
    err.textContent = say(e.code, e.message);
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
    $("login-error").textContent = say(e.code, e.message);
  }
}

function logout() {
  state.token = null;
  sessionStorage.removeItem("rp.token");
  const ws = state.ws;
  state.ws = null;
  if (ws) ws.close(1000);
  clearTimeout(state.retryTimer);
  state.groups.clear();
  state.current = null;
  state.everOnline = false;
  state.me = null;
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
function kindChanged() {
  // "For one person": one share, for a member picked from the group.
  const exclusive = document.querySelector('input[name="kind"]:checked').value === "exclusive";
  $("send-count-row").hidden = exclusive;
  $("send-target-row").hidden = !exclusive;
}

$("open-send").addEventListener("click", () => {
  $("send-error").textContent = "";
  const g = group(state.current);
  $("send-target").replaceChildren(...[...g.members.values()]
    .filter((m) => m.user_id !== state.me.user_id)
    .map((m) => el("option", { value: m.user_id }, m.name)));
  kindChanged();
  $("send-dialog").showModal();
});
for (const radio of document.querySelectorAll('input[name="kind"]')) radio.addEventListener("change", kindChanged);
$("send-cancel").addEventListener("click", () => $("send-dialog").close());
$("send-form").addEventListener("submit", sendPacket);
$("packet-close").addEventListener("click", () => $("packet-dialog").close());
const STATUS = { credited: "in your balance", grabbed: "on its way" };
const SENT_STATUS = { finished: "all paid out", refunding: "expired, refund under way", refunded: "expired, the rest refunded" };

async function showHistory() {
  let data;
  try {
    data = await api("GET", "/api/me/packets");
  } catch (e) {
    showError(e);
    return;
  }
  const groupName = (id) => state.groups.get(id)?.info.name || `group ${id}`;
  $("history-received").replaceChildren(...data.received.map((r) => el("li", { "data-packet": r.packet_id },
    el("span", {}, groupName(r.group_id), " ", el("span", { class: "status" }, STATUS[r.status] || r.status)),
    el("span", {}, yuan(r.amount)))));
  const sentState = (p) => (p.status in SENT_STATUS ? SENT_STATUS[p.status] : `${p.paid_out} of ${p.count} paid out`);
  $("history-sent").replaceChildren(...data.sent.map((p) => el("li", { "data-packet": p.packet_id },
    el("span", {}, `${groupName(p.group_id)} · ${p.greeting || "Best wishes!"} `,
      el("span", { class: "status" }, sentState(p))),
    el("span", {}, `${yuan(p.total)} · ${shares(p.count)}`))));
  if (!data.received.length) $("history-received").append(el("li", { class: "status" }, "Nothing yet"));
  if (!data.sent.length) $("history-sent").append(el("li", { class: "status" }, "Nothing yet"));
  $("history-dialog").showModal();
}

$("my-packets").addEventListener("click", showHistory);
$("history-close").addEventListener("click", () => $("history-dialog").close());
$("members-toggle").addEventListener("click", () => ($("members-pane").hidden = !$("members-pane").hidden));
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
    await api("POST", `/api/groups/${state.current}/members`, { names });
    $("add-names").value = "";
    await loadMembers(state.current);
  } catch (e) {
    showError(e);
  }
});

if (state.token) start();
else $("login").hidden = false;
