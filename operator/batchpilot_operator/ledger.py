"""The decision ledger beyond what status holds: an append-only ConfigMap per policy.

``status.ledger`` keeps the newest decisions and analyses (``status.trim_ledger``). Every
decision (each ledger kind but ``Analysis``) is also appended here, to the ConfigMap
``<policy>-ledger`` the policy owns (garbage-collected with it), one key per revision holding
that revision's decisions as JSON lines, oldest first::

    kubectl get configmap search-ranker-ledger -o jsonpath='{.data.93b303045f}'

so "why is this revision in production, and who started it?" stays answerable after status
has moved on; ``kubectl batchpilot history`` shows the two merged. Bounds (a ConfigMap is read
into every operator's cache): a revision keeps its first :data:`REVISION_HEAD` and its newest
:data:`REVISION_TAIL` decisions (a canary held for days by flapping metrics repeats Stalled /
MetricsRestored; who started it and how it ended are what audit asks), and the ConfigMap keeps
the newest revisions that fit in :data:`ARCHIVE_BYTES`, always those the status names (stable,
canary, desired). Pure: no Kubernetes client; the controller reads and writes it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from batchpilot_operator.children import Manifest
from batchpilot_operator.status import LedgerEntry

ARCHIVE_BYTES = 256 * 1024
"""The archive's data at most (the apiserver takes 1 MiB; a few hundred rollouts fit)."""
REVISION_HEAD = 20
REVISION_TAIL = 180


def archive_name(policy: str) -> str:
    """``<policy>-ledger``: no revision (a content hash in hex) is named ``ledger``."""
    return f"{policy}-ledger"


def is_decision(entry: LedgerEntry) -> bool:
    return entry.kind != "Analysis"


def _line(entry: LedgerEntry) -> str:
    return json.dumps(entry.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=True)


LAST_ANNOTATION = "batchpilot.dev/last-decision"
"""On the archive: a digest of the newest decision it holds, so a reconcile whose status holds
no newer one skips parsing the archive (:func:`up_to_date`)."""


def digest(entry: LedgerEntry) -> str:
    return hashlib.sha256(_line(entry).encode()).hexdigest()[:16]


def up_to_date(configmap: Manifest | None, ledger: Sequence[LedgerEntry]) -> bool:
    """Whether the archive already ends with the status ledger's newest decision (then it holds
    every decision of status: each was appended before a newer one was)."""
    newest = next((e for e in reversed(ledger) if is_decision(e)), None)
    if newest is None:
        return True
    annotations = ((configmap or {}).get("metadata") or {}).get("annotations") or {}
    return bool(annotations.get(LAST_ANNOTATION) == digest(newest))


def archived(configmap: Manifest | None) -> list[LedgerEntry]:
    """Every decision the archive holds, oldest first (across revisions, by time)."""
    entries: list[LedgerEntry] = []
    for text in ((configmap or {}).get("data") or {}).values():
        entries += [LedgerEntry.model_validate_json(line) for line in text.splitlines() if line.strip()]
    return sorted(entries, key=lambda e: e.time)


def merged(archive: Sequence[LedgerEntry], ledger: Iterable[LedgerEntry]) -> list[LedgerEntry]:
    """The archive with the ledger's decisions it lacks appended, oldest first."""
    seen = {_line(e) for e in archive}
    new = [e for e in ledger if is_decision(e) and _line(e) not in seen]
    return sorted([*archive, *new], key=lambda e: e.time)  # stable: same-time entries keep their order


def archive_data(entries: Sequence[LedgerEntry], keep: Iterable[str | None] = ()) -> dict[str, str]:
    """The ConfigMap's ``data``: per revision, its decisions as JSON lines, within the bounds."""
    by_revision: dict[str, list[str]] = {}
    last_seen: dict[str, float] = {}
    for entry in entries:
        by_revision.setdefault(entry.revision, []).append(_line(entry))
        last_seen[entry.revision] = entry.time.timestamp()
    texts = {}
    for revision, lines in by_revision.items():
        if len(lines) > REVISION_HEAD + REVISION_TAIL:
            lines = lines[:REVISION_HEAD] + lines[-REVISION_TAIL:]
        texts[revision] = "\n".join(lines) + "\n"
    pinned = {r for r in keep if r is not None and r in texts}
    size = sum(len(texts[r]) + len(r) for r in pinned)
    data = {r: texts[r] for r in pinned}
    for revision in sorted(texts, key=lambda r: -last_seen[r]):  # newest first
        if revision in pinned:
            continue
        cost = len(texts[revision]) + len(revision)
        if size + cost > ARCHIVE_BYTES:
            break
        data[revision] = texts[revision]
        size += cost
    return data
