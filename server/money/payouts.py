"""Money out: the chat backend takes money from an account to pay it out its own way.

- ``withdraw``: one step. The journal row ``withdraw:<request id>`` debits the account, never below zero;
  the same request id answers the first outcome however often it comes (a retry, a concurrent retry, a
  retry after a timeout), and with another user or amount is ``idempotency_key_reused``.
- A hold, for a payout that can fail: ``hold`` takes the money off the balance at once (journal
  ``hold:<request id>``: held money cannot be spent), then ``confirm`` (it has left: nothing more moves) or
  ``release`` (journal ``release:<request id>`` gives it back). A hold neither confirmed nor released
  by its ``expires_ms`` is released on its own (``expire_due``, a worker's job every minute; a confirm
  after ``expires_ms`` finds it expired even before the job ran). Each step is idempotent.

Every step writes its event (``server.money.events``) in its transaction. Reconciliation:
money in = balances + held in packets + withdrawn + on hold (``server.money.outflows``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal

from server import errors
from server.errors import Conflict, InvalidRequest, NotFound
from server.ids import UserId
from server.money import events
from server.money.accounts import claim_request
from server.money.journal import post_event
from server.money.ledger import check_cents, check_request_id, now_ms, posted_by_this_call
from server.store.db import Database, Tx, as_text

HoldState = Literal["held", "confirmed", "released", "expired"]
# A hold's life, in seconds: what the backend asks for, within these bounds.
HOLD_DEFAULT_S = 3600
HOLD_MIN_S = 60
HOLD_MAX_S = 7 * 86_400


@dataclass(frozen=True)
class Hold:
    request_id: str
    user_id: UserId
    amount: int
    state: HoldState
    created_ms: int
    expires_ms: int
    closed_ms: int | None
    replay: bool = False

    def view(self) -> dict[str, object]:
        return asdict(self)


# The chat backend's say on money leaving (``server.hub.hooks.Hooks.approve_payout``): it raises to refuse.
PayoutApproval = Callable[[Literal["withdraw", "hold"], UserId, int, str], Awaitable[None]]


async def paid_out_before(db: Database, user_id: UserId, kind: Literal["withdraw", "hold"], rid: str) -> bool:
    """Whether the withdrawal or hold ``rid`` of ``user_id`` was made (a retry: it answers that one)."""
    row = await db.fetchone(
        "SELECT 1 FROM journal WHERE account_id = %s AND idem_key = %s", (user_id, f"{kind}:{rid}")
    )
    return row is not None


async def withdraw(
    db: Database, user_id: UserId, amount: object, request_id: object, approve: PayoutApproval | None = None
) -> bool:
    """Debit ``amount`` from the account once per ``request_id``; False on a replay. ``approve``: the
    chat backend's say, asked once the request is known good and before any money moves."""
    cents = check_cents(amount, "an amount out")
    rid = check_request_id(request_id, "a withdrawal's request_id")
    if approve is not None:
        await approve("withdraw", user_id, cents, rid)
    key = f"withdraw:{rid}"
    data: dict[str, object] = {"user_id": user_id, "amount": cents, "request_id": rid}

    async def work(tx: Tx) -> bool:
        return await post_event(tx, user_id, -cents, "withdraw", key, "account.withdrawn", data)

    await claim_request(db, key, user_id)  # (a sharded ledger: on the head first)
    return await db.run(work, idempotent=True)


def check_expiry(expires_in_s: object) -> int:
    if expires_in_s is None:
        return HOLD_DEFAULT_S
    if (
        not isinstance(expires_in_s, int)
        or isinstance(expires_in_s, bool)
        or not HOLD_MIN_S <= expires_in_s <= HOLD_MAX_S
    ):
        raise InvalidRequest(
            errors.BAD_REQUEST, f"expires_in_s is a whole number of seconds, {HOLD_MIN_S} to {HOLD_MAX_S}"
        )
    return expires_in_s


_COLUMNS = "request_id, user_id, amount, state, created_ms, expires_ms, closed_ms"


def _hold(row: tuple[object, ...], replay: bool = False) -> Hold:
    rid, user, amount, state, created, expires, closed = row
    return Hold(
        request_id=as_text(rid),
        user_id=UserId(int(str(user))),
        amount=int(str(amount)),
        state=state,  # type: ignore[arg-type]
        created_ms=int(str(created)),
        expires_ms=int(str(expires)),
        closed_ms=None if closed is None else int(str(closed)),
        replay=replay,
    )


def _where(rid: str, user: UserId | None) -> tuple[str, list[object]]:
    """The rows of hold ``rid``: by its user too when known, so that a sharded ledger reads and locks the
    user's backend alone (``_owner``)."""
    if user is None:
        return "request_id = %s", [rid]
    return "request_id = %s AND user_id = %s", [rid, user]


async def _owner(db: Database, rid: str) -> UserId | None:
    """Whose hold ``rid`` is, from its claim on a sharded ledger's head (``claim_request``): holds are
    partitioned by user, and a look-up by request id alone read and locked every backend — one backend
    down stopped every hold, confirm, release and expiry. None on one database (the request id finds
    it), and for a hold with no claim (made before claims were kept): found by request id alone."""
    if not db.shards:
        return None
    row = await db.fetchone("SELECT user_id FROM request_claims WHERE idem_key = %s", (f"hold:{rid}",))
    return None if row is None else UserId(int(row[0]))


async def _locked(tx: Tx, rid: str, user: UserId | None) -> Hold | None:
    where, params = _where(rid, user)
    row = await tx.fetchone(f"SELECT {_COLUMNS} FROM holds WHERE {where}" + tx.dialect.for_update, params)
    return None if row is None else _hold(tuple(row))


def _data(h: Hold) -> dict[str, object]:
    return {"user_id": h.user_id, "amount": h.amount, "request_id": h.request_id, "expires_ms": h.expires_ms}


async def hold(
    db: Database,
    user_id: UserId,
    amount: object,
    request_id: object,
    expires_in_s: object = None,
    approve: PayoutApproval | None = None,
) -> Hold:
    """Take ``amount`` off the balance and hold it, once per ``request_id`` (``approve``: as
    ``withdraw``'s)."""
    cents = check_cents(amount, "an amount out")
    rid = check_request_id(request_id, "a hold's request_id")
    life_s = check_expiry(expires_in_s)
    if approve is not None:
        await approve("hold", user_id, cents, rid)

    async def work(tx: Tx) -> Hold:
        prior = await _locked(tx, rid, user_id)
        if prior is None:
            ts = now_ms()
            h = Hold(rid, user_id, cents, "held", ts, ts + life_s * 1000, None)
            # The debit first: it locks the account, and refuses an overdraft before the hold exists.
            if await post_event(tx, user_id, -cents, "hold", f"hold:{rid}", "hold.created", _data(h)):
                await tx.execute(
                    f"INSERT INTO holds ({_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    (rid, user_id, cents, "held", ts, h.expires_ms, None),
                )
                return h
            prior = await _locked(tx, rid, user_id)  # a concurrent call with this request id committed first
            if prior is None:
                raise RuntimeError(f"hold {rid}'s journal row is there and the hold is not")
        if (prior.user_id, prior.amount) != (user_id, cents):
            raise Conflict(errors.IDEMPOTENCY_KEY_REUSED, f"hold {rid} is for another user or amount")
        if prior.state == "held" and prior.expires_ms <= now_ms():  # its time is over: said as it is
            prior = await _close(tx, prior, "expired", now_ms())
        # (Made by this very call in a run whose COMMIT answer was lost: not a replay.)
        return replace(prior, replay=not await posted_by_this_call(tx, f"hold:{rid}"))

    await claim_request(db, f"hold:{rid}", user_id)  # (a sharded ledger: on the head first)
    return await db.run(work, idempotent=True)


async def _close(tx: Tx, h: Hold, state: HoldState, ts: int) -> Hold:
    """Close a held hold as ``state``: a release or an expiry pays the money back."""
    await tx.execute(
        "UPDATE holds SET state = %s, closed_ms = %s, closed_tx = %s"
        " WHERE request_id = %s AND user_id = %s AND state = 'held'",
        (state, ts, tx.token, h.request_id, h.user_id),
    )
    closed = Hold(h.request_id, h.user_id, h.amount, state, h.created_ms, h.expires_ms, ts)
    if state == "confirmed":
        # The account's lock, as a balance change takes it: the user's events are numbered in order.
        await tx.fetchone(
            "SELECT balance FROM accounts WHERE user_id = %s" + tx.dialect.for_update, (h.user_id,)
        )
        await events.record(
            tx, "hold.confirmed", f"confirm:{h.request_id}", h.user_id, None, _data(closed), ts
        )
    else:
        kind: events.EventType = "hold.expired" if state == "expired" else "hold.released"
        await post_event(tx, h.user_id, h.amount, "release", f"release:{h.request_id}", kind, _data(closed))
    return closed


async def settle_hold(db: Database, request_id: object, outcome: Literal["confirmed", "released"]) -> Hold:
    """Confirm or release a hold. Again with the same outcome: the same answer, ``replay`` true. The other
    outcome, or a confirm of an expired hold: ``hold_closed``."""
    rid = check_request_id(request_id)
    user = await _owner(db, rid)

    async def work(tx: Tx) -> Hold:
        h = await _locked(tx, rid, user)
        if h is None:
            raise NotFound(errors.HOLD_NOT_FOUND, f"no hold {rid}")
        ts = now_ms()
        if h.state == "held" and h.expires_ms <= ts:
            h = await _close(tx, h, "expired", ts)  # its time is over, whether or not the job ran yet
        if h.state == outcome:
            return replace(h, replay=not await _closed_by_this_call(tx, rid, user))
        if h.state != "held":
            raise Conflict(errors.HOLD_CLOSED, f"hold {rid} is {h.state}", state=h.state)
        return await _close(tx, h, outcome, ts)

    try:
        return await db.run(work, idempotent=True)
    except Conflict as e:
        if e.code != errors.HOLD_CLOSED:
            raise
        # An expiry found by this call is kept, though the call is refused: committed apart.
        await db.run(functools.partial(_expire, rid=rid, user=user), idempotent=True)
        raise


async def _closed_by_this_call(tx: Tx, rid: str, user: UserId | None) -> bool:
    """Whether this ``Database.run`` call closed the hold, in a run whose COMMIT answer was lost."""
    if not tx.resumed:
        return False
    where, params = _where(rid, user)
    row = await tx.fetchone(f"SELECT closed_tx FROM holds WHERE {where}", params)
    return row is not None and row[0] is not None and int(row[0]) == tx.token


async def _expire(tx: Tx, *, rid: str, user: UserId | None) -> None:
    h = await _locked(tx, rid, user)
    ts = now_ms()
    if h is not None and h.state == "held" and h.expires_ms <= ts:
        await _close(tx, h, "expired", ts)


async def expire_due(db: Database, now: int | None = None, limit: int = 500) -> int:
    """Release every hold past its expiry (each in its own transaction), ``limit`` read at a time until
    none is due; returns how many."""
    now = now_ms() if now is None else now
    done = 0
    while True:
        rows = await db.fetchall(
            "SELECT request_id, user_id FROM holds WHERE state = 'held' AND expires_ms <= %s"
            " ORDER BY expires_ms LIMIT %s",
            (now, limit),
        )
        for rid, user in rows:
            expire = functools.partial(_expire, rid=as_text(rid), user=UserId(int(user)))
            await db.run(expire, idempotent=True)
        done += len(rows)
        if len(rows) < limit:
            return done


async def get_hold(db: Database, request_id: object) -> Hold:
    rid = check_request_id(request_id)
    where, params = _where(rid, await _owner(db, rid))
    row = await db.fetchone(f"SELECT {_COLUMNS} FROM holds WHERE {where}", params)
    if row is None:
        raise NotFound(errors.HOLD_NOT_FOUND, f"no hold {rid}")
    return _hold(tuple(row))
