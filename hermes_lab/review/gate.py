"""Human review: spot-check the reward model against human judgement, and gate training on it.

Stage: between prep and train. The user's rule (docs/SPEC.md): humans spot-check 10% of samples; below 90%
agreement between the reward model and the humans, fix the reward model before training the policy.

Reads   runs/<round>/prep/review_queue.jsonl  (prep's sample: review_id, task_id, family, prompt, response,
                                              reward, reward_band, optional simulated_label)
        runs/review/labels.jsonl              (the label store, shared by rounds and reviewers)
Writes  runs/review/labels.jsonl              (append only, one fsync'd line per click)
        runs/<round>/review/gate.json         (status + statistics)
        runs/<round>/review/verdict.json      (the gate for the round runner, hermes_lab.round.stages)
        MLflow params/metrics/tags of the active stage run (notebooks/15_review_gate.ipynb)

    jupyter lab notebooks/review.ipynb                               # label (hermes_lab.review.app)
    hermes-lab review --queue runs/round-01/prep/review_queue.jsonl  # the gate: exit 0 pass,
                                                                     # 3 awaiting review, 4 blocked

Label store: ``hermes_lab.review.labels`` (append-only, crash-safe, corrupt lines quarantined); agreement statistics:
``hermes_lab.review.stats``. Both are re-exported here.

Agreement (reward model vs reviewer, one pair per labelled item; several reviewers -> their median):
- threshold: both on the same side of reward.success_threshold (>= 3 = success). The gated number by
  default: success is the signal GRPO learns from.
- within1: |reward - label| <= 1 on the 0..5 scale, for score labels (pass/fail labels are 0/5 and would
  count every 4.2 as a miss).
- kappa: Cohen's kappa on pass/fail, unweighted; kappa_weighted: on scores binned to integers (round
  half up, but never across the success threshold: 2.5 is a fail and lands in bin 2), quadratic weights by
  default (an ordinal scale: a 5-vs-0 miss must cost more than 3-vs-2).
  statsmodels.stats.inter_rater.cohens_kappa computes both from our confusion matrix; we only guard the
  undefined case (both raters always on one side: chance agreement is 1) and report None there.
- ci: Wilson 95% interval (proportion_confint, method="wilson") of the agreement the gate uses (threshold,
  or within1 on the score labels); it stays sane at agreement near 1, where the normal interval leaves [0, 1].

The verdict (issue #14: a point estimate of 27/30 is not "at least 90%"): pass only when the interval lies
entirely above review.min_agreement, blocked when it lies entirely below, and otherwise "inconclusive:
label N more", N being the labels that would settle it if agreement stayed at its current rate. Either
needs at least review.min_labels labels (default: enough for +-review.max_ci_halfwidth around 90%, 73).
Inconclusive makes the round wait like awaiting review (exit 3). A long queue (a big traffic log's 10%)
is capped at review.max_items (default: +-max_ci_halfwidth at 50% agreement, 193): the gate counts the
queue's first items, which prep writes in a seeded random order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import ConfigError, HermesConfig, load_config
from hermes_lab.core.inputs import REVIEW
from hermes_lab.core.jsonl import iter_objects, safe_name, write_json_atomic
from hermes_lab.core.layout import RoundLayout, RunsLayout
from hermes_lab.core.verdict import STOP_AWAITING_REVIEW, STOP_BLOCKED_REVIEW, gate, write_verdict
from hermes_lab.review.labels import (  # noqa: F401  (re-exported: the gate's callers import the store from here)
    DEFAULT_STORE,
    LabelStore,
    LoadResult,
    current_labels,
    read_labels,
)
from hermes_lab.review.stats import (  # noqa: F401  (re-exported: the agreement statistics of the gate)
    Z95,
    AgreementStats,
    agreement_stats,
    kappa_from_table,
    labels_for_halfwidth,
    labels_to_settle,
    wilson,
)
from hermes_lab.tasks.suite import family_of, verify

SIMULATED_REVIEWER = "simulated:verifier"
PASS, BLOCKED, AWAITING, INCONCLUSIVE = "pass", "blocked", "awaiting review", "inconclusive"
EXIT_CODES = {PASS: 0, AWAITING: 3, INCONCLUSIVE: 3, BLOCKED: 4}  # inconclusive waits like awaiting review
QUEUE_KEYS = ("review_id", "task_id", "prompt", "response", "reward")


class ReviewGateStop(RuntimeError):
    """Raised by the gate notebook when the status is not "pass": papermill stops the round there."""

    def __init__(self, result: GateResult):
        self.result, self.status = result, result.status
        super().__init__(f"review gate: {result.status}. {result.message}")


# ------------------------------------------------------------------------------------------- the queue
def load_queue(path: str | os.PathLike[str], max_items: int | None = None) -> list[dict[str, Any]]:
    """prep's review queue, checked; errors name the file and line. ``max_items``: only the first items
    (distinct review ids) count, in the queue's order (prep's seeded random order)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"review queue not found: {p} (the prep stage writes it: run it first)")
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, rec in iter_objects(p):
        missing = [k for k in QUEUE_KEYS if k not in rec]
        if missing:
            raise ValueError(f"{p}:{i}: missing key '{missing[0]}' (a review record needs {', '.join(QUEUE_KEYS)})")
        try:
            rec["reward"] = float(rec["reward"])
        except (TypeError, ValueError):
            raise ValueError(f"{p}:{i}: key 'reward' must be a number, got {rec['reward']!r}") from None
        rec["review_id"] = str(rec["review_id"])
        # identical trajectories share a review_id (a hash of task, prompt, response): one label covers all
        if rec["review_id"] in seen:
            continue
        seen.add(rec["review_id"])
        rec["family"] = rec.get("family") or family_of(str(rec["prompt"])) or "unknown"
        items.append(rec)
        if max_items and len(items) >= max_items:
            break
    return items


# ------------------------------------------------------------------------------------------- the gate
@dataclass
class GateResult:
    status: str  # "pass" | "blocked" | "awaiting review" | "inconclusive"
    agreement: float | None
    kappa: float | None  # pass/fail kappa, the partner of the threshold agreement
    ci: tuple[float, float] | None  # Wilson interval of the agreement the gate uses (``metric``)
    n_labels: int
    per_family: dict[str, dict[str, Any]]
    message: str
    n_required: int = 0
    n_queue: int = 0
    metric: str = "threshold"
    min_agreement: float = 0.9
    success_threshold: float = 3.0
    within1: float | None = None
    kappa_weighted: float | None = None
    simulated: bool = False  # any label used came from the simulated reviewer
    n_simulated: int = 0
    reviewers: list[str] = field(default_factory=list)
    confusion: list[list[int]] = field(default_factory=list)
    confusion_scores: list[list[int]] = field(default_factory=list)
    queue_path: str = ""
    store_path: str = ""
    value: float | None = None  # the gated agreement (threshold or within1)
    n_gated: int = 0  # labels behind ``value`` (within1: score labels only)
    labels_more: int | None = None  # inconclusive: labels that would settle the interval at the current rate
    max_items: int = 0  # the queue cap in force
    threshold_ci: tuple[float, float] | None = None  # Wilson interval of the threshold agreement

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def raise_for_status(self) -> None:
        if self.status != PASS:
            raise ReviewGateStop(self)


def gate_sizes(cfg: HermesConfig) -> tuple[int, int]:
    """(min_labels, max_items) in force: the configured values, or the ones sized by max_ci_halfwidth."""
    rc = cfg.review
    need = rc.min_labels or labels_for_halfwidth(rc.min_agreement, rc.max_ci_halfwidth)
    cap = rc.max_items or max(labels_for_halfwidth(0.5, rc.max_ci_halfwidth), need)
    return need, cap


def simulate_labels(items: list[dict[str, Any]], store: LabelStore) -> tuple[int, int]:
    """The task verifier labels every item nobody labelled yet (simulated=True). Returns (written, unknown)."""
    from tqdm.auto import tqdm

    have = {rid for (rid, _who) in current_labels(store.records)}
    recs, unknown = [], 0
    for it in tqdm(items, desc="simulated review", disable=len(items) < 500):
        if it["review_id"] in have:
            continue
        if it.get("simulated_label") is not None:
            value = float(it["simulated_label"])
        elif family_of(str(it["prompt"])) is not None:
            value = verify(str(it["prompt"]), str(it["response"]), store.scale)
        else:  # not one of the embedded tasks: no verifier can stand in for a human here
            unknown += 1
            continue
        recs.append(
            store.make_record(
                it["review_id"],
                SIMULATED_REVIEWER,
                min(max(value, 0.0), store.scale),
                note="task verifier",
                simulated=True,
            )
        )
    store.append_many(recs)
    return len(recs), unknown


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def review_gate(
    queue_path: str | os.PathLike[str],
    store_path: str | os.PathLike[str] | None = None,
    cfg: HermesConfig | None = None,
    simulate: bool | None = None,
    *,
    round_dir: str | os.PathLike[str] | None = None,
    write: bool = True,
) -> GateResult:
    """Compare the reward model with the labels of ``queue_path``'s items and decide.

    ``simulate`` None follows cfg.review.simulate. ``round_dir`` (default: the queue's round, i.e. the
    folder above prep/) receives review/gate.json unless ``write`` is False. Logs to the active MLflow run.
    """
    cfg = cfg or load_config(None)
    rc, scale, thr = cfg.review, float(cfg.reward.scale), float(cfg.reward.success_threshold)
    simulate = rc.simulate if simulate is None else bool(simulate)
    queue_path = Path(queue_path)
    min_labels, max_items = gate_sizes(cfg)
    items = load_queue(queue_path, max_items)
    store_path = store_path or RunsLayout(cfg.round.runs_dir).labels
    store = LabelStore(store_path, scale=scale)
    unknown = simulate_labels(items, store)[1] if simulate else 0

    # one label per item: the median of its human reviewers; simulated labels only when simulating and
    # no human labelled the item (a real reviewer always overrides the simulation)
    human: dict[str, list[dict[str, Any]]] = {}
    sim: dict[str, list[dict[str, Any]]] = {}
    for (rid, _who), rec in current_labels(store.records).items():
        (sim if rec.get("simulated") else human).setdefault(rid, []).append(rec)
    rewards, labels, scored, fams, reviewers = [], [], [], [], set()
    n_sim = ignored_sim = 0
    for it in items:
        recs = human.get(it["review_id"])
        if not recs and it["review_id"] in sim:
            if not simulate:
                ignored_sim += 1
                continue
            recs, n_sim = sim[it["review_id"]], n_sim + 1
        if not recs:
            continue
        rewards.append(it["reward"])
        labels.append(statistics.median(r["label"] for r in recs))
        scored.append(all(r.get("mode", "score") == "score" for r in recs))
        fams.append(str(it["family"]))
        reviewers.update(r["reviewer"] for r in recs)

    kw = dict(scale=scale, threshold=thr, weights=rc.kappa_weights)
    st = agreement_stats(rewards, labels, scored, **kw)
    per_family = {}
    for fam in sorted(set(fams)):
        idx = [i for i, f in enumerate(fams) if f == fam]
        fs = agreement_stats([rewards[i] for i in idx], [labels[i] for i in idx], [scored[i] for i in idx], **kw)
        per_family[fam] = {k: v for k, v in asdict(fs).items() if not k.startswith("confusion")}
    n_required = min(min_labels, len(items))
    if rc.agreement_metric == "threshold":
        value, n, ci, k = st.agreement, st.n, st.ci, round((st.agreement or 0.0) * st.n)
    else:  # within1 is defined on score labels only: its n and its interval are theirs
        value, n, ci, k = st.within1, st.n_scored, st.within1_ci, round((st.within1 or 0.0) * st.n_scored)
    more = labels_to_settle(k, n, rc.min_agreement) if n else None  # to settle the interval, at this rate
    who = "the simulated reviewer (task verifier)" if n_sim else "human review"
    notes = []
    if ignored_sim:
        notes.append(f"{ignored_sim} simulated labels ignored (simulation is off).")
    if unknown:
        notes.append(f"{unknown} items are not embedded tasks: the simulated reviewer cannot label them.")
    open_nb = f"Open notebooks/review.ipynb with queue_path='{queue_path}', set your reviewer id and label" + (
        " in score mode (within1 needs scores)" if rc.agreement_metric == "within1" else ""
    )
    stats_txt = ""
    if n:
        stats_txt = (
            f"{rc.agreement_metric} agreement {_pct(value)} with {who} on {n} labels (Wilson 95% CI "
            f"{_pct(ci[0])}-{_pct(ci[1])}), kappa {'n/a' if st.kappa is None else f'{st.kappa:.2f}'}"
        )
    if not items:
        status, msg = AWAITING, f"The review queue {queue_path} is empty: check prep (data.review_fraction)."
    elif n == 0:
        status = AWAITING
        msg = (
            f"No labels yet, {n_required} needed (queue: {len(items)} items). {open_nb} at least {n_required}, "
            "then rerun the gate. Unattended rounds: review.simulate: true (labels marked simulated)."
        )
    elif n < n_required or ci[0] < rc.min_agreement <= ci[1]:
        status = INCONCLUSIVE
        never = more is None and n >= n_required  # at exactly the bar's rate the interval always straddles it
        need = max(n_required - n, more or 0)
        left = len(items) - st.n
        more = None if never else need
        why = (
            f"{n} labels, {n_required} needed for +-{rc.max_ci_halfwidth:.0%}"
            if n < n_required
            else f"the interval straddles review.min_agreement {rc.min_agreement:.0%}"
        )
        if never:
            how = "agreement sits at the bar itself: more labels will not settle it; fix the reward model"
        elif need > left:
            how = (
                f"label {need} more, but only {left} unlabelled items are left in the queue (review.max_items "
                f"{max_items}): raise review.max_items or data.review_fraction, or fix the reward model"
            )
        else:
            how = f"label {need} more (if agreement stays at {_pct(value)}). {open_nb} {need} more, then rerun"
        msg = f"Inconclusive: {stats_txt}; {why}: {how}."
    else:
        worst = min(per_family, key=lambda f: per_family[f]["agreement"])
        if ci[1] < rc.min_agreement:
            status = BLOCKED
            msg = (
                f"Blocked: {stats_txt}, entirely below review.min_agreement {rc.min_agreement:.0%}. Fix the reward "
                f"model before training the policy (reward.types / reward.system / the judge); worst family: "
                f"{worst} ({_pct(per_family[worst]['agreement'])})."
            )
        elif rc.min_kappa > 0 and (st.kappa or 0.0) < rc.min_kappa:
            status = BLOCKED
            msg = (
                f"Blocked: {stats_txt}, below review.min_kappa {rc.min_kappa:.2f}: the raw agreement is mostly "
                "chance (nearly all items on one side). Fix the reward model before training the policy."
            )
        else:
            status, msg = PASS, f"Pass: {stats_txt}, entirely above {rc.min_agreement:.0%}."
            if st.kappa is not None and st.kappa < 0.4:
                notes.append(
                    "Kappa is low although raw agreement is high: most items sit on one side of the "
                    "threshold, so much of the agreement is chance. Look at the failures."
                )
    if n_sim:
        msg = f"[SIMULATED: {n_sim} of {n} labels are the task verifier's, not a human's] " + msg
    result = GateResult(
        status=status,
        agreement=st.agreement,
        kappa=st.kappa,
        ci=ci,
        n_labels=n,
        per_family=per_family,
        message=" ".join([msg, *notes]),
        n_required=n_required,
        n_queue=len(items),
        metric=rc.agreement_metric,
        min_agreement=rc.min_agreement,
        success_threshold=thr,
        within1=st.within1,
        kappa_weighted=st.kappa_weighted,
        simulated=n_sim > 0,
        n_simulated=n_sim,
        reviewers=sorted(reviewers),
        confusion=st.confusion,
        confusion_scores=st.confusion_scores,
        queue_path=str(queue_path),
        store_path=str(store_path),
        value=value,
        n_gated=n,
        labels_more=more if status == INCONCLUSIVE else None,
        max_items=max_items,
        threshold_ci=st.ci,
    )
    if write:
        rd = (
            Path(round_dir)
            if round_dir
            else (
                queue_path.parent.parent
                if queue_path.parent == RoundLayout(queue_path.parent.parent).prep.root
                else queue_path.parent
            )
        )
        review = RoundLayout(rd).review
        write_json_atomic(review.gate, result.to_dict())
        stop = {
            PASS: None,
            AWAITING: STOP_AWAITING_REVIEW,
            INCONCLUSIVE: STOP_AWAITING_REVIEW,
            BLOCKED: STOP_BLOCKED_REVIEW,
        }[status]  # inconclusive ("label N more") waits for labels like awaiting review
        write_verdict(review.root, "review", [gate("review_agreement", status == PASS, result.message)], stop)
    _log_mlflow(result, cfg, simulate)
    return result


def _log_mlflow(result: GateResult, cfg: HermesConfig, simulate: bool) -> None:
    """review/* metrics, params, tags and gate.json on the active MLflow run (no-op without one)."""
    from hermes_lab.core import tracking

    if tracking.active_run() is None:
        return
    rc = cfg.review
    tracking.log_params(
        {
            "review.min_agreement": rc.min_agreement,
            "review.min_labels": rc.min_labels,
            "review.max_ci_halfwidth": rc.max_ci_halfwidth,
            "review.max_items": result.max_items,
            "review.agreement_metric": rc.agreement_metric,
            "review.kappa_weights": rc.kappa_weights,
            "review.min_kappa": rc.min_kappa,
            "review.simulate": simulate,
            "review.queue": result.queue_path,
            "review.labels": result.store_path,
        }
    )
    metrics = {
        "agreement": result.agreement,
        "gated_agreement": result.value,
        "within1": result.within1,
        "kappa": result.kappa,
        "kappa_weighted": result.kappa_weighted,
        "n_labels": result.n_labels,
        "n_simulated": result.n_simulated,
        "ci_low": result.ci[0] if result.ci else None,
        "ci_high": result.ci[1] if result.ci else None,
        "labels_more": result.labels_more,
    }
    metrics.update({f"agreement_{safe_name(f)}": v["agreement"] for f, v in result.per_family.items()})
    tracking.log_metrics("review", metrics)
    tracking.set_tags({"review.status": result.status, "review.simulated": str(result.simulated).lower()})
    tracking.log_dict(result.to_dict(), RoundLayout(Path()).review.gate.as_posix())  # review/gate.json


# -------------------------------------------------------------------------------------------- display
def summary_frame(result: GateResult) -> Any:
    """Per-family table (pandas) for the notebooks; a ``simulated`` column keeps simulation visible."""
    import pandas as pd

    rows = {
        **result.per_family,
        "ALL": {
            "n": result.n_labels,
            "agreement": result.agreement,
            "ci": result.ci,
            "within1": result.within1,
            "kappa": result.kappa,
            "kappa_weighted": result.kappa_weighted,
        },
    }
    df = pd.DataFrame.from_dict(rows, orient="index")[["n", "agreement", "ci", "within1", "kappa", "kappa_weighted"]]
    df["simulated"] = result.simulated
    return df


def plot_agreement(result: GateResult) -> Any:
    """Heatmap of reward model (rows) vs reviewer (columns) on integer-binned scores."""
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: no global figure state in kernels or tests

    m = np.asarray(result.confusion_scores)
    fig = Figure(figsize=(4.6, 4))
    ax = fig.subplots()
    ax.imshow(m, cmap="Blues")
    for (i, j), v in np.ndenumerate(m):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=8, color="white" if v > m.max() / 2 else "black")
    edge = float(np.ceil(result.success_threshold) - 0.5)  # cell border below the first success bin
    ax.axhline(edge, color="tab:red", lw=1)
    ax.axvline(edge, color="tab:red", lw=1)  # off-diagonal quadrants = pass/fail disagreements
    ax.set_xlabel("reviewer label" + (" (SIMULATED)" if result.simulated else ""))
    ax.set_ylabel("reward model score (binned)")
    ax.set_title(f"review gate: {result.status}, agreement {_pct(result.agreement)}")
    return fig


def format_result(result: GateResult) -> str:
    lines = [
        f"review gate: {result.status.upper()}" + ("  [SIMULATED labels]" if result.simulated else ""),
        f"  labels {result.n_labels} ({result.n_required} needed, queue {result.n_queue}, cap {result.max_items}), "
        f"reviewers: {', '.join(result.reviewers) or '-'}",
        f"  {result.metric} agreement {_pct(result.value)} (Wilson 95% CI {_pct(result.ci[0]) if result.ci else 'n/a'}-"
        f"{_pct(result.ci[1]) if result.ci else 'n/a'}; gate: {result.min_agreement:.0%}), threshold "
        f"{_pct(result.agreement)}, within1 {_pct(result.within1)}, kappa "
        f"{'n/a' if result.kappa is None else f'{result.kappa:.2f}'}, weighted kappa "
        f"{'n/a' if result.kappa_weighted is None else f'{result.kappa_weighted:.2f}'}",
    ]
    for fam, s in result.per_family.items():
        lines.append(f"    {fam:<10} n={s['n']:<4} agreement {_pct(s['agreement'])}  within1 {_pct(s['within1'])}")
    lines.append("  " + result.message)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    REVIEW.add_arguments(parser)  # hermes_lab.core.inputs: the notebook's parameters and these, declared once


def run_cli(args: argparse.Namespace) -> int:
    cfg = load_config(args.params)
    try:
        result = review_gate(
            args.queue, args.labels, cfg, simulate=args.simulate or cfg.review.simulate, round_dir=args.round_dir
        )
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError) as e:
        print(f"hermes-lab review: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_result(result))
    return EXIT_CODES[result.status]


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.review.gate", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
