"""The statuses a packet row and a grab record go through: each named once. SQL names them through these
(``f"status = '{PacketStatus.ACTIVE}'"``) and rows are read into them, so a misspelt status is an
``AttributeError`` where it is written and a status the code does not know is a ``ValueError`` where it
is read — never a query that quietly matches nothing."""

from __future__ import annotations

from enum import StrEnum


class PacketStatus(StrEnum):
    ACTIVE = "active"  # its shares may be grabbed and credited
    REFUNDING = "refunding"  # expired and its refund decided: no new credit; paid in the same
    # transaction on one database, in steps on a sharded ledger (``server.money.shardsteps``)
    REFUNDED = "refunded"  # what no one was paid went back to its sender
    FINISHED = "finished"  # every share paid (or, sharded, its refund found nothing left)
    VOID = "void"  # a sharded send abandoned before its packet was made: its debit refunded, never grabbed


class RecordStatus(StrEnum):
    """A grab record's (``grab_records.status``)."""

    CREDITING = "crediting"  # sharded: the record written on the packet's shard, the grabber not paid yet
    CREDITED = "credited"  # the grabber's journal row and balance written


# A packet whose money may still move (grabs credited, or its refund paid), and one with nothing left
# outstanding (reconciliation's two sides of "settled").
OPEN = (PacketStatus.ACTIVE, PacketStatus.REFUNDING)
SETTLED = (PacketStatus.FINISHED, PacketStatus.REFUNDED, PacketStatus.VOID)
