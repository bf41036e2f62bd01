"""Result codes: documented once each, in the module and in docs/wire-contract.md."""

from __future__ import annotations

import re
from pathlib import Path

from topics.codes import ACCEPTED_CODES, DOCS, STATEFUL_CODES, Code

WIRE_DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-contract.md"
# | `code` | status | decided by | meaning |
ROW = re.compile(r"^\| `([a-z_]+)` \| (accepted|rejected) \| ([^|]+) \| ([^|]+) \|$", re.M)


def test_every_code_has_a_one_line_doc() -> None:
    assert set(DOCS) == set(Code)
    for code in Code:
        assert code.doc and "\n" not in code.doc
        assert code.value == code.name.lower()


def test_accepted_codes() -> None:
    assert {Code.OK, Code.DUPLICATE} == ACCEPTED_CODES
    assert set(Code) > STATEFUL_CODES


def test_wire_doc_lists_every_code_with_its_status_and_decider() -> None:
    rows = {m.group(1): m.groups()[1:] for m in ROW.finditer(WIRE_DOC.read_text())}
    assert set(rows) == {c.value for c in Code}
    for code in Code:
        status, decided_by, meaning = rows[code.value]
        assert (status == "accepted") == (code in ACCEPTED_CODES), code
        assert ("scheduler" in decided_by) == (
            code in STATEFUL_CODES or code in (Code.OK, Code.DUE_IN_PAST, Code.PAYLOAD_TOO_LARGE)
        ), code
        assert meaning.strip(), code
