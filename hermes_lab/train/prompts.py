"""Stage 20, train: the prompt set a GRPO phase trains on, from whatever ``--data`` names.

Reads ``--data``: a prep output dir (``runs/round-NN/prep/``: its ``grpo_dataset/``, or with ``grpo.turns`` its
``conversations/``), a saved ``datasets`` dir, or a trajectories JSONL (run through prep first, into
``<output>/prep/``); writes nothing else. ``hermes_lab.train.grpo`` calls it (``hermes-lab train``); it leaves out
the prompts with no room for a full completion (``filter_long_prompts``) and sets a turn phase's settings
(``turn_config``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.layout import PrepLayout, TrainLayout

log = logging.getLogger("hermes_lab.train")


# ------------------------------------------------------------------------------------------------ data
def no_data_error(data: str | os.PathLike[str]) -> FileNotFoundError:
    return FileNotFoundError(f"--data {data}: no such file or directory")


def load_prompt_set(data: str | os.PathLike[str], cfg: HermesConfig, work_dir: Path) -> Any:
    """The GRPO prompt set as a ``datasets.Dataset`` (columns: prompt, reference, ref_reward, ...)."""
    from datasets import Dataset, load_from_disk

    p = Path(data)
    lay = PrepLayout(p)
    table = lay.conversations if cfg.grpo.turns else lay.grpo_dataset  # grpo.turns: turn-level, from conversations
    if p.is_dir() and table.is_dir():
        p = table
    elif cfg.grpo.turns and p.is_dir() and lay.grpo_dataset.is_dir():  # a prep dir without conversations
        return Dataset.from_dict({"messages": []})  # no conversation: no turn to train on
    if p.is_dir():
        try:
            ds = load_from_disk(str(p))
        except (IndexError, FileNotFoundError, ValueError):
            if not cfg.grpo.turns or p.name != table.name:
                raise
            ds = Dataset.from_dict({"messages": []})  # prep wrote no conversation (an empty dataset dir)
    elif p.is_file():
        out = prep_data_file(p, cfg, work_dir)
        found = out / table.name
        if not found.is_dir():
            raise ValueError(f"--data {data}: prep found no {table.name} in it (grpo.turns={cfg.grpo.turns!r})")
        ds = load_from_disk(str(found))
    else:
        raise no_data_error(data)
    if cfg.grpo.turns:
        if "messages" not in ds.column_names:
            raise ValueError(f"--data {data}: grpo.turns needs prep's conversations (columns: {ds.column_names})")
        return ds  # train() turns it into turn prompts with the policy's chat template (train.turns)
    if "prompt" not in ds.column_names:
        raise ValueError(f"--data {data}: the dataset has no 'prompt' column (columns: {ds.column_names})")
    if cfg.grpo.environment and "family" in ds.column_names:
        # agent conversations are trained whole, in the episode phase: their first user turn is no string prompt
        ds = ds.filter(lambda fam: fam != "agent", input_columns="family")
    if "weight" in ds.column_names:  # hard (negative) prompts are repeated
        from hermes_lab.prep.run import expand_by_weight

        ds = expand_by_weight(ds)
    if cfg.grpo.max_train_prompts and len(ds) > cfg.grpo.max_train_prompts:
        ds = ds.shuffle(seed=cfg.grpo.seed).select(range(cfg.grpo.max_train_prompts))
    return ds if isinstance(ds, Dataset) else Dataset.from_list(list(ds))


def prep_data_file(path: Path, cfg: HermesConfig, work_dir: Path) -> Path:
    """A trajectories file given as --data, through prep into ``work_dir/prep``; its output dir."""
    from hermes_lab.prep import run as prep

    try:
        res = prep.run_prep([path], TrainLayout(work_dir).prep.root, cfg, make_plots=False)
    except prep.GateRefused as e:  # a direct `train` call is an explicit decision to train
        res = e.result
        log.warning("data gates would refuse this round: %s (training anyway: explicit train call)", e)
    return Path(res.output_dir)


def filter_long_prompts(ds: Any, tokenizer: Any, cfg: HermesConfig) -> tuple[Any, list[dict[str, Any]], int]:
    """Leave out prompts with no room for a full completion (prompt + max_completion_length > max_seq_len);
    return the kept set, the left-out prompts flagged, and the completion length.

    The completion length is never shortened to fit a long prompt: one long prompt would otherwise cut
    every completion of the run short. (config.py refuses a completion length that leaves no room at all.)"""
    budget, completion = cfg.data.max_seq_len, cfg.grpo.max_completion_length
    prompts = list(ds["prompt"])
    if "prompt_ids" in ds.column_names:  # turn rows: the tokens the trainer takes as they are
        given = list(ds["prompt_ids"])
        lens = [
            len(x) if x else len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p, x in zip(prompts, given)
        ]
    else:
        lens = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    keep = [i for i, n in enumerate(lens) if n + completion <= budget]
    kept = set(keep)
    flagged = [
        {
            "prompt": prompts[i][:200],
            "prompt_tokens": lens[i],
            "reason": f"prompt + completion ({lens[i]} + {completion}) > data.max_seq_len {budget}",
        }
        for i in range(len(lens))
        if i not in kept
    ]
    if not keep:
        raise ValueError(
            f"every prompt is longer than data.max_seq_len={budget} allows "
            f"(with grpo.max_completion_length={completion}); raise it"
        )
    return ds.select(keep), flagged, completion


def prompt_set_beside(data: str | os.PathLike[str], cfg: HermesConfig, work_dir: Path) -> Any:
    """A prep dir's prompt set as training would take it (the agent family's rows left to the episode phase), when
    it holds a row: then grpo.turns trains the conversations' turns in a phase of their own, after it. Else None."""
    p = Path(data)
    if not (p.is_dir() and PrepLayout(p).grpo_dataset.is_dir()):
        return None
    try:
        ds = load_prompt_set(p, replace(cfg, grpo=replace(cfg.grpo, turns="")), work_dir)
    except (IndexError, FileNotFoundError, ValueError):  # an empty dataset dir: no prompt set
        return None
    return ds if len(ds) else None


def turn_config(cfg: HermesConfig, inner: bool) -> HermesConfig:
    """The turn rows' phase: completions of grpo.turn_completion_length (a tool call is longer than a string
    answer); ``inner`` (the phase after a prompt set's): grpo.turn_steps steps and no episode phase of its own (the
    outer training runs it after)."""
    g = cfg.grpo
    kw: dict[str, Any] = {"max_completion_length": g.turn_completion_length or g.max_completion_length}
    if inner:
        kw.update(max_steps=g.turn_steps or g.max_steps, environment="")
    return replace(cfg, grpo=replace(g, turn_completion_length=0, **kw))
