"""Stage 30, validate, with ``agent.runner: hermes``: the real Hermes Agent's arm of the regression gate.

Reads the round's config and each arm's policy; writes, under ``round-NN/validate/hermes/<arm>/``, what
``agents.play`` leaves (the server's log, each task's folders). ``hermes_lab.evaluate.validate.regression_gate``
calls it for each arm: ``played_tasks`` (which held-out tasks), ``played_by_hermes`` (one arm's runs, as its
``agent_played``) and ``real_agent_harm`` (the paired gain and the harm test that may stop the candidate). The
family's non-inferiority stays the built-in loop's in ``validate`` (4x the pairs on the same tasks).

    hermes-lab validate --params params/embedded.yaml ...   # agent.runner: hermes (the default) plays them
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def played_tasks(cfg: Any) -> list[Any]:
    """``agent.runner: hermes``: the held-out tasks the real Hermes Agent plays against each arm
    (``agent.heldout_tasks``, the same split and seed as the built-in loop's); none otherwise."""
    from hermes_lab.agents.play import plays_hermes
    from hermes_lab.policy.episodes import family_of_environment

    fam = family_of_environment(cfg.grpo.environment)
    if fam is None or not plays_hermes(cfg):
        return []
    return fam.generate_tasks(cfg.agent.heldout_tasks, split="heldout", seed=cfg.validate.seed)


def played_by_hermes(cfg: Any, base_model: str, adapter: str | None, tasks: list[Any], root: Path) -> dict[str, Any]:
    """The tasks, each played once by the real Hermes Agent against this policy served on 127.0.0.1
    (``agents.play``) and scored by its verifier on what the workspace holds: the arm's ``agent_played``."""
    import time

    from hermes_lab.agents.play import play_policy

    t0 = time.monotonic()
    runs = play_policy(cfg, base_model, adapter, tasks, root)
    done = sum(r.success for r in runs)
    hermes = {"runner": "hermes", "tasks": len(runs), "pass_rate": round(done / max(1, len(runs)), 4)}
    hermes.update(samples_per_task=1, task_ids=[t.task_id for t in tasks])  # what policy.paired_gain pairs
    hermes.update(passes="".join("1" if r.success else "0" for r in runs), seconds=round(time.monotonic() - t0, 1))
    hermes.update(dir=str(root))
    return hermes


def real_agent_harm(before: dict[str, Any], after: dict[str, Any], alpha: float) -> tuple[dict[str, Any], str | None]:
    """The real agent's paired gain (95% interval) and, when the candidate is significantly worse for it (the
    one-sided ``1 - alpha`` upper bound of the gain below 0), the gate's reason to stop. A harm test, not
    non-inferiority: ~100 tasks played once cannot show a drop is under 5 points (an equally good candidate would
    pass 35-80% of the time at its churn), so non-inferiority is the built-in loop's, on 4x the pairs."""
    from statistics import NormalDist

    from hermes_lab.policy.model import paired_gain

    gain = paired_gain(before, after)
    one_sided = paired_gain(before, after, z=NormalDist().inv_cdf(1 - alpha))
    hi = one_sided.get("gain_hi")
    if hi is None or hi >= 0:
        return gain, None
    return gain, (
        f"the real Hermes Agent: held-out success {before['pass_rate']:.3f} -> {after['pass_rate']:.3f} over "
        f"{gain['gain_tasks']} tasks paired ({gain['changed_tasks']} changed); the {1 - alpha:.0%} upper bound of "
        f"the gain, {hi:+.3f}, is below 0: the candidate is worse for it"
    )
