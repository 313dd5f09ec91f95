"""The manual commands (annotations ``batchpilot.dev/pause``, ``promote``, ``abort``,
``retry``, ``resume``): each handled once per value, with an event and a ledger entry."""

from __future__ import annotations

from datetime import datetime, timedelta

from batchpilot_operator.rollout.inputs import CommandName
from batchpilot_operator.rollout.state import PlanState
from batchpilot_operator.status import RolloutState


def ignore_command(p: PlanState, name: CommandName, why: str) -> None:
    value = p.new_command(name)
    if value is not None:
        p.ledger("Command", p.desired, reason=f"{name} ignored: {why}", evidence=value)
        p.event("Normal", "CommandIgnored", f"{name} ({value}) ignored: {why}")


def handle_pause(p: PlanState) -> None:
    st = p.st
    want = p.inputs.commands.paused
    revision = st.rollout.revision if st.rollout else p.desired
    if want and not st.paused:
        value = p.inputs.commands.pause or "true"
        st.paused = True
        st.handled_commands["pause"] = value
        if st.rollout is not None and st.rollout.step_started_at is not None:
            st.rollout.paused_at = p.now
        p.ledger("Paused", revision, reason="pause", evidence=value)
        p.event("Normal", "Paused", f"rollout paused ({value})")
    elif not want and st.paused:
        st.paused = False
        r = st.rollout
        held = 0.0
        if r is not None and r.paused_at is not None:
            held = p.seconds_since(r.paused_at)
            if r.step_started_at is not None:
                r.step_started_at += timedelta(seconds=held)
            r.paused_at = None
        by = resumed_by(p.inputs.commands.resume, st.handled_commands.get("pause", ""), r)
        st.handled_commands["pause"] = ""
        who = f"by {by}" if by else "pause annotation removed"
        p.ledger("Resumed", revision, reason="resume", evidence=f"{who}; step clock held {held:g}s")
        p.event("Normal", "Resumed", f"rollout resumed ({who}) after {held:g}s paused")


def handle_abort(p: PlanState) -> None:
    if p.st.rollout is None:
        ignore_command(p, "abort", "no canary in flight")
        return
    value = p.new_command("abort")
    if value is None:
        return
    revision = p.st.rollout.revision
    p.ledger("Command", revision, reason="abort", evidence=value)
    p.rollback(reason="Aborted", evidence=f"aborted by {value}", aborted=True)


def handle_promote(p: PlanState) -> None:
    if p.st.rollout is None:
        ignore_command(p, "promote", "no canary in flight (use retry for a rolled-back revision)")
        return
    value = p.new_command("promote")
    if value is None:
        return
    p.ledger("Command", p.st.rollout.revision, reason="promote", evidence=value)
    p.promote(reason="PromotedManually", evidence=f"promoted by {value}, skipping remaining steps")


def handle_retry(p: PlanState) -> None:
    if not p.st.is_failed(p.desired):
        ignore_command(p, "retry", f"revision {p.desired} has not failed")
        return
    value = p.new_command("retry")
    if value is None:
        return
    p.st.failed_revisions = [f for f in p.st.failed_revisions if f.revision != p.desired]
    p.ledger("Command", p.desired, reason="retry", evidence=value)
    p.event("Normal", "Retry", f"revision {p.desired} cleared for another canary ({value})")


def command_time(value: str | None) -> datetime | None:
    """The time in a ``user@<RFC 3339>`` command value (None when there is none)."""
    if not value or "@" not in value:
        return None
    text = value.rsplit("@", 1)[1].strip()
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def resumed_by(resume: str | None, pause: str, rollout: RolloutState | None) -> str | None:
    """Who resumed: the resume annotation, when it is not older than the pause it ends.

    The annotation stays on the object after it was handled; a later pause removed by hand
    (``kubectl annotate ... batchpilot.dev/pause-``) must not be credited to whoever resumed
    the previous one. The pause's time comes from its value, else from when the step clock
    stopped; a resume value without a time is not trusted.
    """
    resumed_at = command_time(resume)
    if resume is None or resumed_at is None:
        return None
    paused_at = command_time(pause) or (rollout.paused_at if rollout is not None else None)
    if paused_at is not None and resumed_at < paused_at:
        return None
    return resume


def ignore_before_stable(p: PlanState) -> None:
    """Before any revision is stable there is no canary to promote or abort, nothing to retry."""
    for name in ("promote", "abort", "retry"):
        ignore_command(p, name, "nothing is stable yet")
