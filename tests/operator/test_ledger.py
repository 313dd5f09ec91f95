"""The ledger archive (``ledger.py``): what status can no longer hold, appended once, bounded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from batchpilot_operator import ledger
from batchpilot_operator.children import LABEL_COMPONENT, LABEL_REVISION, build_ledger_configmap
from batchpilot_operator.status import LedgerEntry, LedgerKind

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def entry(i: int, kind: LedgerKind = "StepAdvanced", revision: str = "aaaa") -> LedgerEntry:
    return LedgerEntry(time=T0 + timedelta(seconds=i), kind=kind, revision=revision, reason=f"r{i}")


def as_configmap(entries: list[LedgerEntry], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    last = {ledger.LAST_ANNOTATION: ledger.digest(entries[-1])} if entries else {}
    return build_ledger_configmap("p", "ns", "uid", ledger.archive_name("p"), ledger.archive_data(entries, keep), last)


def test_decisions_are_appended_once_and_analyses_never() -> None:
    status_ledger = [entry(0, "CanaryStarted"), entry(1, "Analysis"), entry(2)]
    first = ledger.merged([], status_ledger)
    assert [e.kind for e in first] == ["CanaryStarted", "StepAdvanced"]
    cm = as_configmap(first)
    archive = ledger.archived(cm)
    assert archive == first
    assert ledger.up_to_date(cm, status_ledger) and not ledger.up_to_date(None, status_ledger)
    assert ledger.merged(archive, status_ledger) == first  # nothing new: the controller writes nothing
    assert not ledger.up_to_date(cm, [*status_ledger, entry(3, "Promoted")])
    later = ledger.merged(archive, [*status_ledger[1:], entry(3, "Promoted")])  # status dropped the oldest
    assert [e.kind for e in later] == ["CanaryStarted", "StepAdvanced", "Promoted"]


def test_one_key_per_revision_oldest_first_and_no_revision_label() -> None:
    entries = [entry(0, "CanaryStarted", "aaaa"), entry(1, "CanaryStarted", "bbbb"), entry(2, "Promoted", "aaaa")]
    cm = as_configmap(entries)
    data = cm["data"]
    assert set(data) == {"aaaa", "bbbb"}
    assert [LedgerEntry.model_validate_json(line).kind for line in data["aaaa"].splitlines()] == [
        "CanaryStarted",
        "Promoted",
    ]
    labels = cm["metadata"]["labels"]
    assert LABEL_REVISION not in labels and labels[LABEL_COMPONENT] == "ledger"
    assert ledger.archived(cm) == entries


def test_a_revision_keeps_its_first_and_newest_decisions() -> None:
    n = ledger.REVISION_HEAD + ledger.REVISION_TAIL + 50
    entries = [entry(0, "CanaryStarted")] + [entry(i, "Stalled") for i in range(1, n)]
    kept = ledger.archived(as_configmap(entries))
    assert len(kept) == ledger.REVISION_HEAD + ledger.REVISION_TAIL
    assert kept[0].kind == "CanaryStarted" and kept[-1] == entries[-1]
    assert kept[: ledger.REVISION_HEAD] == entries[: ledger.REVISION_HEAD]


def test_the_archive_keeps_the_newest_revisions_that_fit_and_always_the_live_ones() -> None:
    entries = []
    for r in range(2000):
        entries += [entry(10 * r + i, kind, f"{r:08x}") for i, kind in enumerate(("CanaryStarted", "Promoted"))]
    data = ledger.archive_data(entries, keep=("00000000",))  # the oldest revision is still named by status
    assert sum(len(k) + len(v) for k, v in data.items()) <= ledger.ARCHIVE_BYTES
    assert len(data) < 2000 and "00000000" in data and f"{1999:08x}" in data
    kept = sorted(int(k, 16) for k in data)
    assert kept[1:] == list(range(2000 - len(kept) + 1, 2000))  # every newer revision, none skipped
