"""The plan: one table of stages, run in order, each when its condition holds on the state the
stages before it left; then :func:`~batchpilot_operator.rollout.finish.finish` turns the state
into the :class:`~batchpilot_operator.rollout.inputs.Decision`.

The order is the contract: a pause is taken before anything else (no analysis runs while
paused), ``promote`` and ``abort`` act on the canary in flight before a revision change of the
same reconcile is applied, and the canary progresses last, on the revision it now runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchpilot_operator.rollout import commands, revisions, steps
from batchpilot_operator.rollout.finish import finish
from batchpilot_operator.rollout.inputs import Decision, PlanInputs
from batchpilot_operator.rollout.state import PlanState


@dataclass(frozen=True)
class Stage:
    name: str
    when: Callable[[PlanState], bool]
    run: Callable[[PlanState], None]


def _always(p: PlanState) -> bool:
    return True


def _nothing_stable(p: PlanState) -> bool:
    return p.st.stable_revision is None


def _stable(p: PlanState) -> bool:
    return p.st.stable_revision is not None


def _canary(p: PlanState) -> bool:
    return p.st.stable_revision is not None and p.st.rollout is not None


STAGES: tuple[Stage, ...] = (
    Stage("pause or resume", _always, commands.handle_pause),
    Stage("first or adopted stable revision", _nothing_stable, revisions.adopt_or_initialise),
    Stage("commands before a stable revision", _nothing_stable, commands.ignore_before_stable),
    Stage("abort", _stable, commands.handle_abort),
    Stage("promote", _stable, commands.handle_promote),
    Stage("retry", _stable, commands.handle_retry),
    Stage("revision change", _stable, revisions.reconcile_revision),
    Stage("canary steps", _canary, steps.progress),
)


def plan(inputs: PlanInputs) -> Decision:
    """Decide the next state of one BatchingPolicy. Deterministic in its inputs."""
    p = PlanState(inputs)
    p.st.observed_generation = inputs.generation
    p.st.desired_revision = p.desired
    for stage in STAGES:
        if stage.when(p):
            stage.run(p)
    return finish(p)
