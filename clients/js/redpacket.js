// The JavaScript client of the redpacket hub's websocket protocol (docs/protocol.md): an ES module with no
// build step and no dependencies, for browsers and Node.js ≥ 20 (whose WebSocket is global from Node 22;
// on Node 20 run with --experimental-websocket, or pass a WebSocket constructor in the options).
//
//   import { RedPacketClient } from "/client/redpacket.js";
//   const client = new RedPacketClient({ url: "wss://hub.example.com/ws", token, refreshToken });
//   client.on("packet", (event) => show(event.group, event.data));
//   await client.connect();                      // welcomed and synced
//   await client.grab(group, packet);
//
// What it does for you: the token as a subprotocol, reconnection with exponential back-off and full
// jitter, a `sync` from the last offset of every group after every welcome (duplicates dropped, a
// `too_old` answered with a "reset" event carrying the group's open packets), a `sync` on a `gap`
// notice, requests matched to replies by id with a timeout each, JSON or msgpack. And `verifyPacket(view,
// published)`: the check that a finished packet's shares were the ones drawn from the seed committed to at
// send (synchronous); the client keeps each packet's commitment as it hears it, for `client.verify`.

export const VERSION = "2.0.0";
// Protocol version 2: every user, group and packet id is its decimal string, both ways, in both formats —
// exact where a JavaScript number is not (beyond 2⁵³; chat backends' ids are 64-bit). docs/protocol.md, "Ids".
export const SUBPROTOCOL_JSON = "redpacket.v2.json";
export const SUBPROTOCOL_MSGPACK = "redpacket.v2.msgpack";

// Close codes after which reconnecting as before cannot help (docs/protocol.md, "Close codes"). 4001 is
// retried once with a token from `refreshToken`, when there is one; 4004 needs the backend to put the user
// first, so the app calls connect() again. (4030 is not final: see PATIENT_CLOSE_CODES.)
export const FINAL_CLOSE_CODES = Object.freeze([4001, 4004]);
const CLOSE_RESTARTING = 1012; // the hub restarts: come back soon, to another hub if there is one
// Close codes after which the client waits its longest back-off before it tries again, as the Python client
// does (clients/python/redpacket_client/reconnecting.py): 4029, it kept sending past the rate limit;
// 4030, this user has too many sockets on the hub — it gets in once one of them closes (another tab,
// another device).
const PATIENT_CLOSE_CODES = Object.freeze([4029, 4030]);
const CLOSE_TOKEN = 4001;
// Commitments kept, one a packet: those of the latest packets heard of (a few MB at most), as the Python
// client keeps them (docs/protocol.md, "Keep the commitment").
export const COMMITMENTS_KEPT = 10_000;

// ---- errors ----------------------------------------------------------------------------------------------

/** An error reply, or a request that got none: `code` is the protocol's stable code (docs/protocol.md,
 * "Error codes"), or `offline` (not connected, or the connection was lost before the reply) or `timeout`. */
export class RedPacketError extends Error {
  constructor(code, message, details = {}) {
    super(message || code);
    this.name = "RedPacketError";
    this.code = code;
    this.details = details; // the error's fields beside code and message: `limit`, `names`
  }
}

function replyError(error) {
  const { code, message, ...details } = error || {};
  return new RedPacketError(code || "internal", message || "", details);
}

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

// ---- msgpack: what the protocol uses of it (maps, arrays, strings, integers, floats, bool, nil, bin) -----

const utf8 = new TextEncoder();
const fromUtf8 = new TextDecoder("utf-8", { fatal: true });

/** One value as msgpack bytes. Integers beyond 2⁵³ go as BigInt; `undefined` map values are left out
 * (as JSON.stringify does). */
export function encodeMsgpack(value) {
  const out = new Encoder();
  out.value(value);
  return out.bytes();
}

class Encoder {
  constructor() {
    this.buf = new Uint8Array(256);
    this.view = new DataView(this.buf.buffer);
    this.pos = 0;
  }

  bytes() {
    return this.buf.slice(0, this.pos);
  }

  room(n) {
    if (this.pos + n <= this.buf.length) return;
    const bigger = new Uint8Array(Math.max(this.buf.length * 2, this.pos + n));
    bigger.set(this.buf);
    this.buf = bigger;
    this.view = new DataView(bigger.buffer);
  }

  u8(...bytes) {
    this.room(bytes.length);
    for (const b of bytes) this.buf[this.pos++] = b;
  }

  put(kind, n, v) {
    this.room(n);
    this.view[kind](this.pos, v, false);
    this.pos += n;
  }

  head(n, fix, fixMax, c8, c16, c32) {
    if (n <= fixMax) this.u8(fix | n);
    else if (c8 !== null && n < 0x100) this.u8(c8, n);
    else if (n < 0x10000) {
      this.u8(c16);
      this.put("setUint16", 2, n);
    } else {
      this.u8(c32);
      this.put("setUint32", 4, n);
    }
  }

  integer(n) {
    // n: a safe Number integer or a BigInt.
    if (n >= 0) {
      if (n < 0x80) this.u8(Number(n));
      else if (n < 0x100) this.u8(0xcc, Number(n));
      else if (n < 0x10000) (this.u8(0xcd), this.put("setUint16", 2, Number(n)));
      else if (n < 0x100000000) (this.u8(0xce), this.put("setUint32", 4, Number(n)));
      else if (BigInt(n) < 1n << 64n) (this.u8(0xcf), this.put("setBigUint64", 8, BigInt(n)));
      else throw new RangeError("integer too large for msgpack");
    } else if (n >= -32) this.u8(0x100 + Number(n));
    else if (n >= -0x80) (this.u8(0xd0), this.put("setInt8", 1, Number(n)));
    else if (n >= -0x8000) (this.u8(0xd1), this.put("setInt16", 2, Number(n)));
    else if (n >= -0x80000000) (this.u8(0xd2), this.put("setInt32", 4, Number(n)));
    else if (BigInt(n) >= -(1n << 63n)) (this.u8(0xd3), this.put("setBigInt64", 8, BigInt(n)));
    else throw new RangeError("integer too small for msgpack");
  }

  value(v) {
    if (v === null || v === undefined) this.u8(0xc0);
    else if (v === false) this.u8(0xc2);
    else if (v === true) this.u8(0xc3);
    else if (typeof v === "bigint") this.integer(v);
    else if (typeof v === "number") {
      if (Number.isSafeInteger(v)) this.integer(v);
      else (this.u8(0xcb), this.put("setFloat64", 8, v));
    } else if (typeof v === "string") {
      const b = utf8.encode(v);
      this.head(b.length, 0xa0, 31, 0xd9, 0xda, 0xdb);
      this.raw(b);
    } else if (v instanceof Uint8Array || v instanceof ArrayBuffer) {
      const b = v instanceof Uint8Array ? v : new Uint8Array(v);
      this.head(b.length, 0, -1, 0xc4, 0xc5, 0xc6);
      this.raw(b);
    } else if (Array.isArray(v)) {
      this.head(v.length, 0x90, 15, null, 0xdc, 0xdd);
      for (const x of v) this.value(x);
    } else if (typeof v === "object") {
      const entries = Object.entries(v).filter(([, x]) => x !== undefined);
      this.head(entries.length, 0x80, 15, null, 0xde, 0xdf);
      for (const [k, x] of entries) {
        this.value(k);
        this.value(x);
      }
    } else throw new TypeError(`msgpack cannot encode a ${typeof v}`);
  }

  raw(b) {
    this.room(b.length);
    this.buf.set(b, this.pos);
    this.pos += b.length;
  }
}

/** Msgpack bytes as a value: maps as plain objects, bin as Uint8Array, 64-bit integers as Numbers when
 * they are safe integers and as BigInts when not. */
export function decodeMsgpack(bytes) {
  const b = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
  let pos = 0;
  const need = (n) => {
    if (pos + n > b.length) throw new RangeError("msgpack: truncated");
  };
  const num = (kind, n) => {
    need(n);
    const v = view[kind](pos, false);
    pos += n;
    return v;
  };
  const big = (v) => (v >= BigInt(Number.MIN_SAFE_INTEGER) && v <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(v) : v);
  const str = (n) => {
    need(n);
    const s = fromUtf8.decode(b.subarray(pos, pos + n));
    pos += n;
    return s;
  };
  const bin = (n) => {
    need(n);
    const s = b.slice(pos, pos + n);
    pos += n;
    return s;
  };
  const array = (n) => {
    const a = new Array(n);
    for (let i = 0; i < n; i++) a[i] = value();
    return a;
  };
  const map = (n) => {
    const o = {};
    for (let i = 0; i < n; i++) {
      const k = value();
      Object.defineProperty(o, String(k), { value: value(), enumerable: true, writable: true, configurable: true });
    }
    return o;
  };
  const value = () => {
    const c = num("getUint8", 1);
    if (c < 0x80) return c;
    if (c < 0x90) return map(c & 0x0f);
    if (c < 0xa0) return array(c & 0x0f);
    if (c < 0xc0) return str(c & 0x1f);
    if (c >= 0xe0) return c - 0x100;
    switch (c) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return bin(num("getUint8", 1));
      case 0xc5: return bin(num("getUint16", 2));
      case 0xc6: return bin(num("getUint32", 4));
      case 0xca: return num("getFloat32", 4);
      case 0xcb: return num("getFloat64", 8);
      case 0xcc: return num("getUint8", 1);
      case 0xcd: return num("getUint16", 2);
      case 0xce: return num("getUint32", 4);
      case 0xcf: return big(num("getBigUint64", 8));
      case 0xd0: return num("getInt8", 1);
      case 0xd1: return num("getInt16", 2);
      case 0xd2: return num("getInt32", 4);
      case 0xd3: return big(num("getBigInt64", 8));
      case 0xd9: return str(num("getUint8", 1));
      case 0xda: return str(num("getUint16", 2));
      case 0xdb: return str(num("getUint32", 4));
      case 0xdc: return array(num("getUint16", 2));
      case 0xdd: return array(num("getUint32", 4));
      case 0xde: return map(num("getUint16", 2));
      case 0xdf: return map(num("getUint32", 4));
      default: throw new RangeError(`msgpack: type 0x${c.toString(16)} is not used by the protocol`);
    }
  };
  const v = value();
  if (pos !== b.length) throw new RangeError("msgpack: bytes after the value");
  return v;
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

// ---- provably fair packets (docs/protocol.md, "Provably fair packets") -----------------------------------
//
// A packet's shares are drawn at send from a secret 32-byte seed; the send publishes sha256(seed), the
// `commitment`, and the finished (or refunded) packet reveals the `seed`. From the seed and the packet's id,
// kind, total and count anyone recomputes the shares in the order they were handed out. The same algorithm
// as the Python client's clients/python/redpacket_client/fairness.py (the hub draws with it), checked
// against the document's test vectors.
//
// Synchronous and self-contained on purpose: crypto.subtle is asynchronous, and absent altogether from a page
// served over plain http from a LAN address (not a "secure context"), so SHA-256 and HMAC are written out
// here. They only check public data, so constant time does not matter.

// SHA-256's round constants: the first 32 bits of the fractional parts of the cube roots of the first 64
// primes (FIPS 180-4, 4.2.2).
const SHA256_K = Uint32Array.from([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);
// The initial hash value: the first 32 bits of the fractional parts of the square roots of the first 8 primes.
const SHA256_H0 = Uint32Array.from([
  0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
]);

const rotr = (x, n) => (x >>> n) | (x << (32 - n));
const asBytes = (data) => (typeof data === "string" ? utf8.encode(data) : data);

/** SHA-256 of bytes (a string is hashed as its UTF-8), as 32 bytes. Synchronous, no crypto.subtle. */
export function sha256(data) {
  const bytes = asBytes(data);
  // Padding: the bytes, 0x80, zeros up to 8 bytes short of a multiple of 64, then the length in bits
  // as a 64-bit big-endian integer.
  const padded = new Uint8Array(Math.ceil((bytes.length + 9) / 64) * 64);
  padded.set(bytes);
  padded[bytes.length] = 0x80;
  const view = new DataView(padded.buffer);
  view.setUint32(padded.length - 8, Math.floor(bytes.length / 2 ** 29)); // (length × 8) / 2³²
  view.setUint32(padded.length - 4, (bytes.length * 8) >>> 0);
  const h = Uint32Array.from(SHA256_H0);
  const w = new Uint32Array(64); // a Uint32Array stores every sum modulo 2³²
  for (let block = 0; block < padded.length; block += 64) {
    for (let t = 0; t < 16; t++) w[t] = view.getUint32(block + 4 * t);
    for (let t = 16; t < 64; t++) {
      const s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >>> 3);
      const s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >>> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    let [a, b, c, d, e, f, g, hh] = h;
    for (let t = 0; t < 64; t++) {
      // Sums of a few 32-bit values stay exact in a double; `>>> 0` takes them modulo 2³².
      const t1 = (hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + SHA256_K[t] + w[t]) >>> 0;
      const t2 = ((rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) >>> 0;
      [hh, g, f, e, d, c, b, a] = [g, f, e, (d + t1) >>> 0, c, b, a, (t1 + t2) >>> 0];
    }
    [a, b, c, d, e, f, g, hh].forEach((x, i) => (h[i] += x));
  }
  const out = new Uint8Array(32);
  const outView = new DataView(out.buffer);
  h.forEach((x, i) => outView.setUint32(4 * i, x));
  return out;
}

/** HMAC-SHA-256 (RFC 2104) of a message under a key, as 32 bytes (each bytes, or a string as its UTF-8). */
export function hmacSha256(key, message) {
  const block = new Uint8Array(64); // the key, hashed first if longer than SHA-256's block, zero-padded
  const k = asBytes(key);
  block.set(k.length > 64 ? sha256(k) : k);
  const msg = asBytes(message);
  const inner = new Uint8Array(64 + msg.length);
  const outer = new Uint8Array(64 + 32);
  for (let i = 0; i < 64; i++) {
    inner[i] = block[i] ^ 0x36;
    outer[i] = block[i] ^ 0x5c;
  }
  inner.set(msg, 64);
  outer.set(sha256(inner), 64);
  return sha256(outer);
}

const toHex = (bytes) => Array.from(bytes, (x) => x.toString(16).padStart(2, "0")).join("");

function seedBytes(seedHex) {
  if (typeof seedHex !== "string" || !/^[0-9a-fA-F]{64}$/.test(seedHex)) {
    throw new TypeError("a seed is 64 hex digits (32 bytes)");
  }
  return Uint8Array.from(seedHex.match(/../g), (x) => parseInt(x, 16));
}

/** An id as the exact decimal the generator's message needs. A number beyond 2⁵³ has already lost its
 * exact value (JSON.parse rounds it): such ids must arrive as a string or a BigInt. */
function decimalId(id) {
  if (typeof id === "number" && !Number.isSafeInteger(id)) {
    throw new RangeError(`packet id ${id} is not an exact integer: pass ids beyond 2^53 as a string or BigInt`);
  }
  const n = BigInt(id); // a string that is no integer throws here
  if (n < 1n) throw new RangeError(`packet id ${id} is not a positive integer`);
  return n.toString();
}

/** The commitment published at send: SHA-256 of the seed's 32 bytes (not of its hex), in lowercase hex. */
export function commitmentOf(seedHex) {
  return toHex(sha256(seedBytes(seedHex)));
}

const WORD = 2n ** 64n;

/** The generator: block j is HMAC-SHA-256(key = the seed, "redpacket/split/v1/<packet>/<total>/<count>/<j>"),
 * read as four unsigned 64-bit big-endian words, handed out in order. Returns `below(n)`: a uniform integer
 * in [0, n), by rejecting words at or above the largest multiple of n under 2⁶⁴. */
function generator(seed, packetId, total, count) {
  const prefix = `redpacket/split/v1/${packetId}/${total}/${count}/`;
  let blockNo = 0;
  let words = [];
  const word = () => {
    if (!words.length) {
      const digest = new DataView(hmacSha256(seed, `${prefix}${blockNo++}`).buffer);
      words = [0, 8, 16, 24].map((i) => digest.getBigUint64(i)); // big-endian
    }
    return words.shift();
  };
  return (n) => {
    const big = BigInt(n);
    const limit = WORD - (WORD % big);
    for (;;) {
      const w = word();
      if (w < limit) return Number(w % big);
    }
  };
}

function wholeNumber(name, v) {
  const n = typeof v === "bigint" ? Number(v) : v;
  if (!Number.isSafeInteger(n) || n < 1) throw new RangeError(`${name} must be a positive integer, not ${v}`);
  return n;
}

/** The shares of a packet, in the order they are handed out (share `seq` is item `seq - 1`): `equal` and
 * `exclusive` draw nothing; `lucky` is the double-average method, then a Fisher–Yates shuffle, both from the
 * seed's generator. `packetId` is a number, a decimal string or a BigInt (ids beyond 2⁵³: not a number). */
export function fairShares(seedHex, packetId, kind, total, count) {
  const seed = seedBytes(seedHex);
  const id = decimalId(packetId);
  total = wholeNumber("total", total);
  count = wholeNumber("count", count);
  if (kind === "equal") return Array(count).fill(Math.floor(total / count));
  if (kind !== "lucky") return [total];
  if (total < count) throw new RangeError("every share needs at least one cent");
  const below = generator(seed, id, total, count);
  const shares = [];
  let remaining = total;
  for (let left = count; left > 1; left--) {
    // Uniform in [1, min(twice the remaining average, what leaves a cent for each of the rest)].
    const upper = Math.min(Math.floor((2 * remaining) / left), remaining - (left - 1));
    const amount = 1 + below(upper);
    shares.push(amount);
    remaining -= amount;
  }
  shares.push(remaining);
  for (let i = count - 1; i > 0; i--) {
    const j = below(i + 1);
    [shares[i], shares[j]] = [shares[j], shares[i]];
  }
  return shares;
}

/** Check a packet view (`open`, `GET /api/packets/{p}`) as docs/protocol.md says and as the hub's
 * `redpacket_client.fairness.verify` does, against `published`: the commitment kept from before the seed was
 * shown (the send reply, the `packet` event, a view of the packet while active: `client.commitment(id)`).
 * A view's own commitment proves nothing about when it was made; without `published` the check is against
 * it only, and `againstSend` is false. `not_verifiable` (no commitment, none kept: sent before packets were
 * provably fair — never a failure), `not_revealed` (no seed yet: still active), else `verified` or
 * `mismatch` with every fault in `problems`: the commitment against the one kept, the seed against the
 * commitment, then each grab, in the order listed, against the share drawn for it. `shares` is the
 * recomputed list (empty without a usable seed). */
export function verifyPacket(view, published = null) {
  const committed = view.commitment ?? null;
  const seed = view.seed ?? null;
  const kept = published ?? null;
  const nothing = (status) => ({ status, problems: [], shares: [], againstSend: false });
  if (committed === null && kept === null) return nothing("not_verifiable");
  if (committed !== null && seed === null) return nothing("not_revealed");
  const againstSend = kept !== null;
  const problems = [];
  if (againstSend && committed !== kept) {
    problems.push(`the commitment shown now is ${committed}; the one published at send was ${kept}`);
  }
  if (typeof seed !== "string" || !/^[0-9a-f]{64}$/.test(seed)) {
    problems.push("the seed is not 64 lowercase hex digits");
    return { status: "mismatch", problems, shares: [], againstSend };
  }
  const computed = commitmentOf(seed);
  if (computed !== committed) problems.push(`sha256(seed) is ${computed}, not the commitment ${committed}`);
  const shares = fairShares(seed, view.packet_id, String(view.kind), Number(view.total), Number(view.count));
  problems.push(...grabProblems(view.grabs || [], shares));
  return { status: problems.length ? "mismatch" : "verified", problems, shares, againstSend };
}

/** Going down the list: each grab's share is one of the packet's, not listed before, numbered above every
 * share listed before it (handed out in the order drawn; a number skipped was not grabbed, or its credit
 * was refused), and its amount is that share's. The texts are the hub's, word for word. */
function grabProblems(grabs, shares) {
  const n = shares.length;
  const problems = grabs.length > n ? [`${grabs.length} grabs of a packet of ${n} shares`] : [];
  const seen = new Set();
  let last = 0;
  grabs.forEach((g, index) => {
    const i = index + 1;
    const user = g.user_id;
    const seq = Number(g.seq);
    const amount = Number(g.amount);
    if (!Number.isInteger(seq) || seq < 1 || seq > n) {
      problems.push(`grab ${i} (user ${user}) got share ${seq}: the packet has shares 1 to ${n}`);
      return;
    }
    if (seen.has(seq)) problems.push(`grab ${i} (user ${user}) got share ${seq}, listed before`);
    else if (seq < last) {
      problems.push(`grab ${i} (user ${user}) got share ${seq} after share ${last}:` +
        " not handed out in the order drawn");
    }
    if (amount !== shares[seq - 1]) {
      problems.push(`grab ${i} (user ${user}) got ${amount} cents; share ${seq} is ${shares[seq - 1]}`);
    }
    seen.add(seq);
    last = Math.max(last, seq);
  });
  return problems;
}
