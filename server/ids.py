"""Ids of users, groups and packets: positive signed 64-bit integers (their database columns are BIGINT),
in every layer alike.

Each kind of id is its own type to the type checker (``NewType``: at run time a plain ``int``, at no
cost), so passing a packet id where a group id is wanted fails ``mypy``. A value becomes one where it
enters the system — a field of a request (``PacketId(field_id(...))``), a token's subject, a database row,
a Redis reply — and keeps its type from there. Functions that take two ids also take them by keyword
(``group_id=``, ``packet_id=``, ``user_id=`` everywhere), so a swap cannot hide behind two ids that happen
to share a type.
"""

from __future__ import annotations

from typing import NewType

MAX_ID = 2**63 - 1

UserId = NewType("UserId", int)
GroupId = NewType("GroupId", int)
PacketId = NewType("PacketId", int)
# A share's place in its packet's split, 1 … count: the order the shares were drawn and are handed out.
ShareSeq = NewType("ShareSeq", int)
