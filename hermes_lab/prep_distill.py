"""Data prep, part 2: distill. The accepted records become the GRPO prompt set and the held-out regression set
(split by task_id), negatives of rolled-back rounds become weighted hard prompts, and the human review
sample is drawn.

Stage: prep (``hermes_lab.prep`` runs ingest, then this, then the gates). Writes ``grpo_dataset/``,
``heldout_dataset/`` (HF datasets, save_to_disk) and ``review_queue.jsonl`` into prep's output dir
(``runs/round-NN/prep/``); ``expand_by_weight`` repeats the hard prompts for the train stage.

    hermes-lab prep --input runs/round-01/trajectories.jsonl --output runs/round-01/prep
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from hermes_lab import tasks
from hermes_lab.config import HermesConfig
from hermes_lab.prep_ingest import _Ingest


def _families(prompts: list[str], fields: list[str | None]) -> list[str]:
    """The record's own "family" field, else the embedded task family of the prompt, else "unknown"."""
    cache: dict[str, str] = {}
    out = []
    for p, fam in zip(prompts, fields):
        if fam is None:
            fam = cache.get(p)
            if fam is None:
                fam = cache[p] = tasks.family_of(p) or "unknown"
        out.append(fam)
    return out


def _outliers(rewards: Any, z_max: float) -> tuple[Any, dict[str, Any]]:
    """Robust z-scores (median / 1.4826*MAD; 1.2533*MeanAD when MAD is 0) and what was used."""
    import numpy as np

    if len(rewards) == 0:
        return np.zeros(0), {"method": "robust_z", "z": z_max, "median": None, "sigma": None}
    med = float(np.median(rewards))
    dev = np.abs(rewards - med)
    sigma = 1.4826 * float(np.median(dev))
    if sigma == 0:  # more than half the rewards equal (e.g. all passes): fall back to the mean deviation
        sigma = 1.2533 * float(dev.mean())
    z = (rewards - med) / sigma if sigma > 0 else np.zeros(len(rewards))
    return z, {"method": "robust_z", "z": z_max, "median": med, "sigma": sigma}


def _split_of(task_id: str, fraction: float, cache: dict[str, bool]) -> bool:
    """True when the task_id is held out: first 8 hex of sha1(task_id) / 0xFFFFFFFF < fraction."""
    held = cache.get(task_id)
    if held is None:
        held = int(hashlib.sha1(task_id.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction
        cache[task_id] = held
    return held


class _Prompt:
    """One row of the GRPO / held-out prompt set, accumulated over the records of its prompt."""

    __slots__ = ("family", "n", "n_out", "neg_round", "neg_source", "ref_reward", "reference", "task_id", "total")

    def __init__(self, task_id: str | None, family: str, response: str, reward: float):
        self.task_id, self.family, self.reference, self.ref_reward = task_id, family, response, reward
        self.n, self.total, self.neg_source, self.neg_round, self.n_out = 0, 0.0, None, None, 0


def _group(
    ing: _Ingest, fams: list[str], is_out: Any, frac: float
) -> tuple[dict[str, _Prompt], dict[str, _Prompt], int]:
    """Split by task_id hash and group by prompt. A prompt also logged under a held-out task_id is held out
    whole (no prompt leaks either); a held-out row always names a held-out task_id."""
    c, files = ing.cols, ing.files
    cache: dict[str, bool] = {}
    held = [_split_of(t, frac, cache) for t in c["task_id"]]
    held_prompts = {p for p, h in zip(c["prompt"], held) if h}
    groups: tuple[dict[str, _Prompt], dict[str, _Prompt]] = ({}, {})
    moved = 0
    for i, (p, resp, r, tid, neg) in enumerate(
        zip(c["prompt"], c["response"], c["reward"], c["task_id"], c["negative"])
    ):
        h = held[i] or p in held_prompts
        moved += h and not held[i]
        g = groups[h].get(p)
        if g is None:
            g = groups[h][p] = _Prompt(tid if held[i] or not h else None, fams[i], resp, r)
        elif r > g.ref_reward:  # reference: the highest-reward logged response (the first one on ties)
            g.reference, g.ref_reward = resp, r
        if g.task_id is None and held[i]:
            g.task_id = tid
        g.n += 1
        g.total += r
        g.n_out += int(is_out[i])
        if neg and g.neg_source is None:
            g.neg_source, g.neg_round = files[c["file"][i]]["file"], files[c["file"][i]]["round"]
    return groups[0], groups[1], moved


def _prompt_table(groups: dict[str, _Prompt], neg_weight: int) -> Any:
    import pyarrow as pa

    gs = list(groups.values())
    return pa.table(
        {
            "prompt": pa.array(list(groups), pa.string()),
            "task_id": pa.array([g.task_id for g in gs], pa.string()),
            "family": pa.array([g.family for g in gs], pa.string()),
            "reference": pa.array([g.reference for g in gs], pa.string()),
            "ref_reward": pa.array([g.ref_reward for g in gs], pa.float64()),
            "n_logged": pa.array([g.n for g in gs], pa.int64()),
            "mean_logged_reward": pa.array([g.total / g.n for g in gs], pa.float64()),
            "is_negative": pa.array([g.neg_source is not None for g in gs], pa.bool_()),
            "weight": pa.array([neg_weight if g.neg_source is not None else 1 for g in gs], pa.int64()),
            "negative_source": pa.array([g.neg_source for g in gs], pa.string()),
            "negative_round": pa.array([g.neg_round for g in gs], pa.int64()),
            "n_outliers": pa.array([g.n_out for g in gs], pa.int64()),
        }
    )


def expand_by_weight(dataset: Any) -> Any:
    """The GRPO prompt set with every row repeated ``weight`` times (hard negative prompts count more)."""
    idx = [i for i, w in enumerate(dataset["weight"]) for _ in range(max(1, int(w)))]
    return dataset.select(idx)


def _save_datasets(tables: dict[str, Any], out: Path) -> dict[str, Path]:
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # two "Saving the dataset" bars per round say nothing
    paths = {}
    try:
        for name, table in tables.items():
            paths[name] = out / name
            shutil.rmtree(paths[name], ignore_errors=True)  # a rerun into the same dir leaves no stale shards
            datasets.Dataset(table).save_to_disk(str(paths[name]))
    finally:
        if bars:
            datasets.enable_progress_bars()
    return paths


def _review_sample(ing: _Ingest, fams: list[str], cfg: HermesConfig, path: Path) -> dict[str, Any]:
    """Stratified (family x reward band) share of the new records, at least one per non-empty stratum,
    ranked by a seeded hash of the review id: the same records give the same sample in any order."""
    c, scale = ing.cols, float(cfg.reward.scale)
    low, high = 0.3 * scale, cfg.reward.success_threshold  # on the 5 scale: low < 1.5, high >= 3
    seed, rf = cfg.data.seed, cfg.data.review_fraction
    strata: dict[tuple[str, str], list[tuple[bytes, str, int]]] = {}
    for i, (p, resp, r, tid, neg) in enumerate(
        zip(c["prompt"], c["response"], c["reward"], c["task_id"], c["negative"])
    ):
        if neg:
            continue
        rid = hashlib.sha1((tid + p + resp).encode("utf-8")).hexdigest()[:12]
        band = "low" if r < low else "high" if r >= high else "mid"
        strata.setdefault((fams[i], band), []).append((hashlib.sha1(f"{seed}:{rid}".encode()).digest(), rid, i))
    picked = []
    for members in strata.values():
        k = 0 if rf <= 0 else max(1, int(rf * len(members) + 0.5))
        picked += sorted(members)[:k]
    with open(path, "w", encoding="utf-8") as f:
        for _, rid, i in sorted(picked):
            p, resp, r = c["prompt"][i], c["response"][i], c["reward"][i]
            f.write(
                json.dumps(
                    {
                        "review_id": rid,
                        "task_id": c["task_id"][i],
                        "family": fams[i],
                        "prompt": p,
                        "response": resp,
                        "reward": r,
                        "reward_band": "low" if r < low else "high" if r >= high else "mid",
                        "simulated_label": tasks.verify(p, resp, scale) if tasks.family_of(p) else None,
                    }
                )
                + "\n"
            )  # ASCII escapes: readers that splitlines() must not split on U+2028
    return {
        "fraction": rf,
        "seed": seed,
        "population": sum(map(len, strata.values())),
        "size": len(picked),
        "strata": {f"{fa}|{b}": len(m) for (fa, b), m in sorted(strata.items())},
    }
