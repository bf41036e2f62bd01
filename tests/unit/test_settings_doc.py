"""The settings tables: generated from tocsin.settings_doc, which must match the code."""

from __future__ import annotations

import pytest

from base.settings import REPO_ROOT, Settings
from proxy.settings import ProxySettings
from tocsin import settings_doc as sd


def test_every_variable_the_code_reads_is_documented_and_nothing_else() -> None:
    read = sd.names_read_by_code(REPO_ROOT)
    documented = [s.variable for s in sd.SETTINGS]
    assert len(documented) == len(set(documented)), "a variable is documented twice"
    assert sorted(read - set(documented)) == [], "read by the code, missing in settings_doc"
    assert sorted(set(documented) - read) == [], "in settings_doc, read by no code"


@pytest.mark.parametrize(
    "doc",
    [s for s in sd.SETTINGS if s.default != sd.UNSET and s.default_checkable],
    ids=lambda s: s.name,
)
def test_the_documented_default_is_the_one_the_code_applies(doc: sd.SettingDoc) -> None:
    # Setting a variable to its stated default must change nothing.
    env = {doc.variable: doc.default}
    assert Settings.from_env(env) == Settings.from_env({})
    assert ProxySettings.from_env(env) == ProxySettings.from_env({})


@pytest.mark.parametrize("process", list(sd.Process), ids=lambda p: p.value)
def test_docs_pages_hold_the_current_generated_table(process: sd.Process) -> None:
    page = REPO_ROOT / sd.TABLE_PAGES[process]
    assert sd.block(process) in page.read_text(), (
        f"{page.name}: the {process.value} settings table is missing or stale; "
        "run `tocsin settings --write`"
    )
