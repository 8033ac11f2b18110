// Words: what people see instead of error codes, money in yuan (integer cents everywhere else), times.

import { state } from "./state.js";

export const listOf = (names) => (names.length < 2 ? names.join("") : `${names.slice(0, -1).join(", ")} and ${names.at(-1)}`);

// A message, or a function of the error's extra fields (`limit`, `names`: docs/protocol.md).
export const MESSAGES = {
  insufficient_funds: "Not enough balance for this packet. Add demo money first.",
  not_member: "You are not a member of this group.",
  not_admin: "Only the group's admins can send red packets here.",
  not_target: "This red packet is for someone else.",
  packet_expired: "This red packet has expired.",
  packet_empty: "Too slow, all grabbed.",
  packet_not_found: "This red packet is no longer available.",
  rate_limited: "You are going too fast. Wait a moment and try again.",
  blocked: "Grabbing is paused for your account for now.",
  amount_invalid: "Enter an amount such as 8.88.",
  amount_too_large: (e) => `A red packet holds at most ${yuan(e.limit ?? state.limits.max_total_cents)}.`,
  count_invalid: "Enter how many people can grab it (at least 1).",
  count_too_large: (e) => {
    const limit = e.limit ?? state.limits.max_count;
    return limit < state.limits.max_count
      ? `At most ${shares(limit)}: one for each member of the group.`
      : `At most ${shares(limit)} in one red packet.`;
  },
  count_exceeds_amount: "Every share needs at least ¥0.01: lower the number of shares.",
  equal_not_divisible: "Equal shares must split exactly: change the amount or the number of shares.",
  greeting_too_long: (e) => `The greeting is too long (${e.limit ?? state.limits.max_greeting_chars} characters at most).`,
  greeting_invalid: "The greeting may not contain control characters or direction overrides.",
  text_invalid: "A message is 1 to 2,000 characters.",
  user_not_found: (e) =>
    e.names?.length
      ? `No one called ${listOf(e.names)} has used redpacket yet. Each person must log in once before an ` +
        "admin can add them; nobody was added."
      : "There is no such user.",
  name_invalid: "A name is 1 to 64 characters, with no control or invisible characters.",
  disabled: "That is switched off on this server.",
  redis_unavailable: "The service is busy. Try again in a moment.",
  database_unavailable: "The service is busy. Try again in a moment.",
  idempotency_key_reused: "That request was already made with other details.",
  offline: "You are offline. Wait until the connection is back.",
  timeout: "No answer from the server. Try again in a moment.",
};

export function say(err) {
  const m = MESSAGES[err.code];
  if (typeof m === "function") return m(err.details || {});
  return m || err.message || "Something went wrong. Please try again.";
}

export class ApiError extends Error {
  constructor(code, message, details = {}) {
    super(message);
    this.code = code;
    this.details = details;
  }
}

export function apiError(error) {
  const { code, message, ...details } = error || {};
  return new ApiError(code || "internal", message || "", details);
}

export function yuan(cents) {
  const sign = cents < 0 ? "-" : "";
  const c = Math.abs(cents);
  return `${sign}¥${Math.floor(c / 100)}.${String(c % 100).padStart(2, "0")}`;
}

export function parseCents(text) {
  // "8", "8.8", "8.88" → cents, without floating point.
  const m = /^\s*(\d{1,7})(?:\.(\d{1,2}))?\s*$/.exec(text);
  if (!m) return null;
  return Number(m[1]) * 100 + Number((m[2] || "").padEnd(2, "0"));
}

export const shares = (n) => `${n} share${n === 1 ? "" : "s"}`;

export const uuid = () => (crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`.slice(0, 60));

export function when(ms) {
  // "10:31", "yesterday 10:31", "tomorrow 10:31", or "3 Jan 10:31".
  const d = new Date(ms);
  const clock = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  const day = (x) => new Date(x.getFullYear(), x.getMonth(), x.getDate()).getTime();
  const days = Math.round((day(d) - day(new Date())) / 86_400_000);
  if (days === 0) return clock;
  if (days === -1) return `yesterday ${clock}`;
  if (days === 1) return `tomorrow ${clock}`;
  return `${d.toLocaleDateString([], { day: "numeric", month: "short" })} ${clock}`;
}
