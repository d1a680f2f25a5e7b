"""Every requirement id cited in the repository is in its one canonical form and has an entry in
docs/requirements.md, and nothing points at a document outside the repository (Issue 13 scenario C).

The checker is ``tests/requirement_ids.py``. The sample texts below are built from pieces so that
this file itself cites nothing (``tests/ac_table.py`` would list it as proving those ids).
"""

from __future__ import annotations

import pytest

from tests import requirement_ids as rid

# requirement-ids: not scanned (this file spells out the old forms the checker rejects)

AC = "AC-EXECUTORS-"
SURV = AC + "SURVIVAL-"
OWN = AC + "CONTROL-OWNERSHIP-"
RES = "RES" + "UME-"
CFG = "RESET" + "CFG-"
LEASE = "LEASE-" + "CTX-"
ISSUE = "Iss" + "ue"


def test_every_citation_in_the_repository_is_canonical_and_has_an_entry() -> None:
    problems = rid.check()
    assert not problems, "\n".join(str(p) for p in problems[:60]) + (
        f"\n... and {len(problems) - 60} more" if len(problems) > 60 else ""
    )


def test_entries_are_unique_and_cover_every_family() -> None:
    ids = rid.entries()
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    for family in (SURV + "001.1", SURV + "005.7", OWN + "001.11", OWN + "004.7", RES + "13", RES + "T8",
                   CFG + "13", CFG + "T5", "NPM-" + "CTX-6", LEASE + "7", f"{ISSUE} 10 scenario A",
                   f"{ISSUE} 10 item 5", f"{ISSUE} 15", "REQ-EXECUTORS-" + "SURVIVAL-004"):
        assert family in ids


KNOWN = {SURV + "001.6", SURV + "001.5", SURV + "003.2", SURV + "003.3", SURV + "003.4", SURV + "003.5",
         OWN + "002.3", OWN + "001.11", RES + "1", RES + "2", RES + "3", RES + "5", RES + "6", RES + "8", RES + "9", LEASE + "5", LEASE + "6",
         f"{ISSUE} 10", f"{ISSUE} 10 scenario A", f"{ISSUE} 14 scenario A", f"{ISSUE} 14 scenario B",
         f"{ISSUE} 14 scenario C", f"{ISSUE} 11 item 5", OWN + "002.6", OWN + "002.7", f"{ISSUE} 15 item 1",
         f"{ISSUE} 15 item 6"}


@pytest.mark.parametrize(("text", "fixed"), [
    ("SURVIVAL-001.6", SURV + "001.6"),
    ("SURV-001.6", SURV + "001.6"),
    ("OWN-002.3", OWN + "002.3"),
    ("OWNERSHIP-002.3", OWN + "002.3"),
    ("CONTROL-OWNERSHIP-002.3", OWN + "002.3"),
    ("AC-OWN-001.11", OWN + "001.11"),
    (SURV + "001.5, 001.6", f"{SURV}001.5, {SURV}001.6"),
    (SURV + "001.5,\n    001.6", f"{SURV}001.5,\n    {SURV}001.6"),  # a wrapped list stays wrapped
    (OWN + "002.6 or 002.7", f"{OWN}002.6 or {OWN}002.7"),
    (SURV + "003.2..003.5", f"{SURV}003.2, {SURV}003.3, {SURV}003.4, {SURV}003.5"),
    (RES + "5/6/9", f"{RES}5, {RES}6, {RES}9"),
    (LEASE + "5/6", f"{LEASE}5, {LEASE}6"),
    (RES + "5, 8", f"{RES}5, {RES}8"),
    (RES + "1..3", f"{RES}1, {RES}2, {RES}3"),
    ("issue 10 scenario A", f"{ISSUE} 10 scenario A"),
    ("issue 10, scenario A", f"{ISSUE} 10 scenario A"),
    (f"{ISSUE} 14 scenarios A-C", f"{ISSUE} 14 scenario A, {ISSUE} 14 scenario B and {ISSUE} 14 scenario C"),
    (f"{ISSUE} 14 scenarios A and B", f"{ISSUE} 14 scenario A and {ISSUE} 14 scenario B"),
    (f"{ISSUE} 11 (build item 5)", f"{ISSUE} 11 item 5"),
    (f"{ISSUE} 15 items 1 and 6", f"{ISSUE} 15 item 1 and {ISSUE} 15 item 6"),
    ("issue 10", f"{ISSUE} 10"),
])
def test_each_old_form_is_reported_and_fixed(text: str, fixed: str) -> None:
    assert rid.check_text(text, "x", KNOWN), text
    assert rid.fix_text(text) == fixed
    assert rid.check_text(fixed, "x", KNOWN) == []


@pytest.mark.parametrize("text", [
    "(002.3)",  # a bare number: survival or ownership? a person decides
    "REQ-002",
    "as scenario B shows",  # a scenario without its issue
    "design" + ".md " + "\u00a7" + "7",
    "../" + "shared/seeds",
    "see design" + "-notes",
    "the rules of spec" + "/survival.md",
    "seed" + " 000",
    "as survival" + ".md says",  # a requirement spec named without its folder
    "agent-resume" + "-runtime-recovery.txt",  # a seed by its file name
])
def test_what_only_a_person_can_decide_is_reported_and_left_alone(text: str) -> None:
    assert rid.check_text(text, "x", KNOWN), text
    assert rid.fix_text(text) == text


def test_a_canonical_id_without_an_entry_is_reported() -> None:
    problems = rid.check_text(f"see {SURV}009.1 and {ISSUE} 99 scenario Z", "x", KNOWN)
    assert {(p.kind, p.text) for p in problems} == {("no entry", SURV + "009.1"),
                                                     ("no entry", f"{ISSUE} 99 scenario Z")}


def test_what_is_not_a_citation_is_left_alone() -> None:
    text = ("version 0.2.0, 0.005 s, 1.002.3, test_scenario_a_name(), async def scenario(), "
            "at 12:00:00.123Z, an exact spec pkg@1.2.3, issue the stop, " + SURV + "003.6 rule 7")
    assert rid.check_text(text, "x", KNOWN) == [rid.Problem("x", 1, "no entry", SURV + "003.6")]
    assert rid.fix_text(text) == text


def test_files_are_found_wherever_they_live_and_a_marked_file_is_skipped(tmp_path) -> None:
    """The lead reruns the check after other branches move files: no list of folders to keep up."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "requirements.md").write_text(f"- **{SURV}001.6**: a rule.\n")
    moved = tmp_path / "brand" / "new" / "place.py"
    moved.parent.mkdir(parents=True)
    moved.write_text(f'"""Cites SURVIVAL-001.6 and {SURV}001.6."""\n')
    (tmp_path / "checker.py").write_text("# requirement-ids: " + "not scanned\nSURVIVAL-001.6\n")
    problems = rid.check(tmp_path)
    assert [(p.path, p.kind, p.text) for p in problems] == [("brand/new/place.py", "old form", "SURVIVAL-001.6")]
    assert rid.fix(tmp_path) == [moved]
    assert rid.check(tmp_path) == []


@pytest.mark.parametrize(("text", "fixed"), [
    (f"{OWN}002.3 ... (002.7)", f"{OWN}002.3 ... ({OWN}002.7)"),  # the file cites one family only
    (f"{SURV}001.6 ... (002.16)", f"{SURV}001.6 ... ({SURV}002.16)"),  # one family defines it
    (f"{OWN}002.3 ... (002.16)", f"{OWN}002.3 ... ({SURV}002.16)"),
    (f"{SURV}001.6 and {OWN}002.3 ... (002.7)", f"{SURV}001.6 and {OWN}002.3 ... (002.7)"),  # a person decides
    ("(002.7)", "(002.7)"),  # no family cited in the file: a person decides
    (f"{SURV}001.6 ... (002.7) ... (003.8)", f"{SURV}001.6 ... (002.7) ... ({OWN}003.8)"),  # 003.8: both cited
])
def test_a_bare_number_is_resolved_only_when_one_reading_exists(text: str, fixed: str) -> None:
    known = {SURV + "001.6", SURV + "002.7", SURV + "002.16", OWN + "002.3", OWN + "002.7", OWN + "003.8"}
    assert rid.fix_text(text, known) == fixed


DESIGN = "design" + ".md "
NOTES = "design" + "-notes "
S = "\u00a7"


@pytest.mark.parametrize(("text", "fixed"), [
    (f"({DESIGN}{S}5)", "(docs/architecture.md#ownership)"),
    (f"({DESIGN}{S}1, {S}6)", "(docs/architecture.md#processes and docs/architecture.md#the-control-server-inside)"),
    (f"{NOTES}{S}6.6, {S}9", "docs/architecture.md#the-control-server-inside"),  # one home, named once
    (f"{NOTES}{S}6.1/{S}6.2", "docs/architecture.md#ownership"),
    (f"({DESIGN}{S}7)", f"({DESIGN}{S}7)"),  # the backend section has no single home: a person decides
])
def test_design_sections_with_one_home_are_rewritten_into_docs(text: str, fixed: str) -> None:
    assert rid.fix_text(text) == fixed
    assert [p.kind for p in rid.check_text(fixed, "x", KNOWN)] == (["outside reference"] * 2 if fixed == text else [])


def test_a_pointer_to_a_missing_heading_is_reported() -> None:
    targets = rid.anchors()
    assert "docs/architecture.md#ownership" in targets
    assert rid.check_text("see docs/architecture.md#ownership", "x", KNOWN, targets) == []
    problems = rid.check_text("see docs/architecture.md#no-such-part", "x", KNOWN, targets)
    assert [(p.kind, p.text) for p in problems] == [("dangling pointer", "docs/architecture.md#no-such-part")]
    assert rid.slug("The IPC protocol (`ipc/`)") == "the-ipc-protocol-ipc"


def test_fix_changes_nothing_in_a_clean_repository() -> None:
    """After a merge the lead reruns ``--fix``: on a repository that passes, that rerun is a no-op."""
    known = set(rid.entries())
    for path, text in rid.texts():
        assert rid.fix_text(text, known) == text, path
