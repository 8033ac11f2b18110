// The HTTP API: what is not live (log-in, balance, groups, members), ids as strings (redpacket.v2).

import { $, group, state } from "./state.js";
import { ApiError, apiError, yuan } from "./words.js";
import { renderGroups, renderMembers } from "./render.js";
import { logout } from "./actions.js";

export async function api(method, path, body) {
  // Ids as strings, as the websocket's (redpacket.v2) are: exact beyond 2^53, and one type for the Maps' keys.
  const headers = { "content-type": "application/json", "redpacket-ids": "string" };
  if (state.token) headers.authorization = `Bearer ${state.token}`;
  let r;
  try {
    r = await fetch(path, { method, headers, body: body ? JSON.stringify(body) : undefined });
  } catch (e) {
    throw new ApiError("offline", String(e));
  }
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    if (r.status === 401) logout();
    throw apiError(data.error || { message: r.statusText });
  }
  return data;
}

export async function refreshMe() {
  const data = await api("GET", "/api/me");
  const before = state.me?.balance;
  state.me = data;
  state.names.set(data.user_id, data.name);
  for (const info of data.groups) group(info.group_id).info = info;
  for (const id of [...state.groups.keys()]) {
    if (!data.groups.some((g) => g.group_id === id)) state.groups.delete(id);
  }
  $("me-name").textContent = data.name;
  $("balance").textContent = yuan(data.balance);
  if (before !== undefined && before !== data.balance) {
    const b = $("balance").parentElement;
    b.classList.remove("bump");
    void b.offsetWidth;
    b.classList.add("bump");
  }
  renderGroups();
}

export async function loadMembers(id) {
  const data = await api("GET", `/api/groups/${id}/members`);
  const g = group(id);
  g.members = new Map(data.members.map((m) => [m.user_id, m]));
  for (const m of data.members) state.names.set(m.user_id, m.name);
  if (id === state.current) renderMembers();
}
