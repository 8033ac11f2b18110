// Provably fair packets in the client (docs/protocol.md, "Provably fair packets"): the document's own test
// vectors and example packet view, read from the document itself; the hand-written SHA-256 and HMAC against
// node's crypto; and what verifyPacket says of a packet tampered with in each way it can be.
import assert from "node:assert/strict";
import { createHash, createHmac, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { commitmentOf, fairShares, hmacSha256, sha256, verifyPacket } from "../redpacket.js";

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

test("the document's example packet view verifies", () => {
  assert.ok(VIEW.seed && VIEW.commitment);
  const verdict = verifyPacket(VIEW);
  assert.deepEqual(verdict, { status: "verified", problems: [], shares: VIEW.grabs.map((g) => g.amount) });
  // A refunded packet lists fewer grabs than its count: the rest went back to the sender.
  assert.equal(verifyPacket(viewWith((v) => v.grabs.pop())).status, "verified");
  // The packet id as a string or a BigInt (ids beyond 2⁵³ must come so) verifies the same.
  assert.equal(verifyPacket(viewWith((v) => (v.packet_id = String(v.packet_id)))).status, "verified");
  assert.equal(verifyPacket({ ...VIEW, packet_id: BigInt(VIEW.packet_id) }).status, "verified");
});

test("a tampered amount, a swapped grab order, a wrong seed: each a mismatch that says what is wrong", () => {
  const tampered = verifyPacket(viewWith((v) => (v.grabs[0].amount += 1)));
  assert.equal(tampered.status, "mismatch");
  assert.deepEqual(tampered.problems, [
    `grab 1 (user ${VIEW.grabs[0].user_id}) got ${VIEW.grabs[0].amount + 1} cents; share 1 is ${VIEW.grabs[0].amount}`,
  ]);

  const swapped = verifyPacket(viewWith((v) => v.grabs.reverse()));
  assert.equal(swapped.status, "mismatch");
  assert.deepEqual(swapped.problems, [
    `grab 1 (user ${VIEW.grabs[1].user_id}) got share 2: not handed out in the order drawn`,
    `grab 2 (user ${VIEW.grabs[0].user_id}) got share 1: not handed out in the order drawn`,
  ]);
  // Amounts swapped between the grabs, each keeping its place: caught by amount.
  const amounts = verifyPacket(viewWith((v) => {
    [v.grabs[0].amount, v.grabs[1].amount] = [v.grabs[1].amount, v.grabs[0].amount];
  }));
  assert.equal(amounts.status, "mismatch");
  assert.equal(amounts.problems.length, 2);

  const otherSeed = "00".repeat(32);
  const wrongSeed = verifyPacket(viewWith((v) => (v.seed = otherSeed)));
  assert.equal(wrongSeed.status, "mismatch");
  assert.equal(
    wrongSeed.problems[0],
    `sha256(seed) is ${commitmentOf(otherSeed)}, the commitment published at send ${VIEW.commitment}`,
  );
  assert.deepEqual(wrongSeed.shares, fairShares(otherSeed, VIEW.packet_id, VIEW.kind, VIEW.total, VIEW.count));

  for (const bad of [VIEW.seed.toUpperCase(), VIEW.seed.slice(2), `${VIEW.seed}\n`, 42]) {
    assert.deepEqual(verifyPacket(viewWith((v) => (v.seed = bad))), {
      status: "mismatch", problems: ["the seed is not 64 lowercase hex digits"], shares: [],
    });
  }

  const extra = verifyPacket(viewWith((v) => v.grabs.push({ ...v.grabs[1], user_id: 9, seq: 3 })));
  assert.equal(extra.status, "mismatch");
  assert.deepEqual(extra.problems, [`3 grabs of a packet of ${VIEW.count} shares`]);
  // A share number the packet does not have: out of order, and no share to compare its amount with.
  const nowhere = verifyPacket(viewWith((v) => (v.grabs[1].seq = 99)));
  assert.deepEqual(nowhere.problems, [
    `grab 2 (user ${VIEW.grabs[1].user_id}) got share 99: not handed out in the order drawn`,
  ]);
});

test("no commitment: not verifiable (never failed); no seed yet: not revealed", () => {
  assert.deepEqual(verifyPacket(viewWith((v) => Object.assign(v, { commitment: null, seed: null }))), {
    status: "not_verifiable", problems: [], shares: [],
  });
  assert.equal(verifyPacket(viewWith((v) => (v.commitment = null))).status, "not_verifiable");
  assert.deepEqual(verifyPacket(viewWith((v) => (v.seed = null))), {
    status: "not_revealed", problems: [], shares: [],
  });
  // A view from a hub older than provably fair packets has neither field.
  const { commitment, seed, ...older } = VIEW;
  assert.ok(commitment && seed);
  assert.equal(verifyPacket(older).status, "not_verifiable");
});
