"""Ids of users, groups and packets: positive signed 64-bit integers (their database columns are BIGINT),
in every layer alike."""

from __future__ import annotations

MAX_ID = 2**63 - 1
