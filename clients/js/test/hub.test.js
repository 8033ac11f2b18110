// The client against a live hub (tests/test_js_client.py starts one and gives its address, users and a
// control port in the environment; without them these tests skip). Alice is the group's admin with money,
// bob and carol its members.
import assert from "node:assert/strict";
import net from "node:net";
import { afterEach, test } from "node:test";

import { RedPacketClient, RedPacketError } from "../redpacket.js";

const env = process.env;
const live = Boolean(env.RP_WS);
const skip = live ? false : "no hub: run through tests/test_js_client.py";
// Ids as the hub gives them (protocol version 2): decimal strings. tests/test_js_client.py makes every id
// beyond 2⁵³, where Number() would change it.
const GROUP = env.RP_GROUP;
const BOB = env.RP_BOB;
const clients = [];

// Every client of a test closed after it, passed or failed: the hub allows a user few sockets here.
afterEach(() => clients.splice(0).forEach((c) => c.close()));

function client(token, options = {}) {
  const c = new RedPacketClient({ url: env.RP_WS, token, minDelayMs: 20, maxDelayMs: 200, ...options });
  clients.push(c);
  return c;
}

/** Ask the hub (through the test's control port) to act on a user's sockets: "drop USER CODE", "gap USER GROUP". */
function control(line) {
  return new Promise((resolve, reject) => {
    const socket = net.connect(Number(env.RP_CONTROL_PORT), "127.0.0.1", () => socket.write(`${line}\n`));
    socket.once("data", (data) => {
      socket.end();
      resolve(Number(String(data).split(" ")[1]));
    });
    socket.once("error", reject);
  });
}

/** Wait until `check()` is true: polled, failing after `ms`. */
async function until(check, ms = 10_000, what = "condition") {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

/** Every event of one type a client receives, kept in order. */
function collect(c, type) {
  const seen = [];
  c.on(type, (e) => seen.push(e));
  return seen;
}

// A person reads a packet before opening it: a grab within 100 ms is scored as a bot's (docs/protocol.md).
const humanPause = () => new Promise((r) => setTimeout(r, 150));

test("connects with its token, is welcomed and synced; requests are answered by id", { skip }, async () => {
  const bob = client(env.RP_BOB_TOKEN);
  const synced = bob.once("synced");
  const welcome = await bob.connect();
  assert.equal(welcome.user, BOB);
  assert.equal(typeof welcome.user, "string");
  assert.ok(BigInt(welcome.user) > 2n ** 53n, "the ids of this run are beyond a number's exact range");
  assert.ok(welcome.groups.some((g) => g.group_id === GROUP));
  // A number id beyond 2⁵³ has already lost its digits: refused here, never sent as another id.
  await assert.rejects(bob.grab(Number(GROUP), "1"), RangeError);
  await assert.rejects(bob.grab(BigInt(GROUP), 999_999_999), { code: "packet_not_found" });
  assert.equal((await synced).reason, "welcome");
  assert.equal(bob.status, "online");
  // Many requests in flight at once, each its own reply.
  const replies = await Promise.all([bob.ping(), bob.presence(GROUP), bob.ping(), bob.presence(GROUP)]);
  assert.equal(typeof replies[0].ts, "number");
  assert.equal(replies[1].group, GROUP);
  assert.ok(replies[1].online.includes(BOB));
  // Errors carry the protocol's code and fields.
  await assert.rejects(bob.grab(GROUP, 999_999_999), (e) => e instanceof RedPacketError && e.code === "packet_not_found");
  await assert.rejects(bob.chat(GROUP, " "), { code: "text_invalid" });
  await assert.rejects(bob.send(GROUP, { total: 100, count: 1 }), { code: "not_admin" });
  const alice = client(env.RP_ALICE_TOKEN);
  await alice.connect();
  await assert.rejects(alice.send(GROUP, { total: 99_999, count: 1 }), (e) => e.code === "amount_too_large" && e.details.limit === 20_000);
  bob.close();
  alice.close();
});

test("send, grab, open: packet, grabs and finished events, in JSON and in msgpack", { skip }, async () => {
  const alice = client(env.RP_ALICE_TOKEN, { format: "json" });
  const bob = client(env.RP_BOB_TOKEN, { format: "msgpack" });
  await Promise.all([alice.connect(), bob.connect()]);
  const seen = { alice: {}, bob: {} };
  for (const [name, c] of [["alice", alice], ["bob", bob]]) {
    for (const type of ["packet", "grabs", "finished", "chat", "event"]) seen[name][type] = collect(c, type);
  }
  const packet = await alice.send(GROUP, { kind: "lucky", total: 300, count: 2, greeting: "恭喜发财", request_id: "js-1" });
  assert.equal(packet.replay, false);
  await until(() => seen.bob.packet.length === 1, 10_000, "bob's packet event");
  const event = seen.bob.packet[0];
  assert.equal(event.group, GROUP);
  assert.equal(event.data.packet_id, packet.packet_id);
  assert.equal(event.data.greeting, "恭喜发财");
  assert.equal(event.offset, packet.offset);
  await humanPause();
  const bobs = await bob.grab(GROUP, packet.packet_id);
  assert.equal(bobs.outcome, "won");
  assert.equal((await bob.grab(GROUP, packet.packet_id)).outcome, "already");
  const alices = await alice.grab(GROUP, packet.packet_id);
  assert.equal(bobs.amount + alices.amount, 300);
  for (const name of ["alice", "bob"]) {
    await until(() => seen[name].finished.length === 1, 10_000, `${name}'s finished event`);
    const grabs = seen[name].grabs.flatMap((e) => e.data.grabs);
    assert.deepEqual(grabs.map((g) => [g.user, g.amount]).sort(), [[BOB, bobs.amount], [env.RP_ALICE, alices.amount]].sort());
    const finished = seen[name].finished[0].data;
    assert.equal(finished.packet_id, packet.packet_id);
    assert.equal(finished.best_luck.amount, Math.max(bobs.amount, alices.amount));
  }
  const view = await bob.open(GROUP, packet.packet_id);
  assert.equal(view.mine.amount, bobs.amount);
  assert.equal(view.grabs.length, 2);
  // The same text through both formats.
  await alice.chat(GROUP, "新年快乐 🧧");
  await until(() => seen.bob.chat.length === 1 && seen.alice.chat.length === 1, 10_000, "the chat");
  assert.equal(seen.bob.chat[0].data.text, "新年快乐 🧧");
  assert.deepEqual(seen.bob.chat[0], seen.alice.chat[0]);
  // "event" had every event, each once.
  const offsets = seen.bob.event.map((e) => e.offset);
  assert.equal(new Set(offsets).size, offsets.length);
  bob.close();
  alice.close();
});

test("provably fair: commitments kept from the send reply and the packet event; verify uses them", { skip }, async () => {
  const alice = client(env.RP_ALICE_TOKEN, { format: "json" });
  const bob = client(env.RP_BOB_TOKEN, { format: "msgpack" });
  await Promise.all([alice.connect(), bob.connect()]);
  const packets = collect(bob, "packet");
  const sent = await alice.send(GROUP, { kind: "lucky", total: 777, count: 2, greeting: "fair" });
  assert.match(sent.commitment, /^[0-9a-f]{64}$/);
  assert.equal(alice.commitment(sent.packet_id), sent.commitment); // from the send reply
  await until(() => packets.some((e) => e.data.packet_id === sent.packet_id), 10_000, "bob's packet event");
  assert.equal(bob.commitment(sent.packet_id), sent.commitment); // from the packet event
  assert.equal((await bob.verify(GROUP, sent.packet_id)).status, "not_revealed");
  await humanPause();
  await bob.grab(GROUP, sent.packet_id);
  await alice.grab(GROUP, sent.packet_id);
  for (const c of [alice, bob]) {
    const verdict = await c.verify(GROUP, sent.packet_id);
    assert.equal(verdict.status, "verified", verdict.problems.join("; "));
    assert.equal(verdict.againstSend, true);
    assert.equal(verdict.shares.reduce((a, b) => a + b, 0), 777);
  }
  // Carol connects after the packet finished (synced from now): she kept none, and is told so.
  const carol = client(env.RP_CAROL_TOKEN);
  await carol.connect();
  assert.equal(carol.commitment(sent.packet_id), undefined);
  const late = await carol.verify(GROUP, sent.packet_id);
  assert.equal(late.status, "verified");
  assert.equal(late.againstSend, false);
  alice.close();
  bob.close();
  carol.close();
});

test("closed by the hub: reconnects with a refreshed token, re-syncs, gets what it missed, each once", { skip }, async () => {
  let refreshes = 0;
  let letBack;
  const back = new Promise((r) => (letBack = r));
  const bob = client(env.RP_BOB_TOKEN, {
    format: "msgpack",
    refreshToken: async () => {
      refreshes += 1;
      await back; // bob stays away until alice has done what he is to miss
      return env.RP_BOB_TOKEN;
    },
  });
  const alice = client(env.RP_ALICE_TOKEN);
  await Promise.all([bob.connect(), alice.connect()]);
  const chats = collect(bob, "chat");
  const packets = collect(bob, "packet");
  const closes = collect(bob, "close");
  const syncs = collect(bob, "synced");
  await alice.chat(GROUP, "before the drop");
  await until(() => chats.length === 1, 10_000, "the first chat");

  assert.equal(await control(`drop ${BOB} ${env.RP_CLOSE_RESTARTING}`), 1);
  await until(() => closes.length === 1, 10_000, "the close");
  assert.deepEqual(closes[0], { code: 1012, reason: "closed by the test", willRetry: true, forced: false });
  await until(() => refreshes === 1, 10_000, "the token refresh");
  assert.notEqual(bob.status, "online");
  await assert.rejects(bob.ping(), { code: "offline" });

  await alice.chat(GROUP, "while you were away");
  const sent = await alice.send(GROUP, { total: 200, count: 2, greeting: "for the absent" });
  letBack();
  await until(() => syncs.length === 1, 10_000, "the sync after the reconnect");
  assert.equal(syncs[0].reason, "reconnect");
  assert.ok(syncs[0].replayed >= 2, syncs[0].replayed);
  assert.deepEqual(chats.map((e) => e.data.text), ["before the drop", "while you were away"]);
  assert.deepEqual(packets.map((e) => e.data.packet_id), [sent.packet_id]);
  assert.equal(refreshes, 1);
  assert.equal(bob.status, "online");
  // Live again: the next event comes as it happens.
  await alice.chat(GROUP, "welcome back");
  await until(() => chats.length === 3, 10_000, "the live chat");
  bob.close();
  alice.close();
});

test("dropped by the client (reconnectNow): back, synced, nothing twice", { skip }, async () => {
  const bob = client(env.RP_BOB_TOKEN);
  const alice = client(env.RP_ALICE_TOKEN);
  await Promise.all([bob.connect(), alice.connect()]);
  const chats = collect(bob, "chat");
  const syncs = collect(bob, "synced");
  bob.reconnectNow();
  await alice.chat(GROUP, "during the client's drop");
  await until(() => syncs.length === 1 && chats.length === 1, 10_000, "the reconnect");
  await alice.chat(GROUP, "after it");
  await until(() => chats.length === 2, 10_000, "the live chat");
  assert.deepEqual(chats.map((e) => e.data.text), ["during the client's drop", "after it"]);
  bob.close();
  alice.close();
});

test("too_old: a group synced from an offset the hub does not hold is reset with its open packets", { skip }, async () => {
  const alice = client(env.RP_ALICE_TOKEN);
  await alice.connect();
  const open = await alice.send(GROUP, { total: 500, count: 2, greeting: "still open" });
  // An offset past the group's newest event, as after Redis lost the group's events.
  const bob = client(env.RP_BOB_TOKEN, { offsets: { [GROUP]: "99999999999999-0" } });
  const resets = collect(bob, "reset");
  await bob.connect();
  assert.equal(resets.length, 1);
  const reset = resets[0];
  assert.equal(reset.group, GROUP);
  assert.equal(reset.tooOld, true);
  assert.equal(reset.previous, "99999999999999-0");
  assert.ok(reset.packets.some((p) => p.packet_id === open.packet_id && p.greeting === "still open"));
  // From then on the hub's offsets: the next event is delivered, not dropped as old.
  assert.equal(bob.lastOffsets()[GROUP], reset.offset);
  const chats = collect(bob, "chat");
  await alice.chat(GROUP, "after the reset");
  await until(() => chats.length === 1, 10_000, "the chat after the reset");
  bob.close();
  alice.close();
});

test("a gap notice makes it sync that group from its last offset", { skip }, async () => {
  const bob = client(env.RP_BOB_TOKEN);
  await bob.connect();
  const gaps = collect(bob, "gap");
  const syncs = collect(bob, "synced");
  assert.equal(await control(`gap ${BOB} ${GROUP}`), 1);
  await until(() => syncs.length === 1, 10_000, "the sync after the gap");
  assert.deepEqual(gaps, [{ group: GROUP }]);
  assert.equal(syncs[0].reason, "gap");
  assert.deepEqual(Object.keys(syncs[0].groups), [String(GROUP)]);
  bob.close();
});

test("an expired token: 4001 token_expired, refreshToken called, connected with the new one", { skip }, async () => {
  let refreshes = 0;
  const bob = client(env.RP_BOB_EXPIRED_TOKEN, { refreshToken: async () => (refreshes++, env.RP_BOB_TOKEN) });
  const closes = collect(bob, "close");
  const welcome = await bob.connect();
  assert.equal(welcome.user, BOB);
  assert.equal(refreshes, 1);
  assert.deepEqual(closes.map((c) => [c.code, c.reason, c.willRetry]), [[4001, "token_expired", true]]);
  bob.close();
  // Without a way to a new token it is final: connect() rejects, no retry.
  const stuck = client(env.RP_BOB_EXPIRED_TOKEN);
  await assert.rejects(stuck.connect(), (e) => e.code === "token_expired" && e.details.closeCode === 4001);
  assert.equal(stuck.status, "closed");
});

test("too many sockets (4030): retried after the longest back-off, in once another socket closes", { skip }, async () => {
  // The hub allows carol 3 sockets here; the clients' back-off is 20–200 ms, so a 4030 waits 100–200 ms.
  const carols = [client(env.RP_CAROL_TOKEN), client(env.RP_CAROL_TOKEN), client(env.RP_CAROL_TOKEN)];
  await Promise.all(carols.map((c) => c.connect()));
  const extra = client(env.RP_CAROL_TOKEN);
  const statuses = collect(extra, "status");
  const closes = collect(extra, "close");
  const syncs = collect(extra, "synced");
  const connecting = extra.connect();
  await until(() => closes.length === 1, 10_000, "the hub's 4030");
  assert.deepEqual(closes[0], { code: 4030, reason: "too_many_sockets", willRetry: true, forced: false });
  // Never welcomed yet: "connecting" (not "closed"), its next try after maxDelayMs × 0.5–1.
  await until(() => statuses.some((s) => s.code === 4030), 10_000, "the retry's status");
  const retry = statuses.find((s) => s.code === 4030);
  assert.equal(retry.status, "connecting");
  assert.ok(retry.retryInMs >= 100 && retry.retryInMs <= 200, `waits ${retry.retryInMs} ms`);
  assert.notEqual(extra.status, "closed");
  // One of carol's other tabs closes: the next try (or the one after) gets in, welcomed and synced.
  carols[0].close();
  await until(() => extra.status === "online", 10_000, "the extra socket online");
  const welcome = await connecting;
  assert.equal(welcome.user, env.RP_CAROL);
  assert.equal(syncs[0].reason, "welcome");
  assert.ok(closes.every((c) => c.code === 4030 && c.willRetry), JSON.stringify(closes));
  assert.ok(!statuses.some((s) => s.status === "closed"));

  // Welcomed, then closed 4030 by the hub (a real server-side close of every carol socket): "reconnecting",
  // the same long wait, and back online with a sync from its offsets.
  const before = statuses.length;
  assert.equal(await control(`drop ${env.RP_CAROL} 4030`), 3);
  await until(() => statuses.slice(before).some((s) => s.code === 4030), 10_000, "the reconnecting status");
  const again = statuses.slice(before).find((s) => s.code === 4030);
  assert.equal(again.status, "reconnecting");
  assert.ok(again.retryInMs >= 100 && again.retryInMs <= 200, `waits ${again.retryInMs} ms`);
  await until(() => extra.status === "online" && syncs.length === 2, 10_000, "back online after the 4030");
  assert.equal(syncs[1].reason, "reconnect");
  extra.close();
  carols.forEach((c) => c.close());
});
