// The protocol's names: its version and subprotocols, the close codes the client acts on, and the error it
// throws (docs/protocol.md, "Close codes" and "Error codes").

export const VERSION = "2.0.0";
// Protocol version 2: every user, group and packet id is its decimal string, both ways, in both formats —
// exact where a JavaScript number is not (beyond 2⁵³; chat backends' ids are 64-bit). docs/protocol.md, "Ids".
export const SUBPROTOCOL_JSON = "redpacket.v2.json";
export const SUBPROTOCOL_MSGPACK = "redpacket.v2.msgpack";

// Close codes after which reconnecting as before cannot help (docs/protocol.md, "Close codes"). 4001 is
// retried once with a token from `refreshToken`, when there is one; 4004 needs the backend to put the user
// first, so the app calls connect() again. (4030 is not final: see PATIENT_CLOSE_CODES.)
export const FINAL_CLOSE_CODES = Object.freeze([4001, 4004]);
export const CLOSE_RESTARTING = 1012; // the hub restarts: come back soon, to another hub if there is one
// Close codes after which the client waits its longest back-off before it tries again, as the Python client
// does (clients/python/redpacket_client/reconnecting.py): 4029, it kept sending past the rate limit;
// 4030, this user has too many sockets on the hub — it gets in once one of them closes (another tab,
// another device).
export const PATIENT_CLOSE_CODES = Object.freeze([4029, 4030]);
export const CLOSE_TOKEN = 4001;
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

/** A reply's `error` object as a RedPacketError. */
export function replyError(error) {
  const { code, message, ...details } = error || {};
  return new RedPacketError(code || "internal", message || "", details);
}
