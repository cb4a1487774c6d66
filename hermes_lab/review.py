"""Human review: spot-check the reward model against human judgement, and gate training on it.

Stage: between prep and train. The user's rule (docs/SPEC.md): humans spot-check 10% of samples; below 90%
agreement between the reward model and the humans, fix the reward model before training the policy.

Reads   runs/<round>/prep/review_queue.jsonl  (prep's sample: review_id, task_id, family, prompt, response,
                                              reward, reward_band, optional simulated_label)
        runs/review/labels.jsonl              (the label store, shared by rounds and reviewers)
Writes  runs/review/labels.jsonl              (append only, one fsync'd line per click)
        runs/<round>/review/gate.json         (status + statistics)
        runs/<round>/review/verdict.json      (the gate for the round runner, hermes_lab.stages)
        MLflow params/metrics/tags of the active stage run (notebooks/15_review_gate.ipynb)

    jupyter lab notebooks/review.ipynb                               # label (hermes_lab.review_app)
    hermes-lab review --queue runs/round-01/prep/review_queue.jsonl  # the gate: exit 0 pass,
                                                                     # 3 awaiting review, 4 blocked

Label store. A click is one JSON line written with a single write() then flush+fsync, so a dead kernel
loses at most the click in flight. Nothing is rewritten: undo appends a tombstone (``undo_of`` = the
undone ``label_id``); a relabel appends a newer record, which wins. A torn last line (the kernel died
mid-write) is ignored with a warning; the next writer moves it to ``labels.jsonl.torn`` and cuts it off,
since no one ever saw it acknowledged.

Agreement (reward model vs reviewer, one pair per labelled item; several reviewers -> their median):
- threshold: both on the same side of reward.success_threshold (>= 3 = success). The gated number by
  default: success is the signal GRPO learns from.
- within1: |reward - label| <= 1 on the 0..5 scale, for score labels (pass/fail labels are 0/5 and would
  count every 4.2 as a miss).
- kappa: Cohen's kappa on pass/fail, unweighted; kappa_weighted: on scores binned to integers (round
  half up), quadratic weights by default (an ordinal scale: a 5-vs-0 miss must cost more than 3-vs-2).
  statsmodels.stats.inter_rater.cohens_kappa computes both from our confusion matrix; we only guard the
  undefined case (both raters always on one side: chance agreement is 1) and report None there.
- ci: Wilson 95% interval of the gated agreement (proportion_confint, method="wilson"); it stays sane at
  agreement near 1 and n ~ 30, where the normal interval leaves [0, 1].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hermes_lab.config import ConfigError, HermesConfig, load_config
from hermes_lab.jsonl import iter_objects, write_json_atomic
from hermes_lab.stages import STOP_AWAITING_REVIEW, STOP_BLOCKED_REVIEW, gate, write_verdict
from hermes_lab.tasks import family_of, verify

DEFAULT_STORE = "runs/review/labels.jsonl"
SIMULATED_REVIEWER = "simulated:verifier"
PASS, BLOCKED, AWAITING = "pass", "blocked", "awaiting review"
EXIT_CODES = {PASS: 0, AWAITING: 3, BLOCKED: 4}
QUEUE_KEYS = ("review_id", "task_id", "prompt", "response", "reward")


class ReviewGateStop(RuntimeError):
    """Raised by the gate notebook when the status is not "pass": papermill stops the round there."""

    def __init__(self, result: GateResult):
        self.result, self.status = result, result.status
        super().__init__(f"review gate: {result.status}. {result.message}")


# ------------------------------------------------------------------------------------------- the queue
def load_queue(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """prep's review queue, checked; errors name the file and line."""
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
    return items


# -------------------------------------------------------------------------------------- the label store
@dataclass
class LoadResult:
    records: list[dict[str, Any]]
    truncated: bool = False
    message: str = ""


def read_labels(path: str | os.PathLike[str]) -> LoadResult:
    """All records of a store, in write order. A torn last line is dropped and reported, not fatal."""
    p = Path(path)
    if not p.exists():
        return LoadResult([])
    lines = p.read_bytes().split(b"\n")
    tail = lines.pop()  # b"" when the file ends in a newline, as every complete write does
    records = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{p}:{i}: corrupt label record (only the last line may be torn)") from None
        if not isinstance(rec, dict) or not {"label_id", "review_id", "reviewer"} <= rec.keys():
            raise ValueError(f"{p}:{i}: not a label record (needs label_id, review_id, reviewer)")
        records.append(rec)
    result = LoadResult(records)
    if tail.strip():
        try:
            records.append(json.loads(tail))  # complete record, only its newline is missing
        except (json.JSONDecodeError, UnicodeDecodeError):
            result.truncated = True
            result.message = (
                f"{p}: ignored a truncated last line ({len(tail)} bytes): the kernel stopped "
                f"mid-write. {len(records)} records loaded; that last click is lost, redo it."
            )
            warnings.warn(result.message, stacklevel=2)
    return result


def current_labels(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(review_id, reviewer) -> the label in force: the latest record not undone by a tombstone."""
    undone = {r["undo_of"] for r in records if r.get("undo_of")}
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.get("undo_of") or r["label_id"] in undone:
            continue
        out[(r["review_id"], r["reviewer"])] = r
    return out


def _lock(fd: int) -> None:
    try:
        import fcntl  # Unix; several reviewers' kernels may append to one shared store
    except ImportError:  # pragma: no cover - Windows: single writer assumed
        return
    fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed


class LabelStore:
    """Append-only JSONL of labels. ``records`` holds everything this process read or wrote."""

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_STORE, scale: float = 5.0):
        self.path, self.scale = Path(path), float(scale)
        loaded = read_labels(self.path)
        self.records, self.recovered = loaded.records, loaded.message

    def _repair_tail(self, fd: int) -> None:
        # under the lock: cut a torn tail (saved aside) so the next record starts on its own line
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
            os.write(fd, b"\n")  # a complete record missing only its newline: keep it
        except (json.JSONDecodeError, UnicodeDecodeError):
            with open(self.path.with_name(self.path.name + ".torn"), "ab") as f:
                f.write(data[cut:] + b"\n")
            os.truncate(self.path, cut)

    def make_record(
        self,
        review_id: str,
        reviewer: str,
        label: float | None,
        *,
        mode: str = "score",
        note: str = "",
        simulated: bool = False,
        undo_of: str | None = None,
    ) -> dict[str, Any]:
        if label is not None:
            label = float(label)
            if not 0 <= label <= self.scale:
                raise ValueError(f"label {label} outside 0..{self.scale:g}")
            if mode == "passfail" and label not in (0.0, self.scale):
                raise ValueError(f"pass/fail labels are 0 or {self.scale:g}, got {label}")
        if not reviewer:
            raise ValueError("reviewer id is empty: every label records who gave it")
        return {
            "label_id": uuid.uuid4().hex[:16],
            "review_id": str(review_id),
            "reviewer": reviewer,
            "label": label,
            "mode": mode,
            "note": note,
            "simulated": bool(simulated),
            "undo_of": undo_of,
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        }

    def append_many(self, recs: list[dict[str, Any]]) -> None:
        """One unbuffered write() and one fsync per batch (per click in the app): a crash can tear only
        the last line, which the next load ignores and the next append cuts off."""
        if not recs:
            return
        data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in recs).encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _lock(fd)
            self._repair_tail(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:  # the new directory entry must survive a crash too
            try:
                dfd = os.open(self.path.parent, os.O_RDONLY)
                os.fsync(dfd)
                os.close(dfd)
            except OSError:  # pragma: no cover - platforms without directory fsync
                pass
        self.records.extend(recs)

    def append(self, review_id: str, reviewer: str, label: float, **kw: Any) -> dict[str, Any]:
        rec = self.make_record(review_id, reviewer, label, **kw)
        self.append_many([rec])
        return rec

    def undo(self, reviewer: str) -> dict[str, Any] | None:
        """Tombstone ``reviewer``'s latest label in force; returns the undone record (None: nothing to undo)."""
        live = current_labels(self.records)
        mine = [r for (_, who), r in live.items() if who == reviewer]
        if not mine:
            return None
        order = {r["label_id"]: i for i, r in enumerate(self.records)}
        last = max(mine, key=lambda r: order[r["label_id"]])
        self.append_many(
            [
                self.make_record(
                    last["review_id"],
                    reviewer,
                    None,
                    mode=last.get("mode", "score"),
                    simulated=last.get("simulated", False),
                    undo_of=last["label_id"],
                )
            ]
        )
        return last

    def labelled_ids(self, reviewer: str) -> set[str]:
        return {rid for (rid, who) in current_labels(self.records) if who == reviewer}


# ---------------------------------------------------------------------------------------- statistics
@dataclass
class AgreementStats:
    n: int
    agreement: float | None  # threshold agreement: same side of the success threshold
    ci: tuple[float, float] | None  # Wilson interval of ``agreement``
    within1: float | None  # |reward - label| <= 1, score labels only
    n_scored: int
    kappa: float | None  # unweighted, pass/fail
    kappa_weighted: float | None  # on integer-binned scores, score labels only
    confusion: list[list[int]]  # pass/fail: rows reward fail/pass, columns reviewer fail/pass
    confusion_scores: list[list[int]]  # binned scores: rows reward 0..scale, columns reviewer 0..scale


def kappa_from_table(table: Any, wt: str | None = None) -> float | None:
    """Cohen's kappa of a square confusion matrix (statsmodels); None when undefined."""
    import numpy as np
    from statsmodels.stats.inter_rater import cohens_kappa

    t = np.asarray(table, dtype=float)
    if t.sum() == 0:
        return None
    k = t.shape[0]
    dist = np.subtract.outer(np.arange(k), np.arange(k))
    w = {None: dist != 0, "linear": np.abs(dist), "quadratic": dist**2}[wt]
    p = t / t.sum()
    if (w * np.outer(p.sum(1), p.sum(0))).sum() == 0:  # chance disagreement is 0: kappa is 0/0
        return None
    return float(cohens_kappa(t, wt=wt, return_results=False))  # no variance: it warns on tiny tables


def agreement_stats(
    rewards: list[float],
    labels: list[float],
    scored: list[bool] | None = None,
    *,
    scale: float = 5.0,
    threshold: float = 3.0,
    weights: str = "quadratic",
    alpha: float = 0.05,
) -> AgreementStats:
    """Reward model vs reviewer on paired items. ``scored[i]``: label i is a 0..scale score (not pass/fail)."""
    import numpy as np
    from statsmodels.stats.proportion import proportion_confint

    r, h = np.asarray(rewards, dtype=float), np.asarray(labels, dtype=float)
    s = np.ones(len(r), bool) if scored is None else np.asarray(scored, bool)
    n, k = len(r), int(scale) + 1
    rp, hp = r >= threshold, h >= threshold
    confusion = np.zeros((2, 2), int)
    np.add.at(confusion, (rp.astype(int), hp.astype(int)), 1)
    agree = int((rp == hp).sum())
    ci = None
    if n:
        lo, hi = proportion_confint(agree, n, alpha=alpha, method="wilson")
        ci = (float(lo), float(hi))

    def binned(x: Any) -> Any:  # round half up, as a reviewer reads 2.5 on a 0..5 scale
        return np.clip(np.floor(x + 0.5), 0, k - 1).astype(int)

    scores = np.zeros((k, k), int)
    np.add.at(scores, (binned(r[s]), binned(h[s])), 1)
    return AgreementStats(
        n=n,
        agreement=agree / n if n else None,
        ci=ci,
        within1=float((np.abs(r[s] - h[s]) <= 1 + 1e-9).mean()) if s.any() else None,
        n_scored=int(s.sum()),
        kappa=kappa_from_table(confusion),
        kappa_weighted=kappa_from_table(scores, weights),
        confusion=confusion.tolist(),
        confusion_scores=scores.tolist(),
    )


# ------------------------------------------------------------------------------------------- the gate
@dataclass
class GateResult:
    status: str  # "pass" | "blocked" | "awaiting review"
    agreement: float | None
    kappa: float | None  # pass/fail kappa, the partner of the threshold agreement
    ci: tuple[float, float] | None
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def raise_for_status(self) -> None:
        if self.status != PASS:
            raise ReviewGateStop(self)


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
    store_path: str | os.PathLike[str] = DEFAULT_STORE,
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
    items = load_queue(queue_path)
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
    n, n_required = st.n, min(rc.min_labels, len(items))
    value = st.agreement if rc.agreement_metric == "threshold" else st.within1
    who = "the simulated reviewer (task verifier)" if n_sim else "human review"
    notes = []
    if ignored_sim:
        notes.append(f"{ignored_sim} simulated labels ignored (simulation is off).")
    if unknown:
        notes.append(f"{unknown} items are not embedded tasks: the simulated reviewer cannot label them.")
    if not items:
        status, msg = AWAITING, f"The review queue {queue_path} is empty: check prep (data.review_fraction)."
    elif n < n_required or value is None:
        status = AWAITING
        msg = (
            f"{n} labels so far, {n_required} needed (queue: {len(items)} items). Open notebooks/review.ipynb with "
            f"queue_path='{queue_path}', set your reviewer id and label {max(n_required - n, 1)} more"
            + (" in score mode (within1 needs scores)" if value is None and n >= n_required else "")
            + ", then rerun the gate. Unattended rounds: review.simulate: true (labels marked simulated)."
        )
    else:
        worst = min(per_family, key=lambda f: per_family[f]["agreement"])
        stats_txt = (
            f"{rc.agreement_metric} agreement {_pct(value)} with {who} on {n} labels "
            f"(Wilson 95% CI {_pct(st.ci[0])}-{_pct(st.ci[1])}), kappa "
            f"{'n/a' if st.kappa is None else f'{st.kappa:.2f}'}"
        )
        if value < rc.min_agreement:
            status = BLOCKED
            msg = (
                f"Blocked: {stats_txt}, below review.min_agreement {rc.min_agreement:.0%}. Fix the reward model "
                f"before training the policy (reward.types / reward.system / the judge); worst family: {worst} "
                f"({_pct(per_family[worst]['agreement'])})."
            )
        elif rc.min_kappa > 0 and (st.kappa or 0.0) < rc.min_kappa:
            status = BLOCKED
            msg = (
                f"Blocked: {stats_txt}, below review.min_kappa {rc.min_kappa:.2f}: the raw agreement is mostly "
                "chance (nearly all items on one side). Fix the reward model before training the policy."
            )
        else:
            status, msg = PASS, f"Pass: {stats_txt}."
            if st.kappa is not None and st.kappa < 0.4:
                notes.append(
                    "Kappa is low although raw agreement is high: most items sit on one side of the "
                    "threshold, so much of the agreement is chance. Look at the failures."
                )
            if st.ci[0] < rc.min_agreement:
                notes.append(f"The CI reaches below {rc.min_agreement:.0%}: more labels would make this sure.")
    if n_sim:
        msg = f"[SIMULATED: {n_sim} of {n} labels are the task verifier's, not a human's] " + msg
    result = GateResult(
        status=status,
        agreement=st.agreement,
        kappa=st.kappa,
        ci=st.ci,
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
    )
    if write:
        rd = (
            Path(round_dir)
            if round_dir
            else (queue_path.parent.parent if queue_path.parent.name == "prep" else queue_path.parent)
        )
        write_json_atomic(rd / "review" / "gate.json", result.to_dict())
        stop = {PASS: None, AWAITING: STOP_AWAITING_REVIEW, BLOCKED: STOP_BLOCKED_REVIEW}[status]
        write_verdict(rd / "review", "review", [gate("review_agreement", status == PASS, result.message)], stop)
    _log_mlflow(result, cfg, simulate)
    return result


def _log_mlflow(result: GateResult, cfg: HermesConfig, simulate: bool) -> None:
    """review/* metrics, params, tags and gate.json on the active MLflow run (no-op without one)."""
    from hermes_lab import tracking

    if tracking.active_run() is None:
        return
    rc = cfg.review
    tracking.log_params(
        {
            "review.min_agreement": rc.min_agreement,
            "review.min_labels": rc.min_labels,
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
        "within1": result.within1,
        "kappa": result.kappa,
        "kappa_weighted": result.kappa_weighted,
        "n_labels": result.n_labels,
        "n_simulated": result.n_simulated,
        "ci_low": result.ci[0] if result.ci else None,
        "ci_high": result.ci[1] if result.ci else None,
    }
    metrics.update({f"agreement_{f}": v["agreement"] for f, v in result.per_family.items()})
    tracking.log_metrics("review", metrics)
    tracking.set_tags({"review.status": result.status, "review.simulated": str(result.simulated).lower()})
    tracking.log_dict(result.to_dict(), "review/gate.json")


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
        f"  labels {result.n_labels} ({result.n_required} needed, queue {result.n_queue}), "
        f"reviewers: {', '.join(result.reviewers) or '-'}",
        f"  agreement {_pct(result.agreement)} (CI {_pct(result.ci[0]) if result.ci else 'n/a'}-"
        f"{_pct(result.ci[1]) if result.ci else 'n/a'}), within1 {_pct(result.within1)}, kappa "
        f"{'n/a' if result.kappa is None else f'{result.kappa:.2f}'}, weighted kappa "
        f"{'n/a' if result.kappa_weighted is None else f'{result.kappa_weighted:.2f}'}",
    ]
    for fam, s in result.per_family.items():
        lines.append(f"    {fam:<10} n={s['n']:<4} agreement {_pct(s['agreement'])}  within1 {_pct(s['within1'])}")
    lines.append("  " + result.message)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue", required=True, help="review queue JSONL from prep (<round_dir>/prep/review_queue.jsonl)"
    )
    parser.add_argument("--labels", default=DEFAULT_STORE, help=f"label store (default {DEFAULT_STORE})")
    parser.add_argument("--params", default=None, help="YAML config (default: built-in defaults)")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="the task verifier acts as a simulated reviewer (labels marked simulated)",
    )
    parser.add_argument("--round-dir", default=None, help="where review/gate.json goes (default: the queue's round)")
    parser.add_argument("--json", action="store_true", help="print the gate result as JSON")


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
    from hermes_lab.cli import run_module

    return run_module("hermes_lab.review", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
