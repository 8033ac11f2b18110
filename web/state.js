// The page's state, and the names every part of it reads: the element by id, the hub's clock, who is who.

export const $ = (id) => document.getElementById(id);

export const phone = window.matchMedia("(max-width: 700px)");

export const state = {
  token: sessionStorage.getItem("rp.token"),
  me: null, // {user_id, name, balance, groups}
  groups: new Map(), // id (every id is its decimal string: redpacket.v2) → {info, offset, members: Map id→{name, role}, online: Set, items: [], packets: Map, unread}
  current: null,
  client: null, // the RedPacketClient of this log-in
  connState: "offline",
  everOnline: false,
  shownBefore: 0, // lines of the rooms before a welcome's sync: what it filled in is the difference
  names: new Map(), // user id → name, across groups
  skewMs: 0, // the hub's clock minus this browser's, from the welcome
  limits: { max_count: 100, max_total_cents: 20_000, max_greeting_chars: 64, packet_ttl_seconds: 86_400 },
  shown: { group: null, packet: null }, // the packet in the packet sheet
  expiryTimer: null,
};

window.state = state; // a module's names are its own: the console (and the tests) look at the page's state

export function group(id) {
  let g = state.groups.get(id);
  if (!g) {
    g = { info: { group_id: id, name: `group ${id}`, role: "member" }, members: new Map(),
      online: new Set(), items: [], packets: new Map(), unread: 0, synced: false };
    state.groups.set(id, g);
  }
  return g;
}

export const me = () => state.me?.user_id;

export const nameOf = (user) => (user === me() ? "You" : state.names.get(user) || `user ${user}`);

export const serverNow = () => Date.now() + state.skewMs;

export const offsetMs = (offset) => Number(String(offset).split("-")[0]);
