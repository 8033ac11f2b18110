// The packet sheet: its card (sender, greeting, 開), then its result (amount, who got how much, fair ✓).

import { verifyPacket } from "/client/redpacket.js";
import { $, group, me, nameOf, serverNow, state } from "./state.js";
import { say, shares, when, yuan } from "./words.js";
import { api, refreshMe } from "./http.js";
import { request } from "./live.js";
import { el, forSomeoneElse, grabbable, renderChat, showError, timeEl, toast } from "./render.js";

// Refusals that are the packet's answer (shown as its result); any other leaves the card up to try again.
export const FINAL_REFUSALS = ["packet_empty", "packet_expired", "not_target", "packet_not_found"];

export function fromLine(sender) {
  return sender === me() ? "Your red packet" : `${nameOf(sender)}'s red packet`;
}

export async function openPacket(groupId, packetId) {
  const p = group(groupId).packets.get(packetId);
  if (!p) return;
  state.shown = { group: groupId, packet: packetId };
  if (grabbable(p)) showCard(p);
  else await showResult(groupId, packetId, null);
}

export function showCard(p) {
  const dlg = $("packet-dialog");
  dlg.dataset.face = "card";
  $("pd-from").textContent = fromLine(p.sender);
  $("pd-greeting").textContent = p.greeting || "Best wishes!";
  $("pd-amount").textContent = "";
  $("pd-note").textContent = "";
  $("pd-expiry").textContent = p.expires_ms ? `Open before ${when(p.expires_ms)}` : "";
  setOpening(p.grabbing);
  if (!dlg.open) dlg.showModal();
  $("pd-open").focus();
}

export function setOpening(on) {
  // The coin spins while the grab is in flight. It stays enabled (a disabled button would drop keyboard
  // focus); a second press meanwhile is ignored.
  const coin = $("pd-open");
  coin.classList.toggle("spinning", Boolean(on));
  coin.setAttribute("aria-busy", String(Boolean(on)));
}

export async function pressOpen() {
  const { group: groupId, packet: packetId } = state.shown;
  const p = groupId === null ? null : group(groupId).packets.get(packetId);
  if (!p || p.grabbing) return;
  p.grabbing = true;
  setOpening(true);
  $("pd-note").textContent = "";
  renderChat();
  let won = null;
  let refusal = null;
  try {
    const r = await request("grab", { group: groupId, packet: packetId });
    p.mine = { amount: r.amount };
    p.remaining = Math.min(p.remaining, r.remaining);
    if (r.outcome === "won") won = r;
  } catch (e) {
    if (e.code === "packet_empty") p.remaining = 0;
    refusal = e;
  } finally {
    p.grabbing = false;
    renderChat();
  }
  const stillShown = $("packet-dialog").open && state.shown.packet === packetId;
  if (stillShown) setOpening(false);
  if (won) waitForCredit(packetId, won.amount);
  if (!stillShown) {
    if (refusal && !FINAL_REFUSALS.includes(refusal.code)) showError(refusal);
    return;
  }
  if (refusal && !FINAL_REFUSALS.includes(refusal.code)) {
    $("pd-note").textContent = say(refusal);
    return;
  }
  await showResult(groupId, packetId, refusal);
}

export async function showResult(groupId, packetId, refusal) {
  // The commitment the page's client heard before the seed was shown (the send reply, the packet event,
  // a view while active): what binds the revealed seed to the send (docs/protocol.md, "Keep the commitment").
  const kept = state.client?.commitment(packetId);
  let view;
  try {
    view = await request("open", { group: groupId, packet: packetId });
  } catch (e) {
    if ($("packet-dialog").open) $("pd-note").textContent = say(e);
    else showError(e);
    return;
  }
  const p = group(groupId).packets.get(packetId);
  if (p && view.mine) p.mine = { amount: view.mine.amount };
  const done = view.duration_ms !== null && view.duration_ms !== undefined;
  const over = !done && serverNow() > view.expires_ms;
  let note = "";
  if (view.mine) note = "Goes to your balance";
  else if (refusal) note = say(refusal);
  else if (p && forSomeoneElse(p)) note = say({ code: "not_target" });
  else if (over) note = say({ code: "packet_expired" });
  else if (view.remaining === 0 && view.sender_id !== me()) note = say({ code: "packet_empty" });
  $("pd-from").textContent = fromLine(view.sender_id);
  $("pd-greeting").textContent = view.greeting || "Best wishes!";
  $("pd-amount").textContent = view.mine ? yuan(view.mine.amount) : "";
  $("pd-note").textContent = note;
  const owner = view.sender_id === me() ? "you" : nameOf(view.sender_id);
  const left = view.remaining;
  $("pd-expiry").textContent = done ? ""
    : over ? `Expired ${when(view.expires_ms)}: the ${shares(left)} left go back to ${owner}.`
    : `Shares not opened by ${when(view.expires_ms)} go back to ${owner}.`;
  $("pd-summary").textContent = done
    ? `${shares(view.count)}, ${yuan(view.total)}, all grabbed in ${(view.duration_ms / 1000).toFixed(1)} s`
    : `${view.grabs.length} of ${shares(view.count)} grabbed, ${yuan(view.total)} in all`;
  // Best luck means something only where amounts were left to luck.
  const best = done && view.best_luck && view.kind === "lucky" && view.count > 1 ? view.best_luck.user_id : null;
  $("pd-grabs").replaceChildren(...view.grabs.map((gr) => el("li", { "data-user": gr.user_id },
    el("span", {}, nameOf(gr.user_id), timeEl(gr.grabbed_ms)),
    el("span", {}, yuan(gr.amount), gr.user_id === best ? el("span", { class: "best" }, "★ Best luck") : null))));
  showFairness(view, kept, done || over);
  const dlg = $("packet-dialog");
  dlg.dataset.face = "result";
  if (!dlg.open) dlg.showModal();
  $("packet-close").focus();
}

// Provably fair packets (docs/protocol.md): once a packet is finished or refunded its view reveals the seed
// its shares were drawn from, and the client recomputes them here, in the browser, and checks the view's
// commitment against the one the page kept from before the seed was shown. "fair ✓", or "fair ✗ mismatch"
// with what is wrong; "not verifiable" for a packet sent before packets were provably fair. A page that
// never heard of the packet while it was active (opened after it finished) kept none: "fair ✓" then says
// in its proof that the commitment was checked against the one shown now only.
export const FAIR_WORDS = { verified: "fair ✓", mismatch: "fair ✗ mismatch" };

export function fairText(verdict) {
  if (verdict.status !== "verified") return "Checked here, the packet's proof does not hold:";
  const drawn = "Recomputed here from this seed, the shares match every grab, in order.";
  if (verdict.againstSend) {
    return "The shares were drawn at send from this seed: its SHA-256, the commitment, is the one this page" +
      ` received before the seed was shown. ${drawn}`;
  }
  return `${drawn} This page did not see the packet sent, so the commitment was checked against the one` +
    " shown now only: compare it with the one published at send.";
}

export function showFairness(view, kept, settled) {
  const box = $("pd-fair");
  const proof = $("pd-proof");
  proof.hidden = true;
  proof.replaceChildren();
  box.replaceChildren();
  let verdict;
  try {
    verdict = verifyPacket(view, kept);
  } catch (e) {
    verdict = { status: "mismatch", problems: [`the packet view cannot be checked: ${e.message}`], shares: [],
      againstSend: kept !== undefined };
  }
  // Nothing to say while the packet is active (or its refund is not closed yet): the seed is still secret.
  box.hidden = verdict.status === "not_revealed" || (verdict.status === "not_verifiable" && !settled);
  if (box.hidden) return;
  if (verdict.status === "not_verifiable") {
    box.append(el("span", { class: "fair-muted", title: "Sent before packets were provably fair" }, "not verifiable"));
    return;
  }
  const ok = verdict.status === "verified";
  const toggle = el("button", { type: "button", class: `fair-badge ${ok ? "ok" : "bad"}`, "aria-expanded": "false",
    "aria-controls": "pd-proof", "aria-label": `${FAIR_WORDS[verdict.status]}: show the proof`,
    "data-against-send": String(verdict.againstSend) }, FAIR_WORDS[verdict.status]);
  toggle.addEventListener("click", () => {
    proof.hidden = !proof.hidden;
    toggle.setAttribute("aria-expanded", String(!proof.hidden));
  });
  box.append(toggle);
  const code = (text) => el("code", {}, String(text));
  proof.append(
    el("p", { class: verdict.againstSend ? "" : "unkept" }, fairText(verdict)),
    el("ul", { class: "problems" }, ...verdict.problems.map((x) => el("li", {}, x))),
    el("dl", {},
      el("dt", {}, "Seed"), el("dd", { class: "seed" }, code(view.seed)),
      el("dt", {}, "Commitment shown now"), el("dd", { class: "commitment" }, code(view.commitment)),
      el("dt", {}, "Commitment received before the seed"),
      el("dd", { class: "kept" }, kept === undefined ? "none: this page did not see the packet sent" : code(kept)),
      el("dt", {}, "Shares in order"), el("dd", { class: "shares" }, verdict.shares.map(yuan).join(" · ") || "—")));
}

export async function waitForCredit(packetId, amount) {
  // The worker credits the grab into the ledger a moment later; show the balance when it has.
  for (let i = 0; i < 120; i++) {
    await new Promise((r) => setTimeout(r, 500));
    try {
      const detail = await api("GET", `/api/packets/${packetId}`);
      const mine = detail.grabs.find((x) => x.user_id === me());
      if (mine && mine.status === "credited") {
        await refreshMe();
        toast(`${yuan(amount)} landed in your balance`);
        return;
      }
    } catch {
      // offline for a moment: keep waiting
    }
  }
}
