// The redpacket demo page: plain JavaScript, no build step, an ES module. It talks to the hub through the
// JavaScript client (clients/js, served at /client/: the socket in JSON mode, reconnection, sync from the
// last offset of each group, requests by id; docs/protocol.md) and the HTTP API for what is not live.
//
// One module a concept, plain ES modules served as they are: state.js, words.js, http.js, live.js (the
// socket), render.js, sheet.js (the packet sheet), actions.js; this one wires the page's controls to them.

import { $, phone, state } from "./state.js";
import { say, uuid } from "./words.js";
import { api, loadMembers, refreshMe } from "./http.js";
import { el, layoutMembers, selectGroup, showError, toast } from "./render.js";
import { pressOpen } from "./sheet.js";
import { kindChanged, login, logout, openSendDialog, sendChat, sendPacket, showHistory, start } from "./actions.js";

// ---- wiring --------------------------------------------------------------------------------------------

$("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  login($("login-name").value.trim());
});
for (const name of ["alice", "bob", "carol", "dave"]) {
  $("quick-names").append(el("button", { class: "small", type: "button", onclick: () => login(name) }, name));
}
$("logout").addEventListener("click", logout);
$("back").addEventListener("click", () => selectGroup(null));
$("composer").addEventListener("submit", sendChat);
$("open-send").addEventListener("click", openSendDialog);
for (const radio of document.querySelectorAll('input[name="kind"]')) radio.addEventListener("change", kindChanged);
$("send-cancel").addEventListener("click", () => $("send-dialog").close());
$("send-form").addEventListener("submit", sendPacket);
$("pd-open").addEventListener("click", pressOpen);
$("packet-close").addEventListener("click", () => $("packet-dialog").close());
$("packet-dialog").addEventListener("close", () => {
  // Back to the packet's bubble (drawn anew since it was pressed), for the keyboard.
  const id = state.shown.packet;
  state.shown = { group: null, packet: null };
  if (id !== null) document.querySelector(`#messages .packet[data-packet="${id}"]`)?.focus();
});
$("my-packets").addEventListener("click", showHistory);
$("history-close").addEventListener("click", () => $("history-dialog").close());
$("members-toggle").addEventListener("click", () => layoutMembers($("members-pane").hidden));
$("members-close").addEventListener("click", () => layoutMembers(false));
$("scrim").addEventListener("click", () => layoutMembers(false));
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && phone.matches && !$("members-pane").hidden && !document.querySelector("dialog[open]")) {
    layoutMembers(false);
  }
});
phone.addEventListener("change", () => layoutMembers(false));
$("topup").addEventListener("click", async () => {
  try {
    await api("POST", "/api/topup", { amount: 10_000, request_id: uuid() });
    await refreshMe();
    toast("¥100.00 of demo money added");
  } catch (e) {
    showError(e);
  }
});
$("new-group").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const data = await api("POST", "/api/groups", { name: $("new-group-name").value.trim(),
      members_can_send: $("new-group-open").checked });
    $("new-group").reset();
    await refreshMe();
    selectGroup(data.group_id);
  } catch (e) {
    showError(e);
  }
});
$("add-member").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const names = $("add-names").value.split(",").map((s) => s.trim()).filter(Boolean);
  try {
    $("add-error").textContent = "";
    await api("POST", `/api/groups/${state.current}/members`, { names });
    $("add-names").value = "";
    await loadMembers(state.current);
  } catch (e) {
    $("add-error").textContent = say(e);
  }
});

if (state.token) start();
else $("login").hidden = false;
