"""The staged rollout's steps, shared by ``ab-run`` (a simulated clock) and ``serve`` (the wall clock).

Stage: validate (A/B). Reads and writes nothing. ``hermes_lab.ab.run`` (``hermes-lab ab-run``) and the live
gateway (``hermes_lab.live.experiment.LiveRollout`` in ``hermes-lab serve``) both run a rollout as: the tested stages
of ``ab.plan_stages`` one after the other; at every look of a stage its rows so far go to
``ab_analysis.stage_action`` (the decision: roll back / hold at once, widen from the planned end on), and
``after_look`` below says what the rollout does next: stay in the stage, widen into the next stage (which
starts at that look), or end. The rollout's outcome is ``ab_analysis.rollout_decision`` on the stages' decisions.
One implementation of each rule: neither runner decides anything itself.

    python -m hermes_lab.ab_run ...      # simulated: a look every ab.look_every simulated seconds
    hermes-lab serve ...                 # live: a look every ab.look_every seconds of the (scaled) wall clock
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import stats as ab

EPS = 1e-9


@dataclass(frozen=True)
class Step:
    """What the rollout does after a look.

    ``kind``: "stay" (keep observing in this stage), "next" (widen: ``stage`` is the next stage, starting at the
    look) or "end". ``stopped_by`` (end): the decision that ended it ("roll back", "hold"), "keep observing" (the
    stage reached its hard end undecided), "duration" (the runner's horizon came first), or None when the last
    tested stage widened (the rollout ran through: promoted, see ``ab_analysis.rollout_decision``)."""

    kind: str
    stage: ab.Stage | None = None
    stopped_by: str | None = None


def start_stage(planned: ab.Stage, start: float) -> ab.Stage:
    """A planned stage, starting when the previous one acted (``plan_stages`` only gives nominal starts)."""
    return dataclasses.replace(planned, start=float(start))


def after_look(
    plan: Sequence[ab.Stage],
    stage: ab.Stage,
    action: tuple[str, float] | None,
    look: float,
    horizon: float | None = None,
) -> Step:
    """The step after a look at time ``look`` of ``stage``, given ``ab_analysis.stage_action``'s result there.
    ``horizon``: the runner's last time (ab-run's --duration); None: no limit (live)."""
    end = stage.hard_end if horizon is None else min(stage.hard_end, horizon)
    if action is None:
        if look < end - EPS:
            return Step("stay")
        return Step("end", stopped_by="duration" if look < stage.hard_end - EPS else "keep observing")
    if action[0] != "widen":
        return Step("end", stopped_by=action[0])
    k = next(i for i, s in enumerate(plan) if s.index == stage.index) + 1
    if k < len(plan) and (horizon is None or look < horizon - EPS):
        return Step("next", stage=start_stage(plan[k], look))
    return Step("end")


def look_step(
    plan: Sequence[ab.Stage],
    stage: ab.Stage,
    cols: dict[str, Any],
    st: ab.Settings,
    look: float,
    horizon: float | None = None,
) -> tuple[tuple[str, float] | None, Step]:
    """One look: the decision of ``ab_analysis.stage_action`` on the stage's rows so far (none yet: no decision) and the
    step it leads to."""
    action = ab_analysis.stage_action(cols, stage, st, look, st.rule) if len(cols["t"]) else None
    return action, after_look(plan, stage, action, look, horizon)
