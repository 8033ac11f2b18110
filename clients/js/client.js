// The client: one socket to the hub, welcomed and synced, reconnected with back-off, requests matched to
// replies by id (README.md; docs/protocol.md).

import {
  CLOSE_RESTARTING,
  CLOSE_TOKEN,
  COMMITMENTS_KEPT,
  FINAL_CLOSE_CODES,
  PATIENT_CLOSE_CODES,
  RedPacketError,
  SUBPROTOCOL_JSON,
  SUBPROTOCOL_MSGPACK,
  replyError,
} from "./codes.js";
import { verifyPacket } from "./fairness.js";
import { decodeMsgpack, encodeMsgpack } from "./msgpack.js";

// ---- offsets ---------------------------------------------------------------------------------------------

/** An event offset ("<ms>-<seq>", or "<ms>") as a pair of BigInts, compared as the protocol says. */
function offsetPair(offset) {
  const [ms, seq] = String(offset).split("-");
  return [BigInt(ms), BigInt(seq ?? 0)];
}

/** Whether offset `a` comes after offset `b` in its group (any offset comes after none). */
export function isNewer(a, b) {
  if (b === null || b === undefined) return true;
  const [am, as] = offsetPair(a);
  const [bm, bs] = offsetPair(b);
  return am > bm || (am === bm && as > bs);
}

// ---- the client ------------------------------------------------------------------------------------------

const DEFAULTS = {
  format: "json",
  requestTimeoutMs: 10_000,
  // A connection with no welcome this long after it was opened is given up and tried again (a network
  // that drops the handshake, a hub too busy to welcome): as the Python client does.
  connectTimeoutMs: 10_000,
  reconnect: true,
  minDelayMs: 500, // the first reconnect waits up to this (full jitter: anything from 0)
  maxDelayMs: 10_000, // and never longer than this, however many tries
  maxAttempts: Infinity, // reconnects in a row without a welcome before giving up
  firstOffset: null, // what a group never seen before is synced from: null (from now) or "0-0" (its history)
};

/** The group events (docs/protocol.md, "Server → client: events"), each also emitted as "event". */
export const EVENT_TYPES = Object.freeze(["chat", "packet", "grabs", "finished", "presence", "member_added",
  "member_removed", "member_role"]);

export class RedPacketClient {
  /**
   * @param {object} options see redpacket.d.ts (ClientOptions) and README.md
   */
  constructor(options) {
    if (!options || !options.url) throw new TypeError("RedPacketClient needs options.url (ws:// or wss://…/ws)");
    this.options = { ...DEFAULTS, ...options };
    if (!["json", "msgpack"].includes(this.options.format)) throw new TypeError("format is json or msgpack");
    this.WebSocket = options.WebSocket || globalThis.WebSocket;
    if (!this.WebSocket) {
      throw new TypeError("no WebSocket: pass options.WebSocket (on Node 20: run with --experimental-websocket)");
    }
    this.token = typeof options.token === "function" ? null : options.token || null;
    this.offsets = new Map(Object.entries(options.offsets || {}).map(([g, o]) => [idText("group", g), o]));
    this.status = "idle"; // idle, connecting, online, reconnecting, closed
    this.welcome = null;
    this.ws = null;
    this.listeners = new Map();
    this.pending = new Map();
    this.nextId = 1;
    this.attempt = 0;
    this.retryTimer = null;
    this.stopped = true;
    this.tokenRetried = false; // reconnected after a 4001 with a new token, not yet welcomed
    this.everWelcomed = false;
    this.firstReady = null;
    this.generation = 0; // of openSocket calls: one outdated by close() or connect() meanwhile gives up
    // Each packet's commitment as heard before its seed was shown (packet id's decimal → commitment), oldest
    // first: what verify() checks a revealed seed against.
    this.commitments = new Map();
  }

  // -- events ---------------------------------------------------------------------------------------------

  /** Call `fn` on each `type` event; returns a function that stops it. */
  on(type, fn) {
    if (!this.listeners.has(type)) this.listeners.set(type, new Set());
    this.listeners.get(type).add(fn);
    return () => this.off(type, fn);
  }

  off(type, fn) {
    this.listeners.get(type)?.delete(fn);
  }

  /** The next `type` event, as a promise. */
  once(type) {
    return new Promise((resolve) => {
      const off = this.on(type, (x) => {
        off();
        resolve(x);
      });
    });
  }

  emit(type, payload) {
    for (const fn of [...(this.listeners.get(type) || [])]) {
      try {
        fn(payload);
      } catch (e) {
        this.fail(e);
      }
    }
  }

  fail(error) {
    // An error of the app's handlers or callbacks: to the "error" listeners, or thrown where the runtime
    // reports uncaught errors (never swallowed, never into the client's own state).
    const handlers = this.listeners.get("error");
    if (handlers && handlers.size) {
      for (const fn of [...handlers]) fn(error);
    } else {
      setTimeout(() => {
        throw error;
      });
    }
  }

  warn(error) {
    // A failure of the connection's own work (a token refresh, a sync, a frame): to the "error" listeners,
    // else to the console; the client goes on (reconnecting where it must).
    const handlers = this.listeners.get("error");
    if (handlers && handlers.size) this.fail(error);
    else console.warn("redpacket client:", error);
  }

  setStatus(status, detail = {}) {
    if (this.status === status && Object.keys(detail).length === 0) return;
    this.status = status;
    this.emit("status", { status, ...detail });
  }

  // -- connecting -----------------------------------------------------------------------------------------

  /** Open the connection (and keep it open). Resolves with the welcome once the first sync after it is
   * answered; rejects if the hub closes with a code that is not retried before any welcome. */
  connect() {
    if (!this.stopped && this.firstReady) return this.firstReady.promise;
    this.stopped = false;
    this.attempt = 0;
    this.tokenRetried = false;
    let resolve;
    let reject;
    const promise = new Promise((res, rej) => {
      resolve = res;
      reject = rej;
    });
    promise.catch(() => {}); // an app that never awaits it is told through "status" and "close"
    this.firstReady = { promise, resolve, reject, done: false };
    this.openSocket(false);
    return promise;
  }

  async currentToken(refresh) {
    // The token of the options (a string, or a function giving one) at first; on every reconnect a fresh
    // one from refreshToken, when the app gave it.
    const o = this.options;
    if (refresh && o.refreshToken) this.token = await o.refreshToken();
    else if (typeof o.token === "function") this.token = await o.token();
    else if (!this.token && o.refreshToken) this.token = await o.refreshToken();
    if (!this.token) throw new RedPacketError("token_invalid", "no token");
    return this.token;
  }

  async openSocket(refresh) {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    const generation = ++this.generation;
    this.setStatus(this.everWelcomed ? "reconnecting" : "connecting");
    let ws;
    try {
      const token = await this.currentToken(refresh);
      if (this.stopped || generation !== this.generation) return;
      const o = this.options;
      const url = new URL(o.url);
      if (o.device) url.searchParams.set("device", o.device);
      const format = o.format === "msgpack" ? SUBPROTOCOL_MSGPACK : SUBPROTOCOL_JSON;
      // The token as a subprotocol beside the format, never in the URL (docs/protocol.md, "Connecting").
      ws = new this.WebSocket(url.toString(), [format, `bearer.${token}`]);
    } catch (e) {
      // No token (refreshToken failed), or a URL the WebSocket refuses: said, and tried again later.
      this.warn(e);
      if (!this.stopped && generation === this.generation) this.retry(null);
      return;
    }
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    clearTimeout(this.welcomeTimer);
    this.welcomeTimer = setTimeout(() => {
      if (this.ws !== ws || this.welcomedOn === ws) return;
      this.ws = null;
      try {
        ws.close(4000, "no welcome in time");
      } catch {
        // (a socket still connecting may refuse a close code: it is dropped either way)
      }
      this.onClose(1006, "no welcome in time");
    }, this.options.connectTimeoutMs);
    ws.onmessage = (e) => {
      if (this.ws === ws) this.onFrame(e.data);
    };
    ws.onclose = (e) => {
      if (this.ws === ws) this.onClose(e.code, e.reason);
    };
  }

  /** Close for good: no reconnect; pending requests are rejected (`offline`). */
  close() {
    this.stopped = true;
    clearTimeout(this.retryTimer);
    clearTimeout(this.welcomeTimer);
    this.retryTimer = null;
    const ws = this.ws;
    this.ws = null;
    this.dropPending("connection closed");
    if (ws && ws.readyState <= 1) ws.close(1000);
    this.finishFirst(new RedPacketError("offline", "closed before the first welcome"));
    this.setStatus("closed");
  }

  /** Drop the socket as a lost network would, and reconnect as after one (for tests and for an app that
   * knows its network changed). */
  reconnectNow() {
    const ws = this.ws;
    if (!ws) return;
    this.ws = null;
    ws.close(4000, "client reconnects");
    this.onClose(1006, "dropped by the client", true);
  }

  finishFirst(error, welcome) {
    const first = this.firstReady;
    if (!first || first.done) return;
    first.done = true;
    if (error) first.reject(error);
    else first.resolve(welcome);
  }

  dropPending(why) {
    for (const p of this.pending.values()) {
      clearTimeout(p.timer);
      p.reject(new RedPacketError("offline", why));
    }
    this.pending.clear();
  }

  onClose(code, reason, forced = false) {
    this.ws = null;
    this.dropPending("connection lost");
    if (this.stopped) return;
    // 4001 (token expired or refused): once more with a token from refreshToken, if the app gave one; a
    // second 4001 before a welcome is final. 4004 needs the backend to act first.
    const newToken = code === CLOSE_TOKEN && this.options.refreshToken && !this.tokenRetried;
    const final = !this.options.reconnect || (FINAL_CLOSE_CODES.includes(code) && !newToken);
    this.emit("close", { code, reason, willRetry: !final, forced });
    if (final) {
      this.stopped = true;
      this.finishFirst(new RedPacketError(reason || "closed", `closed by the hub: ${code} ${reason || ""}`.trim(),
        { closeCode: code }));
      this.setStatus("closed", { code, reason });
      return;
    }
    if (code === CLOSE_TOKEN) this.tokenRetried = true;
    this.retry(code);
  }

  retry(code) {
    this.attempt += 1;
    if (this.attempt > this.options.maxAttempts) {
      this.stopped = true;
      this.finishFirst(new RedPacketError("offline", "gave up reconnecting"));
      this.setStatus("closed", { code: code ?? 0, reason: "gave up" });
      return;
    }
    const { minDelayMs, maxDelayMs } = this.options;
    // Exponential back-off with full jitter: anything from 0 to min(max, min × 2^(attempt−1)).
    const cap = Math.min(maxDelayMs, minDelayMs * 2 ** (this.attempt - 1));
    let delay = Math.random() * cap;
    if (code === CLOSE_RESTARTING && this.attempt === 1) delay = Math.random() * Math.min(200, cap);
    if (PATIENT_CLOSE_CODES.includes(code)) delay = maxDelayMs * (0.5 + Math.random() / 2);
    this.setStatus(this.everWelcomed ? "reconnecting" : "connecting", { code: code ?? 0, retryInMs: Math.round(delay) });
    // Every reconnect asks refreshToken (when the app gave one) for a fresh token first.
    this.retryTimer = setTimeout(() => this.openSocket(true), delay);
  }

  // -- frames -----------------------------------------------------------------------------------------------

  encode(message) {
    return this.options.format === "msgpack" ? encodeMsgpack(message) : JSON.stringify(message);
  }

  onFrame(data) {
    let msg;
    try {
      msg = typeof data === "string" ? JSON.parse(data) : decodeMsgpack(data);
    } catch (e) {
      this.warn(new RedPacketError("bad_frame", `a frame from the hub could not be decoded: ${e.message}`));
      return;
    }
    switch (msg.type) {
      case "welcome":
        this.onWelcome(msg);
        break;
      case "reply":
        this.onReply(msg);
        break;
      case "event":
        this.onEvent(msg);
        break;
      case "removed":
        this.offsets.delete(String(msg.group));
        this.emit("removed", { group: msg.group });
        break;
      case "added":
        this.emit("added", { group: msg.group });
        break;
      case "gap":
        // The hub lost events of this group it could not recover itself: sync it from our last offset.
        this.emit("gap", { group: msg.group });
        this.sync([msg.group], "gap").catch((e) => e.code === "offline" || this.warn(e));
        break;
      default:
        break;
    }
  }

  async onWelcome(msg) {
    this.welcomedOn = this.ws;
    clearTimeout(this.welcomeTimer);
    const reconnect = this.everWelcomed;
    this.welcome = msg;
    this.everWelcomed = true;
    this.tokenRetried = false;
    this.setStatus("online");
    this.emit("welcome", { ...msg, reconnect });
    const ws = this.ws;
    if (this.options.beforeSync) {
      try {
        await this.options.beforeSync(msg);
      } catch (e) {
        this.fail(e);
      }
    }
    if (this.ws !== ws) return; // lost meanwhile: the next welcome syncs
    // The hub holds a group's events until it is synced: every group of the welcome, from its last offset.
    const ids = msg.groups.map((g) => String(g.group_id)); // (offsets are kept by the id's decimal)
    for (const id of [...this.offsets.keys()]) if (!ids.includes(id)) this.offsets.delete(id);
    try {
      await this.sync(ids, reconnect ? "reconnect" : "welcome");
    } catch (e) {
      if (e.code === "offline" || this.ws !== ws) return; // lost meanwhile: the next welcome syncs
      // Unsynced, the groups' events are held on the hub: connect again (with the back-off, which only a
      // synced connection resets) rather than stay online deaf.
      this.warn(e);
      this.reconnectNow();
      return;
    }
    this.attempt = 0;
    this.finishFirst(null, msg);
  }

  onReply(msg) {
    const p = this.pending.get(msg.id);
    if (!p) return; // timed out meanwhile
    this.pending.delete(msg.id);
    clearTimeout(p.timer);
    if (!msg.ok) {
      p.reject(replyError(msg.error));
      return;
    }
    if (p.type === "send" || p.type === "open") this.keepCommitment(msg.data);
    p.resolve(msg.data);
  }

  onEvent(msg) {
    // Each event once: a replay after a reconnect may overlap what was seen (docs/protocol.md, "Recovery").
    if (!isNewer(msg.offset, this.offsets.get(String(msg.group)))) return;
    this.offsets.set(String(msg.group), msg.offset);
    if (msg.event === "packet") this.keepCommitment(msg.data);
    this.emit("event", msg);
    if (EVENT_TYPES.includes(msg.event)) this.emit(msg.event, msg);
  }

  // -- requests ---------------------------------------------------------------------------------------------

  /** One request; resolves with the reply's `data`, rejects with a RedPacketError carrying its `code`
   * (or `offline`, `timeout`). `timeoutMs` overrides the client's `requestTimeoutMs` for this request. */
  request(type, fields = {}, { timeoutMs } = {}) {
    return new Promise((resolve, reject) => {
      const ws = this.ws;
      if (!ws || ws.readyState !== 1 || this.status !== "online") {
        reject(new RedPacketError("offline", "not connected"));
        return;
      }
      const id = this.nextId++;
      const wait = timeoutMs ?? this.options.requestTimeoutMs;
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new RedPacketError("timeout", `no reply to ${type} within ${wait} ms`));
      }, wait);
      this.pending.set(id, { resolve, reject, timer, type });
      ws.send(this.encode({ ...fields, id, type }));
    });
  }

  /** Sync `groups` (ids; default: every group of the welcome) from their last offsets. Events missed are
   * delivered before this resolves; a group the hub no longer holds enough of gets a "reset" event with its
   * open packets. Resolves with the reply's `groups`. */
  async sync(groups, reason = "manual") {
    const ids = (groups || (this.welcome ? this.welcome.groups.map((g) => g.group_id) : [])).map((g) => idText("group", g));
    const wanted = {};
    const previous = new Map();
    for (const id of ids) {
      previous.set(id, this.offsets.get(id) ?? null);
      wanted[id] = this.offsets.get(id) ?? this.options.firstOffset;
    }
    const data = await this.request("sync", { groups: wanted });
    let replayed = 0;
    for (const [key, res] of Object.entries(data.groups)) {
      const id = key;
      if (res.error) {
        this.offsets.delete(id);
        continue;
      }
      replayed += res.replayed || 0;
      for (const view of res.packets || []) this.keepCommitment(view);
      const seen = this.offsets.get(id);
      if (res.too_old || res.packets) {
        // A fresh start, or the hub no longer holds what followed our offset: its latest is where we are.
        this.offsets.set(id, res.too_old || isNewer(res.offset, seen) ? res.offset : seen);
        this.emit("reset", { group: id, offset: res.offset, packets: res.packets || [], tooOld: Boolean(res.too_old),
          previous: previous.get(id) ?? null });
      } else if (isNewer(res.offset, seen)) {
        // Where the group is now ("0-0": no events yet), so that the next sync replays from here.
        this.offsets.set(id, res.offset);
      }
    }
    this.emit("synced", { groups: data.groups, reason, replayed });
    return data.groups;
  }

  ping() {
    return this.request("ping");
  }

  async chat(group, text) {
    return this.request("chat", { group: idText("group", group), text });
  }

  /** send: `packet` is {kind, total, count, greeting, target, request_id}; pass a request_id to retry safely. */
  async send(group, packet) {
    const target = packet?.target == null ? packet?.target : idText("target", packet.target);
    return this.request("send", { ...packet, ...(target === undefined ? {} : { target }), group: idText("group", group) });
  }

  async grab(group, packet) {
    return this.request("grab", { group: idText("group", group), packet: idText("packet", packet) });
  }

  async open(group, packet) {
    return this.request("open", { group: idText("group", group), packet: idText("packet", packet) });
  }

  async presence(group) {
    return this.request("presence", { group: idText("group", group) });
  }

  /** The packet's commitment as this client heard it before its seed was shown (a `packet` event, a send
   * reply, a view of it while active), or undefined if it heard none. */
  commitment(packetId) {
    return this.commitments.get(packetKey(packetId) ?? "");
  }

  /** Open the packet and check its proof of a fair split (docs/protocol.md, "Provably fair packets")
   * against the commitment this client kept (`commitment`): verifyPacket's verdict, whose `againstSend`
   * says whether one was kept. */
  async verify(group, packet) {
    const kept = this.commitment(packet);
    return verifyPacket(await this.open(group, packet), kept);
  }

  keepCommitment(packet) {
    // A packet's commitment heard while its seed is secret: the one a revealed seed must match. The first
    // heard stands; past COMMITMENTS_KEPT the oldest go.
    const key = packetKey(packet?.packet_id);
    const committed = packet?.commitment;
    if (key === null || typeof committed !== "string" || (packet.seed ?? null) !== null) return;
    if (this.commitments.has(key)) return;
    this.commitments.set(key, committed);
    while (this.commitments.size > COMMITMENTS_KEPT) this.commitments.delete(this.commitments.keys().next().value);
  }

  /** The last offset seen per group (to store, and give back as `offsets` to a client made later). */
  lastOffsets() {
    return Object.fromEntries([...this.offsets].map(([g, o]) => [String(g), o]));
  }
}

/** An id as the hub's version 2 takes it: its decimal string. A string is sent as it is (the hub refuses
 * one that is no id's digits); a BigInt as its decimal; a number only while exact — beyond 2⁵³ it has
 * already lost its digits (JSON.parse rounds it), and throws a RangeError rather than name another id. */
export function idText(name, id) {
  if (typeof id === "string") return id;
  if (typeof id === "bigint") return id.toString();
  if (typeof id === "number" && Number.isSafeInteger(id)) return String(id);
  throw new RangeError(`${name} ${id} is not an exact id: pass ids as strings (or BigInts)`);
}

/** A packet id as the key of the commitments kept: its decimal (a number, a BigInt or a decimal string
 * alike), or null for anything else. */
function packetKey(id) {
  if ((typeof id === "number" && Number.isSafeInteger(id)) || typeof id === "bigint") return String(id);
  if (typeof id === "string" && /^[0-9]+$/.test(id)) return BigInt(id).toString();
  return null;
}
