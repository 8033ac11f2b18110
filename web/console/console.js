// The operators' console: signs in with the console key, then reads /api/console/* on this listener.
// Ids travel as decimal strings (Redpacket-Ids: string): a 64-bit id is never rounded by JavaScript.
// Everything shown is put in with textContent: a greeting or a reason is never markup.

const KEPT = "redpacket-console-session";
const LIVE_EVERY_MS = 2000;
const LIVE_POINTS = 90;
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(KEPT);
let liveTimer = null;
let liveRun = 0; // which sign-in the live figures belong to: a late answer of an older one stops
const series = { connections: [], grabs: [], lag: [] };
let lastLive = null;

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(method, path, body) {
  const headers = { "Redpacket-Ids": "string" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const answer = await r.json().catch(() => ({}));
  if (!r.ok) {
    const e = answer.error || {};
    throw new ApiError(r.status, e.code || "unknown", e.message || `HTTP ${r.status}`);
  }
  return answer;
}

// Cents as yuan, by integer arithmetic: 123456 → "¥1,234.56", -5 → "−¥0.05".
function yuan(cents) {
  const n = BigInt(cents);
  const neg = n < 0n;
  const abs = neg ? -n : n;
  const whole = (abs / 100n).toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  const frac = (abs % 100n).toString().padStart(2, "0");
  return `${neg ? "−" : ""}¥${whole}.${frac}`;
}

function when(ms) {
  if (ms === null || ms === undefined) return "–";
  return new Date(Number(ms)).toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "–")));
  return node;
}

function tag(text, kind) {
  return el("span", { class: `tag ${kind}` }, text);
}

function facts(pairs) {
  const dl = el("dl", { class: "facts" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, v));
  return dl;
}

// A table; a column whose name ends in "#" or "¥" is numeric (right-aligned).
function table(caption, columns, rows) {
  const t = el("table");
  t.append(el("caption", { class: "sr-only" }, caption));
  const head = el("tr");
  for (const c of columns) head.append(el("th", { scope: "col", class: /[#¥]$/.test(c) ? "num" : "" }, c));
  t.append(el("thead", {}, head));
  const body = el("tbody");
  for (const row of rows) {
    const tr = el("tr");
    row.forEach((cell, i) => {
      const numeric = /[#¥]$/.test(columns[i]);
      tr.append(el("td", { class: numeric ? "num" : "wrap" }, cell));
    });
    body.append(tr);
  }
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: String(columns.length) }, "none")));
  t.append(body);
  // A wide table scrolls on its own (a phone); by keyboard too: the box takes the focus, named.
  return el("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": caption }, t);
}

const CREDIT = {
  paid: ["paid", "good"],
  outbox: ["waiting for a worker", "warn"],
  crediting: ["half-way (sharded)", "warn"],
  refused: ["refused", "bad"],
};

function show(title, ...parts) {
  const view = $("view");
  view.replaceChildren(el("h2", {}, title), ...parts);
  view.hidden = false;
  view.focus();
}

function packetView(p) {
  const fair = p.fairness;
  const fairKind = fair.status === "verified" ? "good" : fair.status === "mismatch" ? "bad" : "plain";
  const grabs = p.grabs.map((g) => {
    const [words, kind] = CREDIT[g.credit] || [g.credit, "plain"];
    const why = g.refusal ? `${g.refusal.code} (by ${g.refusal.refused_by}, ${when(g.refusal.ms)})` : "";
    return [g.seq, g.user_id, yuan(g.amount), when(g.grabbed_ms), tag(words, kind), why || when(g.credited_ms)];
  });
  show(
    `Packet ${p.packet_id}`,
    facts([
      ["Sender", p.sender_id],
      ["Group", p.group_id],
      ["Kind", p.kind + (p.target ? ` (for user ${p.target})` : "")],
      ["Total", yuan(p.total)],
      ["Shares", `${p.count} (${p.remaining} not grabbed)`],
      ["Greeting", p.greeting],
      ["Status", p.status],
      ["Sent", when(p.created_ms)],
      ["Expires", when(p.expires_ms)],
      ["Finished", when(p.finished_ms)],
      ["Paid to grabbers", yuan(p.paid)],
      ["Refund", p.refund ? `${yuan(p.refund.amount)} at ${when(p.refund.created_ms)}` : "none"],
    ]),
    el("h3", {}, "Fair split"),
    el("p", { class: "verdict" }, tag(fair.status.replace("_", " "), fairKind), " ", fair.said),
    ...fair.problems.map((x) => el("p", { class: "error" }, x)),
    facts([
      ["Commitment", fair.commitment || "–"],
      ["Seed", fair.seed || "not revealed"],
      ["Shares drawn", fair.shares.length ? fair.shares.map(yuan).join(" ") : "–"],
    ]),
    el("h3", {}, `Grabs (${p.grabs.length})`),
    table("Grabs in order", ["Share #", "User", "Amount ¥", "Grabbed", "Credit", "Credited / why"], grabs),
    el("h3", {}, "Journal"),
    table(
      "Journal rows of the packet",
      ["Row #", "User", "Kind", "Amount ¥", "Key", "When"],
      p.journal.map((j) => [j.id, j.user_id, j.kind, yuan(j.amount), j.key, when(j.created_ms)]),
    ),
    el("h3", {}, "Events and webhook deliveries"),
    table(
      "Events of the packet",
      ["Event #", "Type", "When"],
      p.events.map((e) => [e.id, e.type, when(e.created_ms)]),
    ),
    table(
      "Webhook deliveries of those events",
      ["Event #", "Endpoint", "Status", "Attempts #", "Last error"],
      p.deliveries.map((d) => [d.event_id, d.endpoint, d.status, d.attempts, d.last_error || ""]),
    ),
  );
}

function userView(u) {
  const lift = el("button", { type: "button", class: "danger", id: "lift" }, "Lift block and throttle");
  lift.addEventListener("click", () => run(async () => {
    const r = await api("POST", `/api/console/users/${u.user_id}/lift`);
    userView(await api("GET", `/api/console/users/${u.user_id}`));
    $("error").textContent = r.lifted ? "" : "That user was neither blocked nor throttled.";
  }));
  const matches = u.journal_sum === u.balance;
  show(
    `User ${u.user_id} · ${u.name}`,
    facts([
      ["Balance", yuan(u.balance)],
      ["Journal", [`${u.journal_rows} rows summing to ${yuan(u.journal_sum)} `,
        tag(matches ? "matches the balance" : "differs from the balance", matches ? "good" : "bad")]
        .reduce((n, c) => (n.append(c), n), el("span"))],
      ["Sockets online", `${u.sockets_here} on this hub; hubs: ${u.hubs_online.join(", ") || "none"}`],
    ]),
    el("h3", {}, "Blocks and throttles"),
    table(
      "Blocks and throttles in force",
      ["Action", "Until", "Why"],
      u.restrictions.map((r) => [r.action, when(r.until_ms), r.reasons]),
    ),
    lift,
    el("h3", {}, "Journal, newest first"),
    table(
      "Journal rows with the balance after each",
      ["Row #", "Kind", "Amount ¥", "Balance after ¥", "Packet", "Key", "When"],
      u.journal.map((j) => [j.id, j.kind, yuan(j.amount), yuan(j.balance_after), j.packet_id ?? "", j.key,
        when(j.created_ms)]),
    ),
    el("h3", {}, "Holds (withdrawals)"),
    table(
      "Holds",
      ["Request", "Amount ¥", "State", "Created", "Expires", "Closed"],
      u.holds.map((h) => [h.request_id, yuan(h.amount), h.state, when(h.created_ms), when(h.expires_ms),
        when(h.closed_ms)]),
    ),
  );
}

function part(value, render) {
  if (value && value.error) return el("p", { class: "error" }, value.error);
  return render(value);
}

function booksView(b) {
  const rec = b.reconciliation;
  show(
    "The books",
    el("h3", {}, "Last reconciliation"),
    part(rec, (r) => {
      if (!r) return el("p", {}, "No worker has reconciled since Redis started.");
      const ok = r.differences === 0;
      const items = [facts([
        ["When", when(r.at_ms)],
        ["Verdict", tag(ok ? "clean" : `${r.differences} difference(s)`, ok ? "good" : "bad")],
      ])];
      const report = r.report || { differences: [], shards: [] };
      items.push(table("Differences", ["Check", "Subject", "Expected #", "Found #"],
        report.differences.map((d) => [d.check, d.subject, d.expected, d.actual])));
      if (report.shards && report.shards.length) {
        items.push(table("Per shard", ["Shard"], report.shards.map((s) => [s])));
      }
      return el("div", {}, ...items);
    }),
    el("h3", {}, "Credits waiting for a worker"),
    part(b.outbox, (o) => el("div", {},
      el("p", {}, `${o.total} in the ${o.shards} shard outboxes` +
        (o.lag_ms === null ? "" : `; the oldest waiting ${(o.lag_ms / 1000).toFixed(1)} s (grabbed ${when(o.oldest_ms)})`)),
      table("Shards with credits waiting", ["Shard #", "Entries #"], o.waiting.map((w) => [w.shard, w.entries])))),
    el("h3", {}, "Hubs and workers seen"),
    part(b.processes, (ps) => table("Processes", ["Role", "Id", "Host", "Pid #", "Seen", "Connections #"],
      ps.map((p) => [p.role, p.id, p.host, p.pid, `${Math.round(p.ago_ms / 1000)} s ago`, p.connections ?? ""]))),
    el("h3", {}, `Redis masters (grab durability ${b.durability})`),
    part(b.redis, (ms) => table("Redis masters", ["Master", "Replicas #", "appendfsync", "maxmemory-policy",
      "Health"], ms.map((m) => [m.address, m.replicas, m.appendfsync || "?", m.maxmemory_policy || "?",
      m.problem ? tag(m.problem, "bad") : tag("keeps grabs as asked", "good")]))),
    el("h3", {}, "Database"),
    part(b.database, (d) => el("div", {},
      facts([
        ["Kind", d.dialect],
        ["Writing through", d.writer || "–"],
        ["Writer recorded", d.writer_recorded ? `${d.writer_recorded.address} since ${when(d.writer_recorded.set_ms)}` : "–"],
        ["Shards", d.shards || "one database"],
      ]),
      d.backends.length ? table("Backends", ["Shard #", "Server"], d.backends.map((x) => [x.shard, x.server || "?"]))
        : el("span"))),
  );
}

function draw(id, values) {
  const svg = $(id);
  const most = Math.max(1, ...values);
  const step = 120 / Math.max(1, LIVE_POINTS - 1);
  const shown = values.length === 1 ? [values[0], values[0]] : values;  // one reading: a flat line
  const points = shown.map((v, i) => `${(i * step).toFixed(1)},${(30 - (v / most) * 28).toFixed(1)}`);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.join(" "));
  svg.replaceChildren(line);
}

function push(name, value) {
  const s = series[name];
  s.push(value);
  if (s.length > LIVE_POINTS) s.shift();
}

// The live figures: one request at a time, the next LIVE_EVERY_MS after the last answer (a slow hub is
// never asked twice at once).
async function tick(run) {
  try {
    const now = await api("GET", "/api/console/live");
    if (run !== liveRun) return;
    const rate = lastLive ? Math.max(0, (now.grabs_won_total - lastLive.grabs_won_total) * 1000 /
      Math.max(1, now.at_ms - lastLive.at_ms)) : 0;
    lastLive = now;
    push("connections", now.connections);
    push("grabs", rate);
    const lag = (now.credit_lag_ms ?? 0) / 1000;
    push("lag", lag);
    $("live-hub").textContent = `hub ${now.hub}`;
    $("now-connections").textContent = String(now.connections);
    $("now-grabs").textContent = rate.toFixed(1);
    $("now-lag").textContent = now.credit_lag_ms === null ? "none waiting" : `${lag.toFixed(1)} s`;
    $("now-backlog").textContent = now.credit_backlog ? `(${now.credit_backlog} waiting)` : "";
    draw("chart-connections", series.connections);
    draw("chart-grabs", series.grabs);
    draw("chart-lag", series.lag);
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) {
      signedOut(e.message);
      return;
    }
  }
  if (run === liveRun && liveTimer !== null) liveTimer = setTimeout(() => tick(run), LIVE_EVERY_MS);
}

async function run(action) {
  $("error").textContent = "";
  try {
    await action();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) signedOut(e.message);
    else $("error").textContent = e.message;
  }
}

function signedIn(expiresMs) {
  $("sign-in").hidden = true;
  $("desk").hidden = false;
  $("sign-out").hidden = false;
  $("session").textContent = expiresMs ? `Signed in until ${when(expiresMs)}` : "Signed in";
  if (liveTimer === null) {
    liveTimer = 0; // (running: tick sets the next one)
    tick(++liveRun);
  }
  $("packet-id").focus();
}

function signedOut(why) {
  token = null;
  sessionStorage.removeItem(KEPT);
  clearTimeout(liveTimer);
  liveTimer = null;
  liveRun += 1;
  $("desk").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  $("session").textContent = "Signed out";
  $("sign-in-error").textContent = why || "";
  $("key").focus();
}

$("sign-in-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("sign-in-error").textContent = "";
  try {
    const s = await api("POST", "/api/console/session", { key: $("key").value });
    token = s.token;
    sessionStorage.setItem(KEPT, token);
    $("key").value = "";
    signedIn(s.expires_ms);
  } catch (e) {
    $("sign-in-error").textContent = e.message;
  }
});

$("sign-out").addEventListener("click", () => signedOut(""));

$("packet-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  run(async () => packetView(await api("GET", `/api/console/packets/${$("packet-id").value.trim()}`)));
});

$("user-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  run(async () => userView(await api("GET", `/api/console/users/${$("user-id").value.trim()}`)));
});

$("books").addEventListener("click", () => run(async () => booksView(await api("GET", "/api/console/books"))));

if (token) signedIn(null);
else signedOut("");
