"""Prep's GRPO prompt selection (``data.select``) and its report (stage: prep, through ``hermes_lab.prep.distill``).

Reads nothing itself: ``hermes_lab.prep.distill`` hands it each partition's prompt groups; writes the rows it
leaves out into the left_out spill, and ``selection_report`` / ``plot_selection`` make ``selection.json`` and
``plots/selection_by_family.png`` in prep's output dir. ``gain_by_family`` joins a round's selection with its
held-out gain (``hermes-lab round``'s compare stage).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path
from typing import Any

UNIFORM = ("all_pass", "all_fail")  # zero-signal groups: every sample passed, or every one failed
OUTCOMES = ("mixed", "single", "all_fail", "all_pass")


class Selection:
    """``data.select`` over the GRPO prompts. While the partitions are built: each prompt's base weight
    (negatives ``negative_weight``; under ``mixed``, mixed prompts ``mixed_weight``) and the tallies; once
    every prompt is counted (``plan``): how many uniform-outcome prompts the ``uniform_share`` cap keeps,
    as a threshold on a seeded hash rank of the prompt, so that the rows kept do not depend on the
    partitioning; ``finish`` applies it to a table (left-out rows stay in the dataset with weight 0)."""

    def __init__(self, cfg: Any):
        d = cfg.data
        self.mode, self.mixed_w, self.neg_w, self.share = d.select, d.mixed_weight, d.negative_weight, d.uniform_share
        self.seed_key = f"{d.seed}:".encode()
        # (family, source, outcome) -> [prompts, base weight, zero-std prompts, left out]
        self.cells: dict[tuple[str, str, str], list[int]] = {}
        self.ranks = array("Q")  # of the prompts the cap applies to (uniform outcome, not negative)
        self.threshold = (1 << 64) - 1
        self.cap: dict[str, Any] = {}

    def rank(self, prompt: str) -> int:
        return int.from_bytes(hashlib.blake2b(self.seed_key + prompt.encode(), digest_size=8).digest(), "little")

    def count(self, table: Any) -> None:
        """The tallies of a partition's GRPO prompt rows (``distill``'s table before ``finish``: its weight is the
        base weight, negatives ``negative_weight``, under ``mixed`` mixed prompts ``mixed_weight``), in their
        order; the seeded ranks of the prompts the cap applies to (uniform outcome, not negative)."""
        names = ("family", "is_negative", "outcome", "weight", "zero_std", "select_rank")
        for fam, neg, o, w, zero, rank in zip(*(table.column(k).to_pylist() for k in names)):
            cell = self.cells.setdefault((fam, "negative" if neg else "input", o), [0, 0, 0, 0])
            cell[0] += 1
            cell[1] += w
            cell[2] += zero
            if self.mode == "mixed" and o in UNIFORM and not neg:
                self.ranks.append(rank)

    def plan(self) -> None:
        """The cap: kept uniform prompts <= share / (1 - share) x the weight of everything else."""
        import numpy as np

        n_cap = len(self.ranks)
        other = sum(c[1] for (_, src, o), c in self.cells.items() if not (src == "input" and o in UNIFORM))
        if self.mode != "mixed" or n_cap == 0:
            keep, note = n_cap, "no cap" if self.mode != "mixed" else "no uniform-outcome prompts"
        elif other == 0:  # nothing else to train on: leaving them out would leave an empty prompt set
            keep, note = n_cap, "every prompt has a uniform outcome: all kept (an empty prompt set trains nothing)"
        elif self.share >= 1:
            keep, note = n_cap, "data.uniform_share is 1: all kept"
        else:
            keep = min(n_cap, int(self.share / (1 - self.share) * other))
            note = f"kept <= {self.share:g} / (1 - {self.share:g}) x {other} (the weight of the other prompts)"
        if keep < n_cap:
            ranks = np.sort(np.frombuffer(self.ranks, dtype=np.uint64))
            self.threshold = int(ranks[keep - 1]) if keep else -1
        self.cap = {"uniform_prompts": n_cap, "kept": keep, "left_out": n_cap - keep, "rule": note}

    def finish(self, table: Any, spill: Any) -> Any:
        """The table with the cap applied (weight 0, selected false, selection 'left_out'); the left-out
        rows are listed in ``spill`` (keyed by first_seq) and tallied in the cells."""
        import numpy as np
        import pyarrow as pa

        if spill is None or self.threshold >= (1 << 64) - 1:
            return table.drop_columns(["select_rank"])
        outcome = np.asarray(table.column("outcome").to_pylist(), dtype=object)
        capped = np.isin(outcome, UNIFORM) & ~table.column("is_negative").to_numpy(zero_copy_only=False)
        rank = table.column("select_rank").to_numpy()
        out = capped & ((rank > self.threshold) if self.threshold >= 0 else True)
        keep = pa.array(~out)
        for row in table.filter(pa.array(out)).to_pylist():
            self.cells[(row["family"], "input", row["outcome"])][3] += 1
            what = "passed" if row["outcome"] == "all_pass" else "failed"
            rec = {k: row[k] for k in ("prompt", "task_id", "family", "outcome", "n_samples", "n_pass")}
            rec["reason"] = (
                f"all {row['n_samples']} logged samples {what} (a zero-signal GRPO group); uniform-outcome prompts "
                f"beyond data.uniform_share={self.share:g} of the set are left out (kept: lowest seeded hash)"
            )
            spill.add(row["first_seq"], json.dumps(rec))
        table = table.set_column(table.schema.get_field_index("selected"), "selected", keep)
        w = np.where(out, 0, table.column("weight").to_numpy())
        table = table.set_column(table.schema.get_field_index("weight"), "weight", pa.array(w, pa.int64()))
        sel = np.where(out, "left_out", np.asarray(table.column("selection").to_pylist(), dtype=object))
        table = table.set_column(table.schema.get_field_index("selection"), "selection", pa.array(sel, pa.string()))
        return table.drop_columns(["select_rank"])


def selection_report(sel: Selection, cfg: Any, heldout_prompts: int) -> dict[str, Any]:
    """selection.json: what the GRPO prompt set holds per family and per source (new data, negatives), by
    group outcome, and the weight share each class carries into training (after the cap)."""

    def tally(cells: list[tuple[tuple[str, str, str], list[int]]]) -> dict[str, Any]:
        t: dict[str, Any] = {"available": sum(c[0] for _, c in cells)}
        for o in OUTCOMES:
            t[o] = sum(c[0] for k, c in cells if k[2] == o)
        t["zero_std"] = sum(c[2] for _, c in cells)
        t["negative"] = sum(c[0] for k, c in cells if k[1] == "negative")
        t["left_out"] = sum(c[3] for _, c in cells)
        t["selected"] = t["available"] - t["left_out"]
        t["weight"] = sum(c[1] - c[3] for _, c in cells)
        return t

    items = list(sel.cells.items())
    total = tally(items)
    grouped = sum(c[0] for k, c in items if k[2] != "single")
    w_all = max(1, total["weight"])
    share = {o: 0 for o in ("mixed", "single", "uniform", "negative")}
    for (_, src, o), c in items:
        share["negative" if src == "negative" else "uniform" if o in UNIFORM else o] += c[1] - c[3]
    total["frac_reward_zero_std"] = round(total["zero_std"] / grouped, 4) if grouped else None
    total["weight_share"] = {k: round(v / w_all, 4) for k, v in share.items()}
    fams = sorted({k[0] for k in sel.cells}, key=lambda f: -sum(c[0] for k, c in items if k[0] == f))
    by_family = {f: tally([(k, c) for k, c in items if k[0] == f]) for f in fams}
    for t in by_family.values():
        t["weight_share"] = round(t["weight"] / w_all, 4)
    return {
        "select": sel.mode,
        "grouping": "prompt text: every logged sample of a prompt (any task_id, any input file) is one group",
        "pass": f"reward >= reward.success_threshold ({cfg.reward.success_threshold:g})",
        "outcomes": {
            "mixed": "some samples pass, some fail: the groups GRPO learns from",
            "all_pass": "every sample passed (a zero-signal group for the verifier)",
            "all_fail": "every sample failed",
            "single": "one sample: the outcome of a group is unknown, kept at weight 1",
        },
        "zero_std": "prompts with >= 2 samples whose rewards are all equal (TRL's frac_reward_zero_std, per prompt)",
        "weights": {"mixed": sel.mixed_w if sel.mode == "mixed" else 1, "negative": sel.neg_w, "other": 1},
        "uniform_share": sel.share,
        "cap": sel.cap,
        "totals": total,
        "by_source": {src: tally([(k, c) for k, c in items if k[1] == src]) for src in ("input", "negative")},
        "by_family": by_family,
        "heldout_prompts": heldout_prompts,
        "gain_report": "gain_by_family(selection.json, train/eval.json): weight share beside held-out gain",
    }


def selection_metrics(rep: dict[str, Any]) -> dict[str, Any]:
    """The report's key numbers as prep/select_* metrics."""
    t = rep["totals"]
    out = {f"select_{k}": t[k] for k in (*OUTCOMES, "zero_std", "left_out", "selected", "weight")}
    out["select_frac_reward_zero_std"] = t["frac_reward_zero_std"]
    out |= {f"select_share_{k}": v for k, v in t["weight_share"].items()}
    return out


def gain_by_family(rep: dict[str, Any], ev: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Which data drove a round's gain: per family, its share of the training weight (selection.json) beside
    its held-out pass rates before / after (train's eval.json, ``policy.evaluate``'s per_family). A joint
    view, not a causal split: families train together and transfer. Families only one side knows get None."""
    before, after = (ev.get(k, {}).get("per_family", {}) for k in ("before", "after"))
    out = {}
    fams = rep["by_family"]
    for f in sorted(set(fams) | set(after), key=lambda f: (f not in fams, -fams.get(f, {}).get("weight", 0), f)):
        t, b, a = fams.get(f, {}), before.get(f, {}), after.get(f, {})
        gain = round(100 * (a["pass_rate"] - b["pass_rate"]), 1) if "pass_rate" in a and "pass_rate" in b else None
        keys = ("weight_share", "mixed", "left_out")
        out[f] = {
            **{k: t.get(k) for k in keys},
            "before": b.get("pass_rate"),
            "after": a.get("pass_rate"),
            "gain": gain,
        }
    return out


def plot_selection(rep: dict[str, Any], path: Path) -> Path:
    """Per family (12 largest): prompts by group outcome (left out hatched), and the weight share each
    family carries into training."""
    from matplotlib.figure import Figure

    from hermes_lab.core import tracking
    from hermes_lab.core.jsonl import plot_label

    fams = list(rep["by_family"])[:12][::-1]
    fig = Figure(figsize=(9, 0.5 * max(4, len(fams)) + 1.2))
    ax, ax2 = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [2, 1]})
    colors = {"mixed": "tab:green", "single": "tab:gray", "all_fail": "tab:red", "all_pass": "tab:blue"}
    y = list(range(len(fams)))
    left = [0.0] * len(fams)
    for o in OUTCOMES:
        n = [rep["by_family"][f][o] for f in fams]
        ax.barh(y, n, left=left, color=colors[o], label=o.replace("_", "-"))
        left = [a + b for a, b in zip(left, n)]
    out = [rep["by_family"][f]["left_out"] for f in fams]
    ax.barh(y, out, left=[a - b for a, b in zip(left, out)], fill=False, hatch="//", label="left out")
    ax.set(yticks=y, yticklabels=[plot_label(f) for f in fams], xlabel="GRPO prompts")
    ax.set_title(f"Prompts by group outcome (data.select: {rep['select']})", fontsize=10)
    if fams:
        ax.legend(fontsize=8, loc="lower right")
    ax2.barh(y, [100 * rep["by_family"][f]["weight_share"] for f in fams], color="tab:purple")
    ax2.set(xlabel="% of training weight")
    sh = rep["totals"]["weight_share"]
    ax2.set_title(" ".join(f"{k} {100 * v:.0f}%" for k, v in sh.items() if v) or "no GRPO prompts", fontsize=8)
    return tracking.log_figure(fig, path)
