// Provably fair packets in the client (docs/protocol.md, "Provably fair packets"): the document's own test
// vectors and example packet view, read from the document itself; the hand-written SHA-256 and HMAC against
// node's crypto; what verifyPacket says of a packet tampered with in each way it can be, with and without
// the commitment kept from the send; and the commitments the client keeps (against a fake socket).
import assert from "node:assert/strict";
import { createHash, createHmac, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import {
  COMMITMENTS_KEPT, RedPacketClient, commitmentOf, fairShares, hmacSha256, sha256, verifyPacket,
} from "../redpacket.js";

const PROTOCOL = readFileSync(new URL("../../../docs/protocol.md", import.meta.url), "utf8");

/** The first ```json block after `marker` in docs/protocol.md, parsed. Integers of 16 digits or more (a
 * packet id up to 2⁶³−1) are read as strings: JSON.parse would round them to the nearest double. */
function jsonAfter(marker) {
  const at = PROTOCOL.indexOf(marker);
  assert.ok(at >= 0, `docs/protocol.md has no ${marker}`);
  const block = /```json\n([\s\S]*?)\n```/.exec(PROTOCOL.slice(at));
  assert.ok(block, `no json block after ${marker}`);
  return JSON.parse(block[1].replace(/(:\s*)(\d{16,})\b/g, '$1"$2"'));
}

const VECTORS = jsonAfter("### Test vectors");
const VIEW = jsonAfter("**The packet view**");
const hex = (bytes) => Buffer.from(bytes).toString("hex");

test("the document's test vectors: commitment, block 0 of the generator and the shares", () => {
  assert.ok(VECTORS.length >= 5);
  assert.ok(VECTORS.some((v) => typeof v.packet_id === "string"), "a packet id beyond 2^53 is among them");
  for (const v of VECTORS) {
    const where = `packet ${v.packet_id}`;
    assert.equal(commitmentOf(v.seed), v.commitment, where);
    // Block 0's message, as the document words it: redpacket/split/v1/<packet_id>/<total>/<count>/<j>.
    const block0 = hmacSha256(Buffer.from(v.seed, "hex"), `redpacket/split/v1/${v.packet_id}/${v.total}/${v.count}/0`);
    assert.equal(hex(block0), v.block0, where);
    const shares = fairShares(v.seed, v.packet_id, v.kind, v.total, v.count);
    assert.deepEqual(shares, v.shares, where);
    assert.equal(shares.reduce((a, b) => a + b, 0), v.total, where);
    assert.ok(shares.every((s) => s >= 1), where);
  }
});

test("a packet id is read as its exact decimal: a number, a string or a BigInt alike", () => {
  const v = VECTORS.find((x) => x.packet_id === "9223372036854775807");
  assert.deepEqual(fairShares(v.seed, 9223372036854775807n, v.kind, v.total, v.count), v.shares);
  const small = VECTORS.find((x) => x.kind === "lucky" && typeof x.packet_id === "number");
  for (const id of [small.packet_id, String(small.packet_id), BigInt(small.packet_id)]) {
    assert.deepEqual(fairShares(small.seed, id, small.kind, small.total, small.count), small.shares);
  }
  // A number past 2⁵³ has lost its value before it arrives: refused, not silently rounded.
  assert.throws(() => fairShares(v.seed, 9223372036854775807, v.kind, v.total, v.count), RangeError);
  assert.throws(() => commitmentOf("abc"), TypeError);
});

test("SHA-256 and HMAC-SHA-256 agree with node's crypto on every length from 0 to 300 bytes", () => {
  for (let n = 0; n <= 300; n++) {
    const data = randomBytes(n);
    assert.equal(hex(sha256(data)), createHash("sha256").update(data).digest("hex"), `${n} bytes`);
    for (const keyLength of [32, 32, n % 150]) {
      const key = randomBytes(keyLength); // mostly 32 bytes (a seed); some shorter and some past 64
      const want = createHmac("sha256", key).update(data).digest("hex");
      assert.equal(hex(hmacSha256(key, data)), want, `${n} bytes, key of ${keyLength}`);
    }
  }
  // A string is hashed as its UTF-8.
  assert.equal(hex(sha256("恭喜发财")), createHash("sha256").update("恭喜发财", "utf8").digest("hex"));
  assert.equal(hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
});

/** The document's example view with `change` applied to a deep copy. */
const viewWith = (change) => {
  const view = structuredClone(VIEW);
  change(view);
  return view;
};

test("the document's example packet view verifies, against the commitment kept or its own", () => {
  assert.ok(VIEW.seed && VIEW.commitment);
  const shares = VIEW.grabs.map((g) => g.amount);
  const verified = { status: "verified", problems: [], shares, againstSend: true };
  assert.deepEqual(verifyPacket(VIEW, VIEW.commitment), verified);
  // No commitment kept (the checker joined after the send): checked against the view's own only, and says so.
  for (const none of [undefined, null]) {
    assert.deepEqual(verifyPacket(VIEW, none), { ...verified, againstSend: false });
  }
  // A refunded packet lists fewer grabs than its count: the rest went back to the sender.
  assert.equal(verifyPacket(viewWith((v) => v.grabs.pop()), VIEW.commitment).status, "verified");
  // The packet id as a string or a BigInt (ids beyond 2⁵³ must come so) verifies the same.
  assert.equal(verifyPacket(viewWith((v) => (v.packet_id = String(v.packet_id)))).status, "verified");
  assert.equal(verifyPacket({ ...VIEW, packet_id: BigInt(VIEW.packet_id) }).status, "verified");
});

test("the last test vector: below(1) takes a word (the shuffle's last step draws too)", () => {
  const v = VECTORS.at(-1);
  assert.equal(v.count, 10);
  assert.deepEqual(fairShares(v.seed, v.packet_id, v.kind, v.total, v.count), v.shares);
});

/** A rigged server: a seed tried until the first grab (user 8) gets a big share, shown with its own
 * commitment and the grabs' amounts to match. */
function rigged() {
  for (let i = 0; ; i++) {
    const seed = hex(sha256(`rigged ${i}`));
    const shares = fairShares(seed, VIEW.packet_id, VIEW.kind, VIEW.total, VIEW.count);
    if (shares[0] > 800) {
      return viewWith((v) => {
        Object.assign(v, { seed, commitment: commitmentOf(seed) });
        v.grabs.forEach((g) => (g.amount = shares[g.seq - 1]));
      });
    }
  }
}

test("a seed and commitment swapped after the grabs: caught only against the commitment kept from the send", () => {
  const view = rigged();
  assert.notEqual(view.commitment, VIEW.commitment);
  // On its own the swapped pair holds together: only the commitment published at send tells.
  const alone = verifyPacket(view);
  assert.equal(alone.status, "verified");
  assert.equal(alone.againstSend, false);
  const kept = verifyPacket(view, VIEW.commitment);
  assert.equal(kept.status, "mismatch");
  assert.equal(kept.againstSend, true);
  assert.deepEqual(kept.problems, [
    `the commitment shown now is ${view.commitment}; the one published at send was ${VIEW.commitment}`,
  ]);
});

test("a tampered amount, a wrong seed, a malformed seed: each a mismatch that says what is wrong", () => {
  const tampered = verifyPacket(viewWith((v) => (v.grabs[0].amount += 1)), VIEW.commitment);
  assert.equal(tampered.status, "mismatch");
  assert.deepEqual(tampered.problems, [
    `grab 1 (user ${VIEW.grabs[0].user_id}) got ${VIEW.grabs[0].amount + 1} cents; share 1 is ${VIEW.grabs[0].amount}`,
  ]);
  // Amounts swapped between the grabs, each keeping its place: caught by amount.
  const amounts = verifyPacket(viewWith((v) => {
    [v.grabs[0].amount, v.grabs[1].amount] = [v.grabs[1].amount, v.grabs[0].amount];
  }));
  assert.equal(amounts.status, "mismatch");
  assert.equal(amounts.problems.length, 2);

  const otherSeed = "00".repeat(32);
  const wrongSeed = verifyPacket(viewWith((v) => (v.seed = otherSeed)), VIEW.commitment);
  assert.equal(wrongSeed.status, "mismatch");
  assert.equal(
    wrongSeed.problems[0], `sha256(seed) is ${commitmentOf(otherSeed)}, not the commitment ${VIEW.commitment}`,
  );
  assert.deepEqual(wrongSeed.shares, fairShares(otherSeed, VIEW.packet_id, VIEW.kind, VIEW.total, VIEW.count));

  for (const bad of [VIEW.seed.toUpperCase(), VIEW.seed.slice(2), `${VIEW.seed}\n`, 42]) {
    assert.deepEqual(verifyPacket(viewWith((v) => (v.seed = bad)), VIEW.commitment), {
      status: "mismatch", problems: ["the seed is not 64 lowercase hex digits"], shares: [], againstSend: true,
    });
  }
  // A commitment kept, and a view that shows none now (nor a seed): not "not verifiable" — a mismatch.
  const hidden = verifyPacket(viewWith((v) => Object.assign(v, { commitment: null, seed: null })), VIEW.commitment);
  assert.deepEqual(hidden.problems, [
    `the commitment shown now is null; the one published at send was ${VIEW.commitment}`,
    "the seed is not 64 lowercase hex digits",
  ]);
});

test("grab order: a skipped share verifies; a share listed twice, out of range or out of order is a mismatch", () => {
  const [u1, u2] = VIEW.grabs.map((g) => g.user_id);
  const check = (change) => verifyPacket(viewWith(change), VIEW.commitment);

  // Share 1 not listed (refunded, or its credit refused): no fault.
  assert.equal(check((v) => v.grabs.shift()).status, "verified");
  const v = VECTORS.find((x) => x.packet_id === 123456789);
  const listed = [1, 3, 4, 6, 7]; // shares 2 and 5 skipped
  const view = { packet_id: v.packet_id, kind: v.kind, total: v.total, count: v.count, seed: v.seed,
    commitment: v.commitment, grabs: listed.map((seq) => ({ user_id: 10 + seq, seq, amount: v.shares[seq - 1] })) };
  assert.deepEqual(verifyPacket(view, v.commitment), {
    status: "verified", problems: [], shares: v.shares, againstSend: true,
  });
  [view.grabs[1], view.grabs[2]] = [view.grabs[2], view.grabs[1]];
  assert.deepEqual(verifyPacket(view, v.commitment).problems, [
    "grab 3 (user 13) got share 3 after share 4: not handed out in the order drawn",
  ]);

  const descending = check((x) => x.grabs.reverse());
  assert.equal(descending.status, "mismatch");
  assert.deepEqual(descending.problems, [
    `grab 2 (user ${u1}) got share 1 after share 2: not handed out in the order drawn`,
  ]);

  const twice = check((x) => Object.assign(x.grabs[1], { seq: 1, amount: x.grabs[0].amount }));
  assert.equal(twice.status, "mismatch");
  assert.deepEqual(twice.problems, [`grab 2 (user ${u2}) got share 1, listed before`]);

  // A share number the packet does not have: said so, and no share to compare its amount with.
  for (const seq of [0, 3, 99, -1]) {
    const nowhere = check((x) => (x.grabs[1].seq = seq));
    assert.equal(nowhere.status, "mismatch");
    assert.deepEqual(nowhere.problems, [`grab 2 (user ${u2}) got share ${seq}: the packet has shares 1 to 2`]);
  }

  const extra = check((x) => x.grabs.push({ ...x.grabs[1], user_id: 9, seq: 3 }));
  assert.equal(extra.status, "mismatch");
  assert.deepEqual(extra.problems, [
    `3 grabs of a packet of ${VIEW.count} shares`,
    "grab 3 (user 9) got share 3: the packet has shares 1 to 2",
  ]);
});

test("no commitment and none kept: not verifiable (never failed); no seed yet: not revealed", () => {
  const nothing = (status) => ({ status, problems: [], shares: [], againstSend: false });
  const legacy = viewWith((v) => Object.assign(v, { commitment: null, seed: null }));
  assert.deepEqual(verifyPacket(legacy), nothing("not_verifiable"));
  assert.equal(verifyPacket(viewWith((v) => (v.commitment = null))).status, "not_verifiable");
  assert.deepEqual(verifyPacket(viewWith((v) => (v.seed = null))), nothing("not_revealed"));
  assert.deepEqual(verifyPacket(viewWith((v) => (v.seed = null)), VIEW.commitment), nothing("not_revealed"));
  // A view from a hub older than provably fair packets has neither field.
  const { commitment, seed, ...older } = VIEW;
  assert.ok(commitment && seed);
  assert.equal(verifyPacket(older).status, "not_verifiable");
});

// ---- the commitments the client keeps, against a socket that plays the hub -------------------------------

/** A WebSocket class whose sockets welcome at once (group 1) and answer each request type with
 * `answers[type](request)`; `deliver(msg)` plays a frame from the hub. */
function fakeHub(answers) {
  const hub = { sockets: [] };
  hub.WebSocket = class {
    constructor() {
      this.readyState = 0;
      hub.sockets.push(this);
      setTimeout(() => {
        this.readyState = 1;
        this.deliver({ type: "welcome", version: 1, user: 8, server_ms: Date.now(), groups: [{ group_id: 1 }] });
      });
    }

    send(data) {
      const msg = JSON.parse(data);
      const answer = answers[msg.type];
      if (answer) setTimeout(() => this.deliver({ type: "reply", id: msg.id, ok: true, data: answer(msg) }));
    }

    close() {
      this.readyState = 3;
    }

    deliver(msg) {
      if (this.readyState === 1) this.onmessage({ data: JSON.stringify(msg) });
    }
  };
  return hub;
}

const C = (n) => commitmentOf(n.toString(16).padStart(64, "0")); // distinct commitments, for keys

test("the client keeps each commitment heard before the seed: events, send, open and sync replies", async () => {
  const active = (id, commitment) => ({ ...VIEW, packet_id: id, commitment, seed: null });
  let opened = VIEW;
  const hub = fakeHub({
    // The sync after the welcome: one packet still active (kept), one already revealed (not kept).
    sync: () => ({ groups: { 1: { offset: "5-0", replayed: 0, too_old: false,
      packets: [active(21, C(21)), { ...VIEW, packet_id: 22, commitment: C(22), seed: VIEW.seed }] } } }),
    send: () => ({ packet_id: 30, sender: 8, kind: "lucky", total: 888, count: 2, commitment: C(30), offset: "6-0" }),
    open: (msg) => (msg.packet === "31" ? active(31, C(31)) : opened), // (ids go as text)
  });
  const client = new RedPacketClient({ url: "ws://hub.invalid/ws", token: "t", WebSocket: hub.WebSocket });
  const resets = [];
  client.on("reset", (r) => resets.push(r));
  await client.connect();
  assert.equal(resets.length, 1);
  assert.equal(client.commitment(21), C(21));
  assert.equal(client.commitment(22), undefined);

  // A packet event: kept before the app hears of it, so a listener can read it.
  const heard = [];
  client.on("packet", (e) => heard.push(client.commitment(e.data.packet_id)));
  const event = (offset, id, commitment) => ({ type: "event", group: 1, offset, event: "packet",
    data: { packet_id: id, sender: 7, kind: "lucky", total: 888, count: 2, commitment } });
  hub.sockets[0].deliver(event("7-0", 1, VIEW.commitment));
  assert.deepEqual(heard, [VIEW.commitment]);
  // The first heard stands: a later word on the same packet does not replace it.
  hub.sockets[0].deliver(event("8-0", 1, C(99)));
  assert.equal(client.commitment(1), VIEW.commitment);
  // A send reply, an open reply while active; ids as numbers, strings or BigInts alike.
  assert.equal((await client.send(1, { total: 888, count: 2 })).packet_id, 30);
  assert.equal(client.commitment(30), C(30));
  await client.open(1, 31);
  assert.equal(client.commitment("31"), C(31));
  assert.equal(client.commitment(31n), C(31));
  assert.equal(client.commitment(404), undefined);

  // verify: opens the packet and checks it against the commitment kept.
  assert.deepEqual(await client.verify(1, 1), {
    status: "verified", problems: [], shares: [53, 835], againstSend: true,
  });
  opened = rigged();
  const caught = await client.verify(1, 1);
  assert.equal(caught.status, "mismatch");
  assert.equal(
    caught.problems[0],
    `the commitment shown now is ${opened.commitment}; the one published at send was ${VIEW.commitment}`,
  );
  // A packet it never heard of: checked against the view's own commitment only.
  client.commitments.delete("1");
  assert.deepEqual(await client.verify(1, 1), { ...verifyPacket(opened), againstSend: false });
  assert.equal((await client.verify(1, 1)).status, "verified");
  client.close();
});

test("the client keeps the last COMMITMENTS_KEPT commitments: past them the oldest go", async () => {
  const hub = fakeHub({ sync: () => ({ groups: { 1: { offset: "0-0", replayed: 0, too_old: false } } }) });
  const client = new RedPacketClient({ url: "ws://hub.invalid/ws", token: "t", WebSocket: hub.WebSocket });
  await client.connect();
  const commitment = VIEW.commitment;
  for (let id = 1; id <= COMMITMENTS_KEPT + 2; id++) {
    const data = { packet_id: id, commitment };
    hub.sockets[0].deliver({ type: "event", group: 1, offset: `${id}-0`, event: "packet", data });
  }
  assert.equal(COMMITMENTS_KEPT, 10_000);
  assert.equal(client.commitments.size, COMMITMENTS_KEPT);
  assert.equal(client.commitment(1), undefined);
  assert.equal(client.commitment(2), undefined);
  assert.equal(client.commitment(3), commitment);
  assert.equal(client.commitment(COMMITMENTS_KEPT + 2), commitment);
  client.close();
});
