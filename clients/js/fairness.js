// ---- provably fair packets (docs/protocol.md, "Provably fair packets") -----------------------------------
//
// A packet's shares are drawn at send from a secret 32-byte seed; the send publishes sha256(seed), the
// `commitment`, and the finished (or refunded) packet reveals the `seed`. From the seed and the packet's id,
// kind, total and count anyone recomputes the shares in the order they were handed out. The same algorithm
// as the Python client's clients/python/redpacket_client/fairness.py (the hub draws with it), checked
// against the document's test vectors.
//
// Synchronous, so that a page can check a packet as it draws it (sha256.js says why SHA-256 is written out).

import { hmacSha256, sha256, toHex } from "./sha256.js";

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
