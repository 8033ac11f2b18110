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
//
// The package is this index and one module a concept, plain ES modules served as they are (no build step):
// codes.js (the protocol's names, RedPacketError), client.js (RedPacketClient), msgpack.js, fairness.js
// (verifyPacket and the draw it checks) and sha256.js. What is exported here is the package's API
// (redpacket.d.ts); the rest is the modules' own.

export { COMMITMENTS_KEPT, FINAL_CLOSE_CODES, RedPacketError, SUBPROTOCOL_JSON, SUBPROTOCOL_MSGPACK, VERSION } from "./codes.js";
export { EVENT_TYPES, RedPacketClient, idText, isNewer } from "./client.js";
export { commitmentOf, fairShares, verifyPacket } from "./fairness.js";
export { decodeMsgpack, encodeMsgpack } from "./msgpack.js";
export { hmacSha256, sha256 } from "./sha256.js";
