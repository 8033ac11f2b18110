// The client's logic with no hub: msgpack, offsets, and a fake socket standing in for the hub where a live
// hub cannot be made to misbehave on cue (a reply that never comes, close codes one after another).
import assert from "node:assert/strict";
import { test } from "node:test";

import { RedPacketClient, RedPacketError, decodeMsgpack, encodeMsgpack, isNewer } from "../redpacket.js";

test("msgpack: every type the protocol uses goes there and back, 64-bit integers included", () => {
  const values = [null, true, false, 0, 127, 128, 255, 65_535, 65_536, 2 ** 32, Number.MAX_SAFE_INTEGER, -1, -32,
    -33, -129, -32_769, -(2 ** 31) - 1, 1.5, -0.25, "", "恭喜发财", "x".repeat(300), "y".repeat(70_000), [1, [2, 3]],
    { a: 1, b: { c: [null] } }, 2n ** 64n - 1n, -(2n ** 63n), Array(20).fill(7),
    Object.fromEntries(Array.from({ length: 20 }, (_, i) => [`k${i}`, i]))];
  for (const v of values) assert.deepEqual(decodeMsgpack(encodeMsgpack(v)), v);
  assert.deepEqual(decodeMsgpack(encodeMsgpack(new Uint8Array([1, 2, 3]))), new Uint8Array([1, 2, 3]));
  // Undefined fields are left out, as JSON.stringify leaves them out.
  assert.deepEqual(decodeMsgpack(encodeMsgpack({ a: undefined, b: 1 })), { b: 1 });
  // What the hub's Python msgpack writes for {"id": 2**64-1, "s": "恭喜"}, byte for byte.
  const python = Uint8Array.from(Buffer.from("82a26964cfffffffffffffffffa173a6e681ade5969c", "hex"));
  assert.deepEqual(decodeMsgpack(python), { id: 2n ** 64n - 1n, s: "恭喜" });
  assert.deepEqual(encodeMsgpack(decodeMsgpack(python)), python);
  assert.throws(() => decodeMsgpack(new Uint8Array([0x92, 1])), /truncated/);
});

test("offsets compare as (milliseconds, sequence) pairs of integers", () => {
  assert.ok(isNewer("5-1", "5-0"));
  assert.ok(isNewer("6-0", "5-9"));
  assert.ok(!isNewer("5", "5-0"));
  assert.ok(!isNewer("5-0", "5-1"));
  assert.ok(isNewer("18446744073709551615-0", "18446744073709551614-9"));
  assert.ok(isNewer("1-0", null));
});

/** A socket that plays the hub: welcomes, answers sync (and what `answers` says), closes on cue. */
class FakeHub {
  constructor({ answers = {} } = {}) {
    this.sockets = [];
    this.answers = { sync: () => ({ groups: { 1: { offset: "0-0", replayed: 0, too_old: false } } }), ...answers };
    const hub = this;
    this.WebSocket = class {
      constructor(url, protocols) {
        this.url = url;
        this.protocols = protocols;
        this.readyState = 0;
        this.sent = [];
        hub.sockets.push(this);
        if (hub.silent > 0) {
          hub.silent -= 1; // a handshake swallowed by the network: never opens, never closes
          return;
        }
        setTimeout(() => {
          if (this.readyState !== 0) return;
          this.readyState = 1;
          this.deliver({ type: "welcome", version: 1, user: 7, server_ms: Date.now(), groups: [{ group_id: 1 }] });
        });
      }

      send(data) {
        const msg = JSON.parse(data);
        this.sent.push(msg);
        const answer = hub.answers[msg.type];
        if (!answer) return;
        const answered = answer(msg);
        const reply = answered.refused ? { ok: false, error: answered.refused } : { ok: true, data: answered };
        setTimeout(() => this.deliver({ type: "reply", id: msg.id, ...reply }));
      }

      close() {
        this.readyState = 3;
      }

      deliver(msg) {
        if (this.readyState === 1) this.onmessage({ data: JSON.stringify(msg) });
      }

      hubCloses(code, reason = "") {
        this.readyState = 3;
        this.onclose({ code, reason });
      }
    };
  }

  get last() {
    return this.sockets.at(-1);
  }
}

const quick = { url: "ws://hub.invalid/ws", minDelayMs: 5, maxDelayMs: 40 };

test("the token goes as a subprotocol beside the format, the device in the URL", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t0k", device: "phone-1", WebSocket: hub.WebSocket });
  const welcome = await client.connect();
  assert.equal(welcome.user, 7);
  assert.deepEqual(hub.last.protocols, ["redpacket.v2.json", "bearer.t0k"]);
  assert.equal(new URL(hub.last.url).searchParams.get("device"), "phone-1");
  assert.deepEqual(hub.last.sent[0], { id: 1, type: "sync", groups: { 1: null } });
  client.close();
});

test("a request with no reply in time is rejected with the code timeout; a late reply is ignored", async () => {
  const hub = new FakeHub(); // answers sync only: a ping gets no reply
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket, requestTimeoutMs: 30 });
  await client.connect();
  const started = Date.now();
  await assert.rejects(client.ping(), (e) => e instanceof RedPacketError && e.code === "timeout");
  assert.ok(Date.now() - started >= 25);
  const ping = hub.last.sent.find((m) => m.type === "ping");
  hub.last.deliver({ type: "reply", id: ping.id, ok: true, data: { ts: 1 } }); // too late: nothing happens
  // A per-request timeout beats the client's.
  await assert.rejects(client.request("ping", {}, { timeoutMs: 1 }), { code: "timeout" });
  client.close();
  await assert.rejects(client.ping(), { code: "offline" });
});

test("an error reply rejects with the protocol's code and its extra fields", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  await client.connect();
  const sending = client.send(1, { total: 30_000, count: 2 });
  await new Promise((r) => setTimeout(r, 5));
  const send = hub.last.sent.find((m) => m.type === "send");
  assert.deepEqual(send, { id: send.id, type: "send", group: "1", total: 30_000, count: 2 }); // (ids go as text)
  hub.last.deliver({ type: "reply", id: send.id, ok: false, error: { code: "amount_too_large", message: "m", limit: 20_000 } });
  await assert.rejects(sending, (e) => e.code === "amount_too_large" && e.details.limit === 20_000);
  client.close();
});

test("each event once: a repeated or older offset is dropped", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  const seen = [];
  client.on("chat", (e) => seen.push(e.offset));
  await client.connect();
  for (const offset of ["10-0", "10-0", "9-5", "10-1", "11"]) {
    hub.last.deliver({ type: "event", group: 1, offset, event: "chat", data: { user: 2, text: "hi" } });
  }
  assert.deepEqual(seen, ["10-0", "10-1", "11"]);
  assert.deepEqual(client.lastOffsets(), { 1: "11" });
  client.close();
});

test("reconnects with bounded exponential back-off and full jitter; a welcome starts it over", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  const waits = [];
  client.on("status", (s) => s.retryInMs !== undefined && waits.push(s.retryInMs));
  await client.connect();
  // The hub fails every connection before its welcome, six times.
  hub.WebSocket.prototype.send = function () {};
  for (let i = 0; i < 6; i++) {
    const socket = hub.last;
    socket.hubCloses(1011);
    while (hub.last === socket) await new Promise((r) => setTimeout(r, 1));
    hub.last.readyState = 2; // refused: no welcome
  }
  waits.forEach((w, i) => assert.ok(w >= 0 && w <= Math.min(40, 5 * 2 ** i) + 1, `wait ${i}: ${w}`));
  client.close();
});

test("close codes that mean do not retry: 4004, and 4001 without a way to a new token", async () => {
  for (const [code, reason] of [[4004, "user_not_found"], [4001, "token_expired"]]) {
    const hub = new FakeHub();
    hub.WebSocket.prototype.send = function () {};
    const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
    const connecting = client.connect();
    await new Promise((r) => setTimeout(r, 5));
    hub.last.hubCloses(code, reason);
    await assert.rejects(connecting, (e) => e.code === reason && e.details.closeCode === code);
    await new Promise((r) => setTimeout(r, 60));
    assert.equal(hub.sockets.length, 1, `no reconnect after ${code}`);
    assert.equal(client.status, "closed");
  }
});

test("4029 and 4030 are retried after the longest back-off (maxDelayMs × 0.5–1), 4030 until a socket is free", async () => {
  for (const [code, reason] of [[4029, "rate_limited"], [4030, "too_many_sockets"]]) {
    const hub = new FakeHub();
    const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
    const closes = [];
    const waits = [];
    client.on("close", (c) => closes.push([c.code, c.willRetry]));
    client.on("status", (s) => s.retryInMs !== undefined && waits.push([s.status, s.code, s.retryInMs]));
    // Refused before its welcome, twice (the user's other sockets are all still open), then let in.
    const connecting = client.connect();
    for (let i = 0; i < 2; i++) {
      while (hub.sockets.length === i) await new Promise((r) => setTimeout(r, 1));
      hub.last.readyState = 2; // no welcome on this one
      hub.last.hubCloses(code, reason);
    }
    const welcome = await connecting;
    assert.equal(welcome.user, 7);
    assert.equal(hub.sockets.length, 3);
    assert.deepEqual(closes, [[code, true], [code, true]]);
    assert.deepEqual(waits.map(([status, c]) => [status, c]), [["connecting", code], ["connecting", code]]);
    waits.forEach(([, , w]) => assert.ok(w >= 20 && w <= 40, `${code}: waited ${w} ms, not 20–40`));
    // Once welcomed, the same close makes it "reconnecting" (not closed), and back online.
    hub.last.hubCloses(code, reason);
    assert.equal(client.status, "reconnecting");
    assert.ok(waits.at(-1)[2] >= 20, `${code}: waited ${waits.at(-1)[2]} ms`);
    while (client.status !== "online") await new Promise((r) => setTimeout(r, 1));
    client.close();
  }
});

test("4001 with refreshToken: one more try with a new token; a second 4001 before a welcome is final", async () => {
  const hub = new FakeHub();
  const tokens = [];
  const client = new RedPacketClient({ ...quick, token: "old", refreshToken: async () => `new${tokens.push(1)}`,
    WebSocket: hub.WebSocket });
  await client.connect();
  hub.last.hubCloses(4001, "token_expired");
  while (client.status !== "online") await new Promise((r) => setTimeout(r, 1));
  assert.deepEqual(hub.last.protocols, ["redpacket.v2.json", "bearer.new1"]);
  // Refused again and again: once more after the first, then no more.
  const closes = [];
  client.on("close", (c) => closes.push(c.willRetry));
  hub.WebSocket.prototype.send = function () {};
  hub.last.hubCloses(4001, "token_invalid");
  while (hub.sockets.length < 3) await new Promise((r) => setTimeout(r, 1));
  hub.last.readyState = 1;
  hub.last.hubCloses(4001, "token_invalid");
  assert.deepEqual(closes, [true, false]);
  assert.equal(client.status, "closed");
});

test("a group with no events yet is synced from 0-0 next time, so nothing sent meanwhile is lost", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  await client.connect();
  assert.deepEqual(client.lastOffsets(), { 1: "0-0" });
  const synced = client.once("synced");
  client.reconnectNow();
  assert.equal((await synced).reason, "reconnect");
  assert.deepEqual(hub.last.sent[0].groups, { 1: "0-0" });
  client.close();
});

test("a sync the hub refuses: the client connects again rather than stay unsynced", async () => {
  let refusals = 1;
  const hub = new FakeHub({
    answers: {
      sync: () => (refusals-- > 0 ? { refused: { code: "redis_unavailable", message: "m" } } : { groups: {} }),
    },
  });
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  const errors = collectErrors(client);
  await client.connect();
  assert.equal(hub.sockets.length, 2);
  assert.deepEqual(errors.map((e) => e.code), ["redis_unavailable"]);
  client.close();
});

test("an event type the client does not know comes only as \"event\"", async () => {
  const hub = new FakeHub();
  const client = new RedPacketClient({ ...quick, token: "t", WebSocket: hub.WebSocket });
  const all = [];
  client.on("event", (e) => all.push(e.event));
  client.on("error", () => assert.fail("not an error"));
  await client.connect();
  hub.last.deliver({ type: "event", group: 1, offset: "5-0", event: "error", data: {} });
  hub.last.deliver({ type: "event", group: 1, offset: "6-0", event: "presence", data: { user: 2, online: true } });
  assert.deepEqual(all, ["error", "presence"]);
  client.close();
});

function collectErrors(client) {
  const errors = [];
  client.on("error", (e) => errors.push(e));
  return errors;
}

test("a connection that is never welcomed is given up after connectTimeoutMs and tried again", async () => {
  const hub = new FakeHub();
  hub.silent = 1;
  const client = new RedPacketClient({
    url: "ws://hub.test/ws", token: "t", WebSocket: hub.WebSocket, connectTimeoutMs: 30, minDelayMs: 1, maxDelayMs: 5,
  });
  const closes = [];
  client.on("close", (e) => closes.push(e));
  const welcome = await client.connect();
  assert.equal(welcome.user, 7);
  assert.equal(hub.sockets.length, 2); // the silent one, then one that was welcomed
  assert.equal(hub.sockets[0].readyState, 3); // the silent one was closed, not left hanging
  assert.deepEqual(closes.map((e) => [e.code, e.willRetry]), [[1006, true]]);
  client.close();
});
