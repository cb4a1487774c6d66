"""Distill stage, part 2 (``hermes_lab.data.prep``): from the ingested records to the GRPO / held-out prompt sets, the
outlier report and the human review sample, in bounded memory.

Reads what ``hermes_lab.data.ingest.Ingest`` left: the fixed-size columns (reward, origin, family id, split,
negative, review rank; indexed by the record's seq number, its order of acceptance) and the text spill,
partitioned by prompt. Writes into prep's output dir: ``grpo_dataset/``, ``heldout_dataset/``,
``outliers.jsonl``, ``review_queue.jsonl`` and ``left_out.jsonl``, and the selection report behind
``selection.json`` and its plot (contents in ``hermes_lab.data.prep``'s docstring).

How the memory stays bounded: a prompt's records all sit in one partition, so the per-prompt rows are built
one partition at a time; rows keep the seq of their prompt's first record, and the datasets are written in
that order (the order the whole input would give). The outliers (in input order) and the review sample (in
seeded-hash order) go through ``SortedSpill``: lines bucketed on disk by key range, each bucket sorted in
memory on its own. The robust z-score's median and MAD are exact (numpy over the reward column).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from array import array
from pathlib import Path
from typing import Any

from hermes_lab.data.ingest import LINE_BITS, review_id
from hermes_lab.tasks import suite as tasks

ROW_BATCH = 65536


# -------------------------------------------------------------------------------------------- outliers
def outlier_stats(rewards: Any, z_max: float) -> dict[str, Any]:
    """Robust z-score parameters (median / 1.4826*MAD; 1.2533*MeanAD when MAD is 0)."""
    import numpy as np

    if len(rewards) == 0:
        return {"method": "robust_z", "z": z_max, "median": None, "sigma": None}
    med = float(np.median(rewards))
    dev = np.abs(rewards - med)
    sigma = 1.4826 * float(np.median(dev))
    if sigma == 0:  # more than half the rewards equal (e.g. all passes): fall back to the mean deviation
        sigma = 1.2533 * float(dev.mean())
    return {"method": "robust_z", "z": z_max, "median": med, "sigma": sigma}


def outlier_flags(rewards: Any, info: dict[str, Any]) -> Any:
    import numpy as np

    if not info["sigma"]:
        return np.zeros(len(rewards), dtype=bool)
    return np.abs((rewards - info["median"]) / info["sigma"]) > info["z"]


# ------------------------------------------------------------------------------------------ sorted spill
class SortedSpill:
    """Lines with an integer sort key in [0, key_max), bucketed on disk by key range; ``write_sorted`` writes
    them in key order, holding one bucket in memory at a time."""

    def __init__(self, tmp: Path, name: str, key_max: int, est_bytes: int, budget_bytes: int):
        self.key_max = max(1, key_max)
        self.n = max(1, min(256, math.ceil(est_bytes / max(1, budget_bytes))))
        self.paths = [tmp / f"{name}-{i:03d}.txt" for i in range(self.n)]
        self.files = [open(p, "w", encoding="utf-8", newline="\n") for p in self.paths]  # noqa: SIM115
        self.width = len(f"{self.key_max:x}")

    def add(self, key: int, text: str) -> None:
        """``text``: one JSON line without its newline (JSON escapes raw newlines and tabs)."""
        self.files[key * self.n // self.key_max].write(f"{key:0{self.width}x}\t{text}\n")

    def write_sorted(self, path: Path) -> int:
        for f in self.files:
            f.close()
        n = 0
        with open(path, "w", encoding="utf-8", newline="\n") as out:
            for p in self.paths:
                lines = p.read_text(encoding="utf-8").splitlines()
                lines.sort()  # fixed-width hex keys: text order is key order
                out.writelines(line.split("\t", 1)[1] + "\n" for line in lines)
                n += len(lines)
                p.unlink()
        return n


# ------------------------------------------------------------------------------------------ review
def review_selection(cols: dict[str, Any], fam_names: list[str], cfg: Any) -> tuple[Any, dict[str, Any]]:
    """Stratified (family x reward band) share of the new records, at least one per non-empty stratum,
    ranked by a seeded hash of the review id: the same records give the same sample in any order.
    Returns the picked mask (by seq) and the summary's review section."""
    import numpy as np

    scale = float(cfg.reward.scale)
    low, high = 0.3 * scale, cfg.reward.success_threshold  # on the 5 scale: low < 1.5, high >= 3
    rf = cfg.data.review_fraction
    rewards, new = cols["reward"], ~cols["negative"]
    band = np.where(rewards < low, 1, np.where(rewards >= high, 0, 2))  # 0 high, 1 low, 2 mid
    stratum = cols["family"].astype(np.int64) * 3 + band
    seqs = np.flatnonzero(new)
    counts = np.bincount(stratum[seqs], minlength=3 * max(1, len(fam_names)))
    picked = np.zeros(len(rewards), dtype=bool)
    if rf > 0 and len(seqs):
        order = seqs[np.lexsort((seqs, cols["rank"][seqs], stratum[seqs]))]  # by stratum, then rank, then seq
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        k = np.maximum(1, (rf * counts + 0.5).astype(np.int64))
        for s in np.flatnonzero(counts).tolist():
            picked[order[starts[s] : starts[s] + k[s]]] = True
    names = ("high", "low", "mid")
    strata = {(fam_names[s // 3], names[s % 3]): int(c) for s, c in enumerate(counts.tolist()) if c}
    info = {
        "fraction": rf,
        "seed": cfg.data.seed,
        "population": int(len(seqs)),
        "size": int(picked.sum()),
        "strata": {f"{fa}|{b}": n for (fa, b), n in sorted(strata.items())},
    }
    return picked, info


def _review_line(prompt: str, response: str, task_id: str, family: str, reward: float, scale: float, thr: float) -> str:
    band = "low" if reward < 0.3 * scale else "high" if reward >= thr else "mid"
    rec = {
        "review_id": review_id(task_id, prompt, response),
        "task_id": task_id,
        "family": family,
        "prompt": prompt,
        "response": response,
        "reward": reward,
        "reward_band": band,
        "simulated_label": tasks.verify(prompt, response, scale) if tasks.family_of(prompt) else None,
    }
    return json.dumps(rec)  # ASCII escapes: readers that splitlines() must not split on U+2028


# ------------------------------------------------------------------------------------------ grouping
class _Prompt:
    """One row of the GRPO / held-out prompt set, accumulated over the records of its prompt."""

    __slots__ = (
        "family",
        "first",
        "n",
        "n_out",
        "n_pass",
        "neg_round",
        "neg_source",
        "ns",
        "ref_reward",
        "reference",
        "rmax",
        "rmin",
        "s1",
        "sq",
        "task_id",
        "tests",
        "total",
    )

    def __init__(self, first: int, task_id: str | None, family: str, response: str, reward: float):
        self.first, self.task_id, self.family, self.reference, self.ref_reward = (
            first,
            task_id,
            family,
            response,
            reward,
        )
        self.n, self.total, self.neg_source, self.neg_round, self.n_out = 0, 0.0, None, None, 0
        self.tests: str | None = None  # the task's tests (normalised JSON) from the first record that has them
        # the group: every sample of the prompt, duplicate lines included (the policy gave that answer again)
        self.ns, self.n_pass, self.s1, self.sq, self.rmin, self.rmax = 0, 0, 0.0, 0.0, reward, reward

    def outcome(self) -> str:
        """The prompt's group outcome over its logged samples (pass: reward >= reward.success_threshold)."""
        if self.ns < 2:
            return "single"  # one sample cannot show a mixed group
        return "all_pass" if self.n_pass == self.ns else "all_fail" if self.n_pass == 0 else "mixed"


def _table(groups: dict[str, _Prompt], sel: Selection, held: bool = False) -> Any:
    """A partition's rows with their outcome columns; ``held``: the held-out set (negatives weighted, no
    other selection: it is the regression set)."""
    import pyarrow as pa

    gs = list(groups.values())
    outcome = [g.outcome() for g in gs]
    std = [math.sqrt(max(g.sq / g.ns - (g.s1 / g.ns) ** 2, 0.0)) for g in gs]
    if held:
        weight = [sel.neg_w if g.neg_source is not None else 1 for g in gs]
        reason = ["heldout"] * len(gs)
    else:
        weight = [sel.base_weight(g, o) for g, o in zip(gs, outcome)]
        reason = [sel.reason(g, o) for g, o in zip(gs, outcome)]
    return pa.table(
        {
            "prompt": pa.array(list(groups), pa.string()),
            "task_id": pa.array([g.task_id for g in gs], pa.string()),
            "family": pa.array([g.family for g in gs], pa.string()),
            "reference": pa.array([g.reference for g in gs], pa.string()),
            "tests": pa.array([g.tests for g in gs], pa.string()),  # the tests reward's column (None: no tests)
            "ref_reward": pa.array([g.ref_reward for g in gs], pa.float64()),
            "n_logged": pa.array([g.n for g in gs], pa.int64()),
            "mean_logged_reward": pa.array([g.total / g.n for g in gs], pa.float64()),
            "n_samples": pa.array([g.ns for g in gs], pa.int64()),
            "n_pass": pa.array([g.n_pass for g in gs], pa.int64()),
            "pass_share": pa.array([g.n_pass / g.ns for g in gs], pa.float64()),
            "reward_std": pa.array(std, pa.float64()),
            "zero_std": pa.array([g.ns >= 2 and g.rmax == g.rmin for g in gs], pa.bool_()),
            "outcome": pa.array(outcome, pa.string()),
            "is_negative": pa.array([g.neg_source is not None for g in gs], pa.bool_()),
            "weight": pa.array(weight, pa.int64()),
            "selected": pa.array([True] * len(gs), pa.bool_()),
            "selection": pa.array(reason, pa.string()),
            "negative_source": pa.array([g.neg_source for g in gs], pa.string()),
            "negative_round": pa.array([g.neg_round for g in gs], pa.int64()),
            "n_outliers": pa.array([g.n_out for g in gs], pa.int64()),
            "first_seq": pa.array([g.first for g in gs], pa.int64()),
            "select_rank": pa.array([0 if held else sel.rank(p) for p in groups], pa.uint64()),
        }
    )


# ------------------------------------------------------------------------------------------ selection
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

    def capped(self, g: _Prompt, outcome: str) -> bool:
        return self.mode == "mixed" and outcome in UNIFORM and g.neg_source is None

    def base_weight(self, g: _Prompt, outcome: str) -> int:
        w = self.neg_w if g.neg_source is not None else 1
        return max(w, self.mixed_w) if self.mode == "mixed" and outcome == "mixed" else w

    def reason(self, g: _Prompt, outcome: str) -> str:
        if g.neg_source is not None:
            return "negative"
        return outcome if self.mode == "mixed" else "all"

    def rank(self, prompt: str) -> int:
        return int.from_bytes(hashlib.blake2b(self.seed_key + prompt.encode(), digest_size=8).digest(), "little")

    def count(self, groups: dict[str, _Prompt]) -> None:
        for p, g in groups.items():
            o = g.outcome()
            cell = self.cells.setdefault((g.family, "negative" if g.neg_source else "input", o), [0, 0, 0, 0])
            cell[0] += 1
            cell[1] += self.base_weight(g, o)
            cell[2] += g.ns >= 2 and g.rmax == g.rmin
            if self.capped(g, o):
                self.ranks.append(self.rank(p))

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

    def finish(self, table: Any, spill: SortedSpill | None) -> Any:
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


def _tid_hash(task_id: str | None) -> int:
    return int.from_bytes(hashlib.blake2b((task_id or "").encode(), digest_size=8).digest(), "little")


class Distill:
    """Builds the prompt tables partition by partition, feeding the outlier and review spills on the way."""

    def __init__(self, ing: Any, cols: dict[str, Any], cfg: Any, is_out: Any, picked: Any, z: dict[str, Any]):
        self.ing, self.cols, self.cfg, self.is_out, self.picked, self.z = ing, cols, cfg, is_out, picked, z
        self.fam_names = ing.family_names()
        self.moved = 0
        # one partition: its tables stay in memory; several: each partition's rows go to an Arrow file at once
        self.tables: dict[str, list[Any]] = {"grpo_dataset": [], "heldout_dataset": []}
        self.rows = {"grpo_dataset": 0, "heldout_dataset": 0}
        self.tids: dict[str, Any] = {"grpo_dataset": array("Q"), "heldout_dataset": array("Q")}
        self.n_negative_grpo = 0
        self.sel = Selection(cfg)

    def run(self, review: SortedSpill, outliers: SortedSpill) -> None:
        import pyarrow as pa

        for path in self.ing.part_paths:
            with pa.memory_map(str(path)) as src:
                table = pa.ipc.open_stream(src).read_all()
            if table.num_rows:
                self._partition(table, review, outliers)
            del table
            path.unlink()
        self.sel.plan()

    def _partition(self, table: Any, review: SortedSpill, outliers: SortedSpill) -> None:
        import pyarrow as pa

        c, files = self.cols, self.ing.files
        scale, thr = float(self.cfg.reward.scale), float(self.cfg.reward.success_threshold)
        med, sigma = self.z["median"], self.z["sigma"]
        seq_all = table.column("seq").to_numpy()
        held_all = c["held"][seq_all]
        held_prompts = set(table.column("prompt").filter(pa.array(held_all)).to_pylist())
        groups: tuple[dict[str, _Prompt], dict[str, _Prompt]] = ({}, {})
        for batch in table.to_batches(max_chunksize=ROW_BATCH):
            sq = batch.column(0).to_numpy()
            cols = zip(
                sq.tolist(),
                batch.column(1).to_pylist(),
                batch.column(2).to_pylist(),
                batch.column(3).to_pylist(),
                batch.column(4).to_pylist(),
                c["reward"][sq].tolist(),
                c["held"][sq].tolist(),
                c["negative"][sq].tolist(),
                c["family"][sq].tolist(),
                c["origin"][sq].tolist(),
                self.is_out[sq].tolist(),
                self.picked[sq].tolist(),
                c["copies"][sq].tolist(),
            )
            for seq, p, resp, tid, tests_json, r, held, neg, fid, origin, out, pick, dup in cols:
                fam = self.fam_names[fid]
                h = held or p in held_prompts
                self.moved += h and not held
                g = groups[h].get(p)
                if g is None:
                    g = groups[h][p] = _Prompt(seq, tid if held or not h else None, fam, resp, r)
                elif r > g.ref_reward:  # reference: the highest-reward logged response (the first one on ties)
                    g.reference, g.ref_reward = resp, r
                if g.task_id is None and held:
                    g.task_id = tid
                if g.tests is None and tests_json is not None:
                    g.tests = tests_json
                g.n += 1
                g.total += r
                k = 1 + dup
                g.ns += k
                g.s1 += k * r
                g.sq += k * r * r
                g.n_pass += k * (r >= thr)
                if r < g.rmin:
                    g.rmin = r
                elif r > g.rmax:
                    g.rmax = r
                g.n_out += out
                fidx = origin >> LINE_BITS
                if neg and g.neg_source is None:
                    g.neg_source, g.neg_round = files[fidx]["file"], files[fidx]["round"]
                if out:
                    line = origin & ((1 << LINE_BITS) - 1)
                    z = round((r - med) / sigma, 3)
                    rec = {"file": files[fidx]["file"], "line": line, "task_id": tid, "reward": r, "z": z}
                    outliers.add(seq, json.dumps(rec))
                if pick:
                    key = int(c["rank"][seq]) << LINE_BITS | seq
                    review.add(key, _review_line(p, resp, tid, fam, r, scale, thr))
        self.sel.count(groups[0])
        for name, grp in zip(("grpo_dataset", "heldout_dataset"), groups):
            if not grp:
                continue
            t = _table(grp, self.sel, held=name == "heldout_dataset")
            self.rows[name] += t.num_rows
            self.tids[name].extend(_tid_hash(g.task_id) for g in grp.values())
            if len(self.ing.part_paths) == 1:
                self.tables[name].append(t)
                continue
            f = self.ing.tmp / f"{name}-{len(self.tables[name]):04d}.arrow"
            with pa.OSFile(str(f), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
                writer.write_table(t)
            self.tables[name].append(f)
        self.n_negative_grpo += sum(g.neg_source is not None for g in groups[0].values())

    def split_summary(self) -> dict[str, Any]:
        import numpy as np

        w = self.cfg.data.negative_weight
        n = self.rows
        tids = {k: np.unique(np.frombuffer(v, dtype=np.uint64)) for k, v in self.tids.items()}
        return {
            "holdout_fraction": self.cfg.data.holdout_fraction,
            "grpo_prompts": n["grpo_dataset"],
            "heldout_prompts": n["heldout_dataset"],
            "grpo_rows_weighted": sum(c[1] - c[3] for c in self.sel.cells.values()),  # capped rows weigh 1
            "grpo_task_ids": int(len(tids["grpo_dataset"])),
            "heldout_task_ids": int(len(tids["heldout_dataset"])),
            "task_id_overlap": int(len(np.intersect1d(tids["grpo_dataset"], tids["heldout_dataset"]))),
            "records_moved_to_heldout": int(self.moved),
            "negative_prompts": self.n_negative_grpo,
            "negative_weight": w,
        }

    def save(self, out: Path) -> dict[str, Path]:
        """Write both datasets (save_to_disk), rows in the order of their prompt's first record."""
        import datasets
        import numpy as np

        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # two "Saving the dataset" bars per round say nothing
        import pyarrow as pa

        paths = {"left_out": out / "left_out.jsonl"}
        tmp = self.ing.tmp
        budget = (self.cfg.data.memory_budget_mb << 20) // 8
        left = SortedSpill(tmp, "left_out", max(1, self.ing.n), self.sel.cap.get("left_out", 0) * 400, budget)
        try:
            for name, parts in self.tables.items():
                paths[name] = out / name
                shutil.rmtree(paths[name], ignore_errors=True)  # a rerun into the same dir leaves no stale shards
                spill = left if name == "grpo_dataset" else None
                if not parts or not isinstance(parts[0], Path):  # one partition: rows already in first-record order
                    table = self.sel.finish(parts[0] if parts else _table({}, self.sel), spill)
                    datasets.Dataset(table.drop_columns(["first_seq"])).save_to_disk(str(paths[name]))
                    continue
                # several partitions: each finished (the cap) into a new Arrow file, memory-mapped, one ordered
                # pass (save_to_disk batches it)
                pieces = []
                for f in parts:
                    with pa.memory_map(str(f)) as src:
                        t = self.sel.finish(pa.ipc.open_stream(src).read_all(), spill)
                    g = f.with_suffix(".sel.arrow")
                    with pa.OSFile(str(g), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
                        writer.write_table(t)
                    del t
                    pieces.append(datasets.Dataset.from_file(str(g)))
                ds = datasets.concatenate_datasets(pieces)
                order = np.argsort(np.asarray(ds.data.column("first_seq")), kind="stable")
                ds.select(order).remove_columns(["first_seq"]).save_to_disk(str(paths[name]))
                del ds, pieces
        finally:
            if bars:
                datasets.enable_progress_bars()
        left.write_sorted(tmp / "left_out.jsonl")
        os.replace(tmp / "left_out.jsonl", paths["left_out"])
        return paths
