"""The round's outcome: every gate collected, the A/B's outcome applied, the summary written and printed.

Reads the stages' verdict files of ``runs/round-NN/`` (``hermes_lab.core.verdict``: the candidate, the trained
adapter, the held-out eval); writes ``runs/round-NN/summary.json``, the flywheel state's champion, negatives
and held experiment (the caller commits it), the MLflow registry's ``champion`` alias on a promotion, and the
round's notebooks, summary, gate tags and timings on its parent MLflow run. Called by
``hermes_lab.round.runner`` at the end of every round (``hermes-lab round``, ``hermes-lab flywheel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import RoundLayout
from hermes_lab.core.reports import RoundSummary
from hermes_lab.core.state import FlywheelState
from hermes_lab.core.verdict import read_verdict
from hermes_lab.round.stages import Stage

STATUS_UNDECIDED = "candidate held: undecided"  # the A/B reached a stage's hard end without a decision


def _gates(stages: Sequence[Stage], verdicts: dict[str, Any], prog: dict[str, Any]) -> list[dict[str, Any]]:
    """Every gate of the registry, in order; one that did not run says why."""
    stopped = prog.get("stopped_at") or {}
    ran = set(prog["completed"]) | ({stopped["stage"]} if stopped else set())
    out = []
    for s in stages:
        reported = {g.get("gate"): g for g in (verdicts.get(s.name) or {}).get("gates", [])}
        for name in s.gates:
            g = reported.get(name)
            if s.name in ran and g is not None:
                out.append({"gate": name, "stage": s.name, "passed": g.get("passed"), "detail": g.get("detail")})
                continue
            if s.name in ran:
                why = f"not reported: {s.name} wrote no '{name}' verdict in {s.verdict}"
            elif prog.get("continues") and not s.on_continue:
                why = f"not run: this round continues round {prog['continues']['round']:02d}'s held A/B"
            elif stopped:
                why = f"not run: the round stopped at {stopped['stage']} ({stopped['status']})"
            else:
                why = f"not run: stage {s.name} did not run"
            out.append({"gate": name, "stage": s.name, "passed": None, "detail": why})
    return out


def finish_round(
    cfg: HermesConfig,
    stages: Sequence[Stage],
    state: FlywheelState,
    rd: Path,
    n: int,
    prog: dict[str, Any],
    status: str,
) -> dict[str, Any]:
    """Collect the gates, apply the A/B outcome (promote / roll back), write summary.json. Idempotent: a
    resumed round redoes it from the same files and the state of the last commit."""
    verdicts = {s.name: read_verdict(rd / s.verdict) if s.verdict else None for s in stages}
    done = [v for s in stages if s.name in prog["completed"] and (v := verdicts[s.name])]
    cont = prog.get("continues")
    if cont:  # the candidate and its held-out eval are the held round's
        train_verdicts = [read_verdict(Path(cont["round_dir"]) / s.verdict) for s in stages if s.starts_cooldown]
        done = [v for v in train_verdicts if v] + done
    cand = next((v["candidate"] for v in reversed(done) if v.get("candidate")), None)
    trained = next((v for v in reversed(done) if v.get("adapter")), None)
    ev = next((v["eval"] for v in reversed(done) if v.get("eval")), None)
    # only a rollout that reached 100% moves the champion; a widened stage is not a promotion
    promoted = bool(cand and cand.get("promoted") is True)
    rolled_back = bool(cand and cand.get("rolled_back"))
    decision = cand.get("decision") if cand else None
    held = (cand or {}).get("held")
    if status == "completed" and cand is not None:
        status = (
            "promoted"
            if promoted
            else "rolled back"
            if rolled_back
            else STATUS_UNDECIDED
            if held
            else f"candidate held ({decision})"
        )
    if held:  # the honest end: undecided at a stage's hard end; continued by the next round, or not
        nxt = cfg.round.on_held == "continue" and not cont and trained is not None and status == STATUS_UNDECIDED
        held = {**held, "next": "continue" if nxt else "new"}
        if nxt:
            state.held = {
                "round": n,
                "round_dir": str(rd),
                "ab_dir": str(_candidate_dir(stages, verdicts, rd)),
                "adapter": str(trained["adapter"]),  # type: ignore[index]
            }
    trained_any = any(s.starts_cooldown and s.name in prog["completed"] for s in stages)
    if promoted and trained is not None:
        state.champion_adapter = str(trained["adapter"])
        state.champion_round = n
        _register_champion(cfg, rd, trained.get("mlflow_run_id"))
    elif (rolled_back or (status.startswith("stopped") and trained_any)) and n not in state.negative_rounds:
        # a rejected candidate: its round's data is fuel for the next round, as negatives
        state.negative_rounds.append(n)
        for s in stages:
            state.negative_files += [str(rd / f) for f in s.data_outputs if (rd / f).exists()]
    # the champion's held-out sampled pass rate on the train stage's fixed task set (same tasks and seed
    # every round, so rounds compare): the candidate's if it was promoted, else the policy it started from
    pass_rate = ((ev.get("after") if promoted else ev.get("before")) or {}).get("pass_rate") if ev else None
    summary = RoundSummary(
        round=n,
        status=status,
        decision=decision,
        promoted=promoted,
        gates=_gates(stages, verdicts, prog),
        timings_s=prog["timings"],
        total_s=round(sum(prog["timings"].values()), 1),
        pass_rate=pass_rate,
        eval=ev,
        champion=state.champion_adapter,
        stopped_at=prog.get("stopped_at"),
        parent_run_id=prog["parent_run_id"],
        ab={k: cand.get(k) for k in ("delta", "p_value", "significant", "decision", "promoted", "final_ratio")}
        if cand
        else None,
        held=held,
        continues=cont["round"] if cont else None,
        ab_plan=_plan_warning(next((v["plan"] for v in done if v.get("plan")), None)),
        agent_played=agent_played(RoundLayout(rd).validate.regression),
    )
    summary.write(RoundLayout(rd).summary)
    return summary.to_json()


def _candidate_dir(stages: Sequence[Stage], verdicts: dict[str, Any], rd: Path) -> Path:
    """The folder of the stage whose verdict gave the candidate's outcome (the A/B's: ``runs/round-NN/ab``)."""
    s = next(s for s in reversed(stages) if s.verdict and (verdicts.get(s.name) or {}).get("candidate"))
    return (rd / s.verdict).parent  # type: ignore[operator]


def agent_played(regression: Path) -> dict[str, Any] | None:
    """Validate's agent family as the real Hermes Agent played it (``agent.runner: hermes``): the baseline's and
    the candidate's held-out success and the paired gain; None when the built-in loop played it."""
    import json

    try:
        played = json.loads(regression.read_text(encoding="utf-8")).get("agent_played")
    except (OSError, ValueError):
        return None
    if not played:
        return None
    b, a = played["before"], played["after"]
    keep = ("pass_rate", "tasks", "seconds")
    before, after = {k: b.get(k) for k in keep}, {k: a.get(k) for k in keep}
    return {"runner": played["runner"], "before": before, "after": after, "gain": played.get("gain")}


def _plan_warning(plan: dict[str, Any] | None) -> str | None:
    """The A/B plan's line when it was underpowered (the budget cannot reach the planned power), else None."""
    if not plan or not plan.get("underpowered"):
        return None
    return plan.get("line") or (
        f"underpowered A/B plan: power {plan.get('power')} < {plan.get('power_target')} at ab.plan_max_rate"
    )


def _register_champion(cfg: HermesConfig, rd: Path, run_id: str | None) -> None:
    """Register the promoted adapter in the MLflow registry and point the 'champion' alias at it. The
    version of a training run is created once: a resumed round finds it instead of adding another."""
    import mlflow
    from mlflow import MlflowClient

    if not run_id:
        return
    client, name = MlflowClient(), cfg.round.registered_model
    if not client.search_registered_models(filter_string=f"name = '{name}'"):
        client.create_registered_model(
            name, description="hermes-lab policies (LoRA adapters); alias 'champion' is live"
        )
    existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if existing:
        mv = existing[0]
    else:  # a plain artifact version (MLflow 3's register_model wants a logged model; the adapter is a PEFT dir)
        source = f"{mlflow.get_run(run_id).info.artifact_uri}/adapter"
        mv = client.create_model_version(name, source=source, run_id=run_id, tags={"round": rd.name})
    client.set_registered_model_alias(name, "champion", mv.version)


def log_round(prog: dict[str, Any], rd: Path, summary: dict[str, Any]) -> None:
    """The round's notebooks, summary, gate tags and timings on its parent MLflow run."""
    from hermes_lab.core import tracking

    mark = {True: "pass", False: "stop", None: "not run"}
    with tracking.resume_run(prog["parent_run_id"]):
        lay = RoundLayout(rd)
        for nb_path in lay.notebooks():
            tracking.log_artifact(nb_path, "notebooks")
        tracking.log_artifact(lay.summary)
        tracking.set_tags(
            {
                "round.status": summary["status"],
                "round.decision": summary["decision"] or "",
                **{f"gate.{g['gate']}": mark[g["passed"]] for g in summary["gates"]},
            }
        )
        metrics = {f"time_{k}": v for k, v in prog["timings"].items()}
        metrics["champion_pass_rate"] = summary["pass_rate"]
        tracking.log_metrics("round", metrics)


def print_summary(s: dict[str, Any]) -> None:
    print(f"\nround {s['round']:02d}: {s['status']}  (decision: {s['decision']}, {s['total_s']} s)")
    if s.get("continues"):
        print(f"  continued round {s['continues']:02d}'s held A/B (its candidate, its kept requests)")
    if s.get("ab_plan"):
        print(f"  {s['ab_plan']}")
    if s.get("held"):
        h = s["held"]
        lo, hi = h.get("cs") or (None, None)
        span = "n/a" if lo is None or hi is None else f"[{lo:+.3f}, {hi:+.3f}]"
        nxt = (
            "the next round continues this experiment (round.on_held: continue)"
            if h.get("next") == "continue"
            else "the next round trains a new candidate from the champion"
        )
        print(
            f"  held: stage {h['stage']} ({h['ratio']:.0%}) reached its hard end undecided, delta in {span} "
            f"(confidence sequence, reward scale; {h.get('units_candidate')} candidate / "
            f"{h.get('units_baseline')} baseline units); {nxt}"
        )
    for g in s["gates"]:
        mark = {True: "PASS", False: "STOP", None: "----"}[g["passed"]]
        print(f"  {mark}  {g['gate']:18s} {str(g['detail'])[:110]}")
    print("  where the time went: " + ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items()))
    if s.get("eval"):
        from hermes_lab.policy.model import describe_gain

        e = s["eval"]
        b, a = e["before"]["pass_rate"], e["after"]["pass_rate"]
        print(f"  held-out sampled pass rate: {b:.1%} -> {a:.1%}, {describe_gain(e)}")
        if e.get("agent"):  # the embedded agent family, trained episode-level (train/eval.json's agent)
            ag = e["agent"]
            b, a = ag["before"]["episode_success"], ag["after"]["episode_success"]
            print(f"  held-out agent episode success (built-in loop): {b:.1%} -> {a:.1%}, {describe_gain(ag)}")
    if s.get("agent_played"):  # validate's agent family, played by the real Hermes Agent (agent.runner: hermes)
        from hermes_lab.policy.model import describe_gain

        p = s["agent_played"]
        b, a = p["before"]["pass_rate"], p["after"]["pass_rate"]
        print(
            f"  held-out hermes tasks played by the real Hermes Agent (validate, baseline -> candidate): "
            f"{b:.1%} -> {a:.1%}, {describe_gain(p)}"
        )
