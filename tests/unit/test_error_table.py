"""docs/protocol.md's table of error codes and the codes of ``server/errors.py`` are one set: a code
added to either without the other fails here."""

from __future__ import annotations

import re
from pathlib import Path

from server import errors

PROTOCOL = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def table_codes(document: str) -> set[str]:
    """Every code named in the first column of the document's "Error codes" table."""
    section = document.split("## Error codes", 1)[1].split("\n## ", 1)[0]
    codes: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            codes |= set(re.findall(r"`([a-z_]+)`", first))
    return codes


def test_the_reader_finds_codes_in_the_first_column_only() -> None:
    doc = (
        "## Error codes\n\n| code | meaning |\n|---|---|\n| `a_b`, `c` | not `d` |\n\n## Next\n| `e` | x |\n"
    )
    assert table_codes(doc) == {"a_b", "c"}


def test_the_document_lists_every_code_a_client_may_see_and_no_other() -> None:
    listed = table_codes(PROTOCOL)
    assert sorted(listed - set(errors.WIRE_CODES)) == [], "in docs/protocol.md, not in server/errors.py"
    assert sorted(set(errors.WIRE_CODES) - listed) == [], "in server/errors.py, not in docs/protocol.md"


def test_every_code_is_its_constants_name_and_said_once() -> None:
    """ALL_CODES is read from the module's upper-case string constants, so each must be a code: spelled
    as its name (``NOT_LOCAL = "not_local"``), a constant of another kind would fail here rather than
    become a code. The ledger's codes are not sent to clients."""
    assert errors.NOT_LOCAL in errors.ALL_CODES  # the one an earlier hand-written list forgot
    for code in errors.ALL_CODES:
        assert getattr(errors, code.upper()) == code, code
    assert len(set(errors.ALL_CODES)) == len(errors.ALL_CODES)
    assert set(errors.WIRE_CODES) | set(errors.LEDGER_CODES) == set(errors.ALL_CODES)
    assert not set(errors.WIRE_CODES) & set(errors.LEDGER_CODES)
