// Types of the redpacket hub's JavaScript client (redpacket.js). The protocol: docs/protocol.md.

export declare const VERSION: string;
export declare const SUBPROTOCOL_JSON: "redpacket.v2.json";
export declare const SUBPROTOCOL_MSGPACK: "redpacket.v2.msgpack";
/** Close codes after which the client does not reconnect by itself: 4001 (once retried with refreshToken)
 * and 4004. After 4029 and 4030 it reconnects after its longest back-off (maxDelayMs × 0.5–1). */
export declare const FINAL_CLOSE_CODES: readonly number[];
export declare const EVENT_TYPES: readonly EventType[];
/** How many packets' commitments a client keeps (10,000): past it the oldest go. */
export declare const COMMITMENTS_KEPT: number;

/** An id of a user, group or packet, 1 to 2⁶³−1, as every id arrives (protocol version 2, both formats): its
 * decimal string, exact beyond 2⁵³ where a number is not. Compare ids as strings. */
export type Id = string;
/** An id given to a method: its decimal string (as it arrived), a BigInt, or a number up to 2⁵³ − 1 (a
 * larger number is not exact: RangeError). */
export type IdInput = string | bigint | number;
/** An event's position in its group: "<ms>-<seq>". */
export type Offset = string;

export interface ClientOptions {
  /** The hub's websocket address, e.g. "wss://hub.example.com/ws". */
  url: string;
  /** A JWT, or a function giving one (called before every connection unless refreshToken is given). */
  token?: string | (() => string | Promise<string>);
  /** Gives a fresh token: called before every reconnect, and after a close 4001 (token expired or
   * refused; a second 4001 before a welcome is final). */
  refreshToken?: () => string | Promise<string>;
  /** "json" (default, text frames) or "msgpack" (binary frames). */
  format?: "json" | "msgpack";
  /** A stable id of this device, for the bot detector (docs/protocol.md, "Connecting"). */
  device?: string;
  /** A WebSocket constructor (default globalThis.WebSocket; Node 20 has one with --experimental-websocket). */
  WebSocket?: new (url: string, protocols: string[]) => WebSocket;
  /** How long a request waits for its reply before it is rejected with code "timeout" (10,000 ms). */
  requestTimeoutMs?: number;
  /** A connection not welcomed this long after it was opened is dropped and tried again (10,000 ms). */
  connectTimeoutMs?: number;
  /** false: never reconnect by itself. */
  reconnect?: boolean;
  /** Back-off: the n-th reconnect in a row waits a random time from 0 to min(maxDelayMs, minDelayMs × 2ⁿ⁻¹);
   * after a close 4029 or 4030, maxDelayMs × 0.5–1. */
  minDelayMs?: number;
  maxDelayMs?: number;
  /** Reconnects in a row without a welcome before giving up (Infinity). */
  maxAttempts?: number;
  /** What a group with no offset yet is synced from: null (from now, with its open packets as a "reset"
   * event) or "0-0" (its recent history, replayed). */
  firstOffset?: Offset | null;
  /** The last offset of each group seen before (e.g. stored by an earlier session: lastOffsets()). */
  offsets?: Record<string, Offset>;
  /** Awaited after each welcome, before the client syncs (the hub holds events until the sync). */
  beforeSync?: (welcome: Welcome) => unknown;
}

export interface GroupInfo {
  group_id: Id;
  name: string;
  role: "member" | "admin";
  members_can_send: boolean;
  members: number;
}

export interface Welcome {
  type: "welcome";
  /** The protocol version this client speaks: 2 (ids as strings). */
  version: 2;
  user: Id;
  connection: string;
  hub: string;
  server_ms: number;
  groups: GroupInfo[];
  limits: { max_count: number; max_total_cents: number; max_greeting_chars: number; packet_ttl_seconds: number };
  /** true when this welcome follows a reconnect. */
  reconnect?: boolean;
}

export interface Grab {
  user_id: Id;
  seq: number;
  amount: number;
  grabbed_ms: number;
}

/** The packet view: `open`, and the `packets` of a sync. */
export interface PacketView {
  packet_id: Id;
  group_id: Id;
  sender_id: Id;
  kind: "lucky" | "equal" | "exclusive";
  total: number;
  count: number;
  greeting: string;
  target?: Id | null;
  created_ms: number;
  expires_ms: number;
  remaining: number;
  grabs: Grab[];
  mine: Grab | null;
  finished_ms: number | null;
  best_luck: Grab | null;
  duration_ms: number | null;
  /** sha256(seed) in lowercase hex, published at send; null for a packet sent before packets were provably
   * fair (not verifiable). See verifyPacket. */
  commitment: string | null;
  /** The packet's 32-byte seed in lowercase hex: null until the packet is finished or refunded. */
  seed: string | null;
}

export interface SentPacket {
  packet_id: Id;
  sender: Id;
  kind: "lucky" | "equal" | "exclusive";
  total: number;
  count: number;
  greeting: string;
  target: Id | null;
  created_ms: number;
  expires_ms: number;
  commitment: string | null;
  offset: Offset | null;
  replay: boolean;
}

export interface GrabReply {
  packet: Id;
  outcome: "won" | "already";
  user_id: Id;
  seq: number;
  amount: number;
  grabbed_ms: number;
  remaining: number;
}

export interface NewPacket {
  kind?: "lucky" | "equal" | "exclusive";
  total: number;
  count?: number;
  greeting?: string;
  target?: IdInput;
  /** Makes a retried send pay once (1 to 64 characters). */
  request_id?: string;
}

export interface SyncResult {
  offset?: Offset;
  replayed?: number;
  too_old?: boolean;
  packets?: PacketView[];
  error?: string;
}

export interface EventData {
  chat: { user: Id; text: string };
  packet: {
    packet_id: Id; sender: Id; kind: "lucky" | "equal" | "exclusive"; total: number; count: number;
    greeting: string; target: Id | null; created_ms: number; expires_ms: number; commitment: string | null;
  };
  grabs: {
    grabs: { packet_id: Id; user: Id; amount: number; seq: number; ms: number; remaining: number }[];
    more?: number;
    remaining?: Record<string, number>;
  };
  finished: {
    packet_id: Id; total: number; count: number; duration_ms: number; best_luck: { user: Id; amount: number };
    commitment: string | null; seed: string | null;
    grabs?: EventData["grabs"]["grabs"]; more?: number;
  };
  presence: { user: Id; online: boolean };
  member_added: { user: Id; role: string; /** "0": the chat backend */ by: Id };
  member_removed: { user: Id; by: Id };
  member_role: { user: Id; role: string; by: Id };
}

export type EventType = keyof EventData;

/** A group event, as the hub sends it. */
export interface GroupEvent<T extends EventType = EventType> {
  type: "event";
  group: Id;
  offset: Offset;
  event: T;
  data: EventData[T];
}

export type Status = "idle" | "connecting" | "online" | "reconnecting" | "closed";

/** Each group event type, as its own event. */
export type GroupEvents = { [T in EventType]: GroupEvent<T> };

export interface ClientEvents extends GroupEvents {
  /** Every group event, each once, in offset order per group. */
  event: GroupEvent;
  welcome: Welcome;
  /** A sync's reply, after the events it replayed. reason: "welcome" (the first connection), "reconnect",
   * "gap" (after a gap notice), "manual" (client.sync()). */
  synced: { groups: Record<string, SyncResult>; reason: "welcome" | "reconnect" | "gap" | "manual"; replayed: number };
  /** A group synced with no offset (a fresh start) or one the hub no longer holds (tooOld): show these
   * packets as the group's state; previous is the offset the client had. */
  reset: { group: Id; offset: Offset; packets: PacketView[]; tooOld: boolean; previous: Offset | null };
  removed: { group: Id };
  added: { group: Id };
  gap: { group: Id };
  status: { status: Status; code?: number; reason?: string; retryInMs?: number };
  close: { code: number; reason: string; willRetry: boolean; forced: boolean };
  /** An error thrown by a handler or callback of the app (without a listener, thrown where the runtime
   * reports uncaught errors). */
  error: Error;
}

export declare class RedPacketError extends Error {
  /** The protocol's error code, or "offline" / "timeout"; a final close's reason before any welcome. */
  code: string;
  /** The error's other fields: `limit`, `names`; `closeCode` for a close. */
  details: Record<string, unknown>;
  constructor(code: string, message?: string, details?: Record<string, unknown>);
}

export declare class RedPacketClient {
  constructor(options: ClientOptions);
  readonly status: Status;
  /** The latest welcome. */
  readonly welcome: Welcome | null;
  on<K extends keyof ClientEvents>(type: K, handler: (payload: ClientEvents[K]) => void): () => void;
  off<K extends keyof ClientEvents>(type: K, handler: (payload: ClientEvents[K]) => void): void;
  once<K extends keyof ClientEvents>(type: K): Promise<ClientEvents[K]>;
  /** Connect and stay connected; resolves with the first welcome once its sync is answered. */
  connect(): Promise<Welcome>;
  /** Close for good (no reconnect). */
  close(): void;
  /** Drop the socket as a lost network would, and reconnect. */
  reconnectNow(): void;
  request<T = unknown>(type: string, fields?: Record<string, unknown>, options?: { timeoutMs?: number }): Promise<T>;
  sync(groups?: IdInput[], reason?: string): Promise<Record<string, SyncResult>>;
  ping(): Promise<{ ts: number }>;
  chat(group: IdInput, text: string): Promise<{ offset: Offset }>;
  send(group: IdInput, packet: NewPacket): Promise<SentPacket>;
  grab(group: IdInput, packet: IdInput): Promise<GrabReply>;
  open(group: IdInput, packet: IdInput): Promise<PacketView>;
  presence(group: IdInput): Promise<{ group: Id; online: Id[] }>;
  /** The last offset seen per group (group id as a string → offset). */
  lastOffsets(): Record<string, Offset>;
  /** Each packet's commitment as this client heard it before the seed was shown (from `packet` events,
   * send and open replies, the packets of a sync or reset whose seed is null), by the packet id's decimal,
   * oldest first; the first heard stands; at most COMMITMENTS_KEPT. */
  readonly commitments: ReadonlyMap<string, string>;
  /** The packet's commitment as this client heard it before its seed was shown, or undefined. */
  commitment(packet: PacketIdInput): string | undefined;
  /** Opens the packet and checks it with verifyPacket against the commitment kept (`againstSend` says
   * whether there was one). */
  verify(group: IdInput, packet: IdInput): Promise<FairVerdict>;
}

/** An id as the hub takes it: `idText("group", 7)` is "7"; a number beyond 2⁵³ throws a RangeError. */
export declare function idText(name: string, id: IdInput): Id;

export declare function isNewer(a: Offset, b: Offset | null | undefined): boolean;
export declare function encodeMsgpack(value: unknown): Uint8Array;
export declare function decodeMsgpack(bytes: Uint8Array | ArrayBuffer): unknown;

// ---- provably fair packets (docs/protocol.md, "Provably fair packets"): synchronous, no crypto.subtle ----

/** A packet id for the generator's message, which needs its exact decimal: a decimal string (as every id
 * arrives from the hub), a BigInt or a number up to 2⁵³ − 1; a number beyond 2⁵³ throws a RangeError. */
export type PacketIdInput = number | string | bigint;

export type FairStatus = "verified" | "mismatch" | "not_verifiable" | "not_revealed";

export interface FairVerdict {
  /** verified: every grab listed got the share drawn for it, in the order drawn; mismatch: see problems;
   * not_verifiable: no commitment and none kept (sent before packets were provably fair — never a failure);
   * not_revealed: no seed yet (the packet is still active). */
  status: FairStatus;
  /** Every fault found, in English (empty unless mismatch). */
  problems: string[];
  /** The recomputed shares in the order they were handed out (share seq is item seq − 1); empty without a
   * usable seed. */
  shares: number[];
  /** The view's commitment was checked against the one published at send (`published` was given). Without
   * it, a seed chosen after the grabs, shown with a commitment made to match, would go unseen: say that
   * the check was against the view's own commitment only. */
  againstSend: boolean;
}

/** What verifyPacket reads of a packet view (`open`, `GET /api/packets/{p}`). */
export interface VerifiableView {
  packet_id: PacketIdInput;
  kind: string;
  total: number | bigint;
  count: number | bigint;
  commitment?: string | null;
  seed?: string | null;
  grabs: { user_id: Id | bigint | string; seq: number | bigint; amount: number | bigint }[];
}

/** Checks a packet view as docs/protocol.md says (and as the Python client's
 * redpacket_client.fairness.verify does):
 * its commitment against `published` — the one kept from before the seed was shown (the send reply, the
 * `packet` event, a view while active: `client.commitment(packet)`) —, the seed against the commitment,
 * then each grab, in the order listed: its seq one of the packet's shares, not listed before, above every
 * seq listed before it (a seq not listed is no fault), its amount that share's; no more grabs than
 * shares. Synchronous. */
export declare function verifyPacket(view: VerifiableView, published?: string | null): FairVerdict;
/** The shares of a packet in the order they are handed out, recomputed from its seed (64 hex digits). */
export declare function fairShares(
  seedHex: string, packetId: PacketIdInput, kind: string, total: number, count: number,
): number[];
/** sha256 of the seed's 32 bytes (not of its hex), in lowercase hex: the commitment published at send. */
export declare function commitmentOf(seedHex: string): string;
/** SHA-256 (a string is hashed as its UTF-8), written in plain JavaScript: synchronous, works where
 * crypto.subtle is absent (a page served over plain http from a LAN address). */
export declare function sha256(data: Uint8Array | string): Uint8Array;
/** HMAC-SHA-256 (RFC 2104), plain JavaScript like sha256. */
export declare function hmacSha256(key: Uint8Array | string, message: Uint8Array | string): Uint8Array;
