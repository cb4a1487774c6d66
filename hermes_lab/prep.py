"""Distill stage: ingest execution logs, validate every line, distill them into GRPO data, apply the gates.

Reads the trajectories JSONL of a round (``runs/round-NN/trajectories.jsonl`` or any ``--input``; one
``{"prompt", "response", "reward", "task_id"}`` object a line, extra fields kept), the trajectories of
rolled-back rounds (``state.negative_files`` in ``runs/state.json``, or ``--negatives``) and the state's
last training time. Writes into the output dir (``runs/round-NN/prep/`` by convention):

  accepted.jsonl      every valid first-seen line of the --input files, exactly as logged (BOM/CR stripped)
  negatives.jsonl     every valid first-seen line of the negative files, plus "_negative": {file, round}
  duplicates.jsonl    every valid line repeating an earlier (prompt, response, task_id): {file, line, duplicate_of, raw}
  rejects.jsonl       every invalid line: {file, line (1-based), reason, detail, raw}
  outliers.jsonl      rewards the robust z-score flags (kept unchanged, see below)
  grpo_dataset/       HF dataset (save_to_disk): one row per unique training prompt, with a weight
  heldout_dataset/    the same columns for the held-out task_ids (the regression set)
  review_queue.jsonl  the stratified human spot-check sample
  plots/*.png         reward distribution per family, rejects by reason
  summary.json        counts, gate verdicts ({name, passed, detail}), paths
  verdict.json        the gates in the round runner's format (hermes_lab.stages), stop: "skipped: data gate"

Counts, per file and in total: ``lines = blank + read`` and ``read = accepted + rejected + duplicates``
(blank: empty or whitespace-only lines, skipped, not errors; duplicates: valid lines whose
(prompt, response, task_id) was already accepted from any file, inputs first, then negatives).
``new_samples`` = accepted lines of the --input files: the min_samples gate counts those.

Decisions: a line over ``data.max_line_bytes`` (16 MiB) is rejected as "line too long" without being held in
memory (rejects.jsonl keeps its first 4 KiB; the source file is never modified), a valid line below it is
accepted however long. NaN/Infinity anywhere in a line rejects it (Python's json accepts them; Arrow and
the loss do not). Rewards outside 0..scale are rejected at ingest: that is the clip which keeps the loss
finite. Within range, a robust z-score ``(r - median) / (1.4826 * MAD)`` (MeanAD * 1.2533 when MAD is 0)
beyond ``data.outlier_z`` flags a reward: listed, counted and kept, never dropped. The split hashes the
task_id, so a task (and every prompt seen under a held-out task_id) lands in one set only. Negative
prompts carry ``weight = data.negative_weight`` (1 otherwise); ``expand_by_weight(ds)`` repeats the rows.
Exit codes: 0 ok, 2 bad input (PrepError), 3 a gate refused (GateRefused); summary.json is written in all three.

    hermes-lab prep --input runs/round-01/trajectories.jsonl --output runs/round-01/prep --params params/embedded.yaml
    python -m hermes_lab.prep --input a.jsonl b.jsonl --output DIR [--override-cooldown --reason TEXT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hermes_lab import tasks, tracking
from hermes_lab.config import ConfigError, HermesConfig, load_config
from hermes_lab.stages import STOP_DATA, gate, write_verdict
from hermes_lab.state import Clock, FlywheelState, SimulatedClock, WallClock, parse_time, state_path

BOM = b"\xef\xbb\xbf"
REQUIRED = ("prompt", "response", "reward", "task_id")
RAW_KEEP = 4096  # bytes of a too-long line kept in rejects.jsonl
PROGRESS_MIN = 32 << 20  # show a tqdm bar for files from this size on
EXIT_BAD_INPUT, EXIT_REFUSED = 2, 3


class PrepError(Exception):
    """Bad input (file, line and reason in the message). rejects.jsonl and summary.json are written first."""


class GateRefused(Exception):
    """A data gate (min_samples, cooldown) said no. ``result`` holds the full, written PrepResult."""

    def __init__(self, message: str, result: PrepResult):
        super().__init__(message)
        self.result = result


@dataclass
class PrepResult:
    summary: dict[str, Any]
    output_dir: Path
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def gates(self) -> list[dict[str, Any]]:
        return self.summary.get("gates", [])

    @property
    def gates_passed(self) -> bool:
        return bool(self.summary.get("gates_passed"))


class _Bad(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _no_constants(name: str) -> Any:
    raise _Bad("NaN/Infinity not allowed", f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one decoder: json.loads(**kw) builds one per call


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def _check_record(obj: Any, scale: float) -> tuple[str, str, float, str, str | None]:
    """(prompt, response, reward, task_id, family field) of a valid record, else raises _Bad."""
    if type(obj) is not dict:
        raise _Bad("not a JSON object", f"got a JSON {_kind(obj)}")
    for k in REQUIRED:
        if k not in obj:
            raise _Bad(f"missing field '{k}'", f"required: {', '.join(REQUIRED)}; present: {', '.join(list(obj)[:12])}")
    prompt, response, reward, task_id = obj["prompt"], obj["response"], obj["reward"], obj["task_id"]
    if type(prompt) is not str:
        raise _Bad("prompt not a string", f"prompt is a JSON {_kind(prompt)}")
    if not prompt.strip():
        raise _Bad("empty prompt")
    if type(response) is not str:
        raise _Bad("response not a string", f"response is a JSON {_kind(response)}")
    if type(reward) is not float and type(reward) is not int:  # bool is not a reward; neither is "4.2"
        raise _Bad("reward not a number", f"reward is a JSON {_kind(reward)}: {str(reward)[:40]}")
    if not 0 <= reward <= scale:  # 1e999 parses to inf: caught here too
        raise _Bad("reward out of range", f"reward {reward} outside 0..{scale:g}")
    if type(task_id) is int:  # numeric ids are common in exports; the split hashes the text
        task_id = str(task_id)
    elif type(task_id) is not str or not task_id.strip():
        raise _Bad("bad task_id", f"task_id must be a non-empty string, got {json.dumps(task_id)[:40]}")
    for name, s in (("prompt", prompt), ("response", response), ("task_id", task_id)):
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:  # "\ud800" escapes decode to lone surrogates Arrow cannot store
                raise _Bad("invalid Unicode", f"lone surrogate escape in {name}") from None
    fam = obj.get("family")
    return prompt, response, float(reward), task_id, fam if type(fam) is str and fam else None


class _Ingest:
    """Streams every line of every file into column lists and the four JSONL sinks."""

    def __init__(self, out: Path, scale: float, max_line_bytes: int):
        self.scale, self.cap = scale, max_line_bytes
        self.cols: dict[str, list[Any]] = {
            k: [] for k in ("prompt", "response", "reward", "task_id", "family", "file", "line", "negative")
        }
        self.seen: dict[tuple[str, str, str], str] = {}
        self.files: list[dict[str, Any]] = []
        self.sinks = {
            name: open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed in close())
            for name in ("accepted", "negatives", "duplicates", "rejects")
        }

    def close(self) -> None:
        for f in self.sinks.values():
            f.close()

    def _reject(self, st: dict[str, Any], lineno: int, reason: str, detail: str, raw: bytes, **extra: Any) -> None:
        st["rejected"] += 1
        st["by_reason"][reason] += 1
        if len(st["first_errors"]) < 5:
            st["first_errors"].append(f"line {lineno}: {reason}" + (f" ({detail})" if detail else ""))
        rec = {
            "file": st["file"],
            "line": lineno,
            "reason": reason,
            "detail": detail,
            "raw": raw.decode("utf-8", errors="backslashreplace"),
            **extra,
        }
        self.sinks["rejects"].write(json.dumps(rec) + "\n")

    def scan(self, path: Path, role: str, round_no: int | None) -> dict[str, Any]:
        from tqdm import tqdm

        st: dict[str, Any] = {
            "file": str(path),
            "role": role,
            "round": round_no,
            "lines": 0,
            "blank": 0,
            "read": 0,
            "accepted": 0,
            "rejected": 0,
            "duplicates": 0,
            "by_reason": Counter(),
            "first_errors": [],
        }
        fidx, negative = len(self.files), role == "negative"
        self.files.append(st)
        c = self.cols
        c_prompt, c_resp, c_rew, c_tid, c_fam = c["prompt"], c["response"], c["reward"], c["task_id"], c["family"]
        c_file, c_line, c_neg = c["file"], c["line"], c["negative"]
        seen, scale, cap, decode = self.seen, self.scale, self.cap, _DECODER.decode
        out = self.sinks["negatives" if negative else "accepted"]
        dup_out = self.sinks["duplicates"]
        enc = json.encoder.encode_basestring_ascii  # C encoder: a duplicate costs no dict dumps
        file_js = enc(st["file"])
        size = path.stat().st_size
        bar = tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"prep {path.name}",
            disable=size < PROGRESS_MIN,
            mininterval=1.0,
        )
        lineno = pending = read = blank = accepted = dups = 0
        with open(path, "rb") as f:
            readline = f.readline
            while True:
                raw = readline(cap + 1)  # bounded: a 1 GiB line never sits in memory whole
                if not raw:
                    break
                lineno += 1
                pending += len(raw)
                if pending > 1 << 22:
                    bar.update(pending)
                    pending = 0
                if len(raw) > cap and not raw.endswith(b"\n"):
                    total, chunk = len(raw), raw
                    while chunk and not chunk.endswith(b"\n"):
                        chunk = readline(1 << 20)
                        total += len(chunk)
                    pending += total - len(raw)
                    read += 1
                    self._reject(
                        st,
                        lineno,
                        "line too long",
                        f"{total} bytes > data.max_line_bytes {cap}",
                        raw[:RAW_KEEP],
                        raw_truncated=True,
                    )
                    continue
                line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw.rstrip(b"\r")
                if line.startswith(BOM):  # Windows editors put one at the file start (or at every join)
                    line = line[3:]
                if not line.strip():
                    blank += 1
                    continue
                read += 1
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._reject(st, lineno, "not valid UTF-8", f"{e.reason} at byte {e.start}", line)
                    continue
                try:
                    obj = decode(text)
                    prompt, response, reward, task_id, fam = _check_record(obj, scale)
                except _Bad as e:
                    self._reject(st, lineno, e.reason, e.detail, line)
                    continue
                except json.JSONDecodeError as e:
                    self._reject(st, lineno, "malformed JSON", f"{e.msg} at column {e.colno}", line)
                    continue
                except RecursionError:
                    self._reject(st, lineno, "malformed JSON", "nested too deeply", line)
                    continue
                key = (prompt, response, task_id)
                first = seen.get(key)
                if first is not None:
                    dups += 1
                    dup_out.write(
                        f'{{"file": {file_js}, "line": {lineno}, "duplicate_of": {enc(first)}, "raw": {enc(text)}}}\n'
                    )
                    continue
                seen[key] = f"{st['file']}:{lineno}"
                accepted += 1
                if negative:
                    obj["_negative"] = {"file": st["file"], "round": round_no}
                    out.write(json.dumps(obj) + "\n")  # ASCII escapes: extra fields may hold lone surrogates
                else:
                    out.write(text + "\n")
                c_prompt.append(prompt)
                c_resp.append(response)
                c_rew.append(reward)
                c_tid.append(task_id)
                c_fam.append(fam)
                c_file.append(fidx)
                c_line.append(lineno)
                c_neg.append(negative)
        bar.update(pending)
        bar.close()
        st.update(lines=lineno, read=read, blank=blank, accepted=accepted, duplicates=dups)
        return st


def _round_of(path: str, state: FlywheelState | None, index: int) -> int | None:
    """The rolled-back round a negative file came from: 'round-NN' in its path, else state's parallel list."""
    import re

    m = re.search(r"round-0*(\d+)", str(path))
    if m:
        return int(m.group(1))
    if state is not None and len(state.negative_rounds) == len(state.negative_files) and index >= 0:
        return state.negative_rounds[index]
    return None


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


def _fmt_span(td: timedelta) -> str:
    minutes = max(0, math.ceil(td.total_seconds() / 60))
    return f"{minutes // 60}h {minutes % 60}m"


def evaluate_gates(
    new_samples: int,
    cfg: HermesConfig,
    state: FlywheelState | None,
    now: datetime,
    override_cooldown: bool = False,
    override_reason: str = "",
) -> list[dict[str, Any]]:
    """The data gates, as {name, passed, detail}: volume (min_samples) and the hard cooldown."""
    need = cfg.data.min_samples
    gates = [
        {"name": "min_samples", "passed": new_samples >= need, "detail": f"{new_samples} new samples (need >= {need})"}
    ]
    last = parse_time(state.last_train_time) if state is not None else None
    hours = cfg.data.cooldown_hours
    if last is None:
        gates.append({"name": "cooldown", "passed": True, "detail": "no earlier training"})
        return gates
    stamp = last.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    left = timedelta(hours=hours) - (now - last)
    if left <= timedelta(0):
        gates.append(
            {
                "name": "cooldown",
                "passed": True,
                "detail": f"{_fmt_span(now - last)} since last training {stamp} (cooldown {hours:g}h)",
            }
        )
    elif override_cooldown:
        gates.append(
            {
                "name": "cooldown",
                "passed": True,
                "overridden": True,
                "detail": f"cooldown: {_fmt_span(left)} left (last training {stamp}); OVERRIDDEN: {override_reason}",
            }
        )
    else:
        gates.append(
            {"name": "cooldown", "passed": False, "detail": f"cooldown: {_fmt_span(left)} left (last training {stamp})"}
        )
    return gates


def _plots(out: Path, fams: list[str], rewards: Any, by_reason: Counter, scale: float) -> dict[str, Path]:
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    fam_arr = np.asarray(fams, dtype=object)
    for fam, count in Counter(fams).most_common(8):
        ax.hist(
            rewards[fam_arr == fam],
            bins=np.linspace(0, scale, 21),
            histtype="step",
            linewidth=1.5,
            label=f"{fam} (n={count})",
        )
    ax.set(xlabel="logged reward", ylabel="records", title="Reward distribution per family (8 largest)")
    if fams:
        ax.legend(fontsize=8)
    paths = {"plot_rewards": tracking.log_figure(fig, out / "plots" / "reward_by_family.png")}
    fig = Figure(figsize=(7, 3))
    ax = fig.subplots()
    if by_reason:
        reasons, counts = zip(*by_reason.most_common())
        ax.barh(list(reasons)[::-1], list(counts)[::-1], color="tab:red")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="lines", title="Rejected lines by reason")
    else:
        ax.text(0.5, 0.5, "no rejected lines", ha="center", va="center")
        ax.set_axis_off()
    paths["plot_rejects"] = tracking.log_figure(fig, out / "plots" / "rejects_by_reason.png")
    return paths


def _log_mlflow(summary: dict[str, Any], paths: dict[str, Path]) -> None:
    """Params, prep/* metrics, tags and the summary to the active MLflow run (no-op without one)."""
    ov = summary["override"]
    tracking.log_params(
        {
            "prep.inputs": ",".join(summary["inputs"]),
            "prep.negatives": ",".join(summary["negatives"]),
            "prep.override_cooldown": ov["cooldown"],
            "prep.override_reason": ov["reason"],
        }
    )
    tracking.log_metrics("prep", summary["counts"])
    tracking.set_tags(
        {
            "prep.status": summary["status"],
            "prep.gates_passed": str(summary["gates_passed"]).lower(),
            "cooldown_override": str(bool(ov["cooldown"])).lower(),
        }
    )
    for name in ("summary", "review_queue"):
        if name in paths:
            tracking.log_artifact(paths[name], "prep")


def _write_summary(summary: dict[str, Any], paths: dict[str, Path]) -> None:
    summary["paths"] = {k: str(v) for k, v in paths.items()}
    paths["summary"].write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")


def run_prep(
    inputs: list[str | Path],
    output_dir: str | Path,
    cfg: HermesConfig,
    state: FlywheelState | None = None,
    clock: Clock | None = None,
    override_cooldown: bool = False,
    override_reason: str = "",
    negatives: list[str | Path] | None = None,
    *,
    make_plots: bool = True,
) -> PrepResult:
    """Ingest, validate, distill and gate. Raises PrepError (bad input) or GateRefused, after writing summary.json."""
    import numpy as np

    t0 = time.perf_counter()
    if override_cooldown and not override_reason.strip():
        raise PrepError("--override-cooldown needs a --reason (it is recorded in MLflow and summary.json)")
    if not inputs:
        raise PrepError("no input file given")
    if clock is None:
        clock = state.clock(True) if state is not None and cfg.round.simulated_clock else WallClock()
    neg_files = [
        (Path(p), _round_of(str(p), state, i), "state.negative_files")
        for i, p in enumerate(state.negative_files if state else [])
    ]
    neg_files += [(Path(p), _round_of(str(p), None, -1), "--negatives") for p in negatives or []]
    for p in map(Path, inputs):
        if not p.is_file():
            raise PrepError(f"input file not found (or not a regular file): {p}")
    for p, _, origin in neg_files:
        if not p.is_file():
            raise PrepError(f"negative file not found: {p} (listed in {origin})")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        n: out / f"{n}.jsonl" for n in ("accepted", "negatives", "duplicates", "rejects", "outliers", "review_queue")
    } | {"summary": out / "summary.json"}
    ing = _Ingest(out, float(cfg.reward.scale), cfg.data.max_line_bytes)
    try:
        files = [ing.scan(Path(p), "input", None) for p in inputs]
        files += [ing.scan(p, "negative", r) for p, r, _ in neg_files]
    finally:
        ing.close()
    t_ingest = time.perf_counter()
    counts = {k: sum(f[k] for f in files) for k in ("lines", "blank", "read", "accepted", "rejected", "duplicates")}
    counts["new_samples"] = sum(f["accepted"] for f in files if f["role"] == "input")
    counts["negative_records"] = sum(f["accepted"] for f in files if f["role"] == "negative")
    by_reason: Counter = sum((f["by_reason"] for f in files), Counter())
    summary: dict[str, Any] = {
        "stage": "prep",
        "status": "ok",
        "now": clock.now().isoformat(),
        "output_dir": str(out),
        "inputs": [str(p) for p in inputs],
        "negatives": [str(p) for p, _, _ in neg_files],
        "identity": "lines = blank + read; read = accepted + rejected + duplicates (per file and in total)",
        "counts": counts,
        "by_reason": dict(by_reason.most_common()),
        "per_file": [dict(f, by_reason=dict(f["by_reason"])) for f in files],
        "override": {"cooldown": bool(override_cooldown), "reason": override_reason if override_cooldown else ""},
        "gates": [],
        "gates_passed": False,
    }
    too_bad = [f for f in files if f["read"] and f["rejected"] / f["read"] > cfg.data.max_bad_fraction]
    if too_bad:
        summary["status"] = "bad_input"
        _write_summary(summary, paths)
        _log_mlflow(summary, paths)
        msgs = [
            f"{f['file']}: {f['rejected']} of {f['read']} non-blank lines rejected "
            f"({f['rejected'] / f['read']:.1%} > data.max_bad_fraction {cfg.data.max_bad_fraction:.0%}); "
            f"first: {'; '.join(f['first_errors'])}"
            for f in too_bad
        ]
        raise PrepError(" | ".join(msgs) + f". Every rejected line is in {paths['rejects']}")

    c = ing.cols
    fams = _families(c["prompt"], c["family"])
    rewards = np.asarray(c["reward"], dtype=np.float64)
    z, summary["outliers"] = _outliers(rewards, cfg.data.outlier_z)
    is_out = np.abs(z) > cfg.data.outlier_z
    with open(paths["outliers"], "w", encoding="utf-8") as f:
        for i in np.flatnonzero(is_out).tolist():
            f.write(
                json.dumps(
                    {
                        "file": files[c["file"][i]]["file"],
                        "line": c["line"][i],
                        "task_id": c["task_id"][i],
                        "reward": c["reward"][i],
                        "z": round(float(z[i]), 3),
                    }
                )
                + "\n"
            )
    summary["outliers"].update(
        count=int(is_out.sum()), action="flagged and kept; rewards outside 0..scale were rejected at ingest"
    )

    grpo, held, moved = _group(ing, fams, is_out, cfg.data.holdout_fraction)
    w = cfg.data.negative_weight
    tables = {"grpo_dataset": _prompt_table(grpo, w), "heldout_dataset": _prompt_table(held, w)}
    paths.update(_save_datasets(tables, out))
    grpo_tids = set(tables["grpo_dataset"]["task_id"].to_pylist())
    held_tids = set(tables["heldout_dataset"]["task_id"].to_pylist())
    n_neg = sum(g.neg_source is not None for g in grpo.values())
    summary["split"] = {
        "holdout_fraction": cfg.data.holdout_fraction,
        "grpo_prompts": len(grpo),
        "heldout_prompts": len(held),
        "grpo_rows_weighted": len(grpo) + n_neg * (w - 1),
        "grpo_task_ids": len(grpo_tids),
        "heldout_task_ids": len(held_tids),
        "task_id_overlap": len(grpo_tids & held_tids),
        "records_moved_to_heldout": moved,
        "negative_prompts": n_neg,
        "negative_weight": w,
    }
    summary["review"] = _review_sample(ing, fams, cfg, paths["review_queue"])
    summary["families"] = dict(Counter(fams).most_common())
    if make_plots:
        paths.update(_plots(out, fams, rewards, by_reason, float(cfg.reward.scale)))
    t_distill = time.perf_counter()

    summary["gates"] = evaluate_gates(
        counts["new_samples"], cfg, state, clock.now(), override_cooldown, override_reason
    )
    summary["gates_passed"] = all(g["passed"] for g in summary["gates"])
    summary["status"] = "ok" if summary["gates_passed"] else "gates_refused"
    summary["timing_s"] = {
        "ingest": round(t_ingest - t0, 3),
        "distill": round(t_distill - t_ingest, 3),
        "total": round(time.perf_counter() - t0, 3),
    }
    _write_summary(summary, paths)
    _log_mlflow(summary, paths)
    write_verdict(
        out,
        "prep",
        [gate(g["name"], g["passed"], g["detail"]) for g in summary["gates"]],
        stop=None if summary["gates_passed"] else STOP_DATA,
    )
    result = PrepResult(summary, out, paths)
    if not result.gates_passed:
        why = "; ".join(g["detail"] for g in summary["gates"] if not g["passed"])
        raise GateRefused(f"data gates refused training: {why}. Verdicts in {paths['summary']}", result)
    return result


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE", help="trajectories JSONL file(s)")
    parser.add_argument("--output", required=True, metavar="DIR", help="output dir (e.g. runs/round-01/prep)")
    parser.add_argument("--params", metavar="YAML", default=None, help="config file (default: built-in defaults)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set data.min_samples=100 (repeatable)",
    )
    parser.add_argument(
        "--negatives",
        nargs="+",
        default=[],
        metavar="FILE",
        help="trajectories of rolled-back rounds, carried as negative samples (added to state.negative_files)",
    )
    parser.add_argument(
        "--state",
        default=None,
        metavar="JSON",
        help="flywheel state (default: <round.runs_dir>/state.json when it exists)",
    )
    parser.add_argument("--simulated-now", default=None, metavar="ISO", help="use a simulated clock at this time")
    parser.add_argument(
        "--override-cooldown",
        action="store_true",
        help="train despite the cooldown (needs --reason; recorded in MLflow and summary.json)",
    )
    parser.add_argument("--reason", default="", metavar="TEXT", help="why the cooldown is overridden")


def run_cli(args: argparse.Namespace) -> int:
    try:
        overrides = {}
        for kv in args.set:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ConfigError(f"--set {kv!r}: use KEY=VALUE")
            overrides[k] = v
        cfg = load_config(args.params, overrides=overrides)
        sp = Path(args.state) if args.state else state_path(cfg.round.runs_dir)
        try:
            state = FlywheelState.load(sp) if sp.exists() else None
        except (ValueError, TypeError) as e:
            raise PrepError(f"{sp}: not a valid state file: {e}") from None
        try:
            clock = SimulatedClock(parse_time(args.simulated_now)) if args.simulated_now else None
        except ValueError:
            raise PrepError(f"--simulated-now: not an ISO time: {args.simulated_now!r}") from None
        res = run_prep(
            args.input,
            args.output,
            cfg,
            state=state,
            clock=clock,
            override_cooldown=args.override_cooldown,
            override_reason=args.reason,
            negatives=args.negatives,
        )
    except GateRefused as e:
        print(f"hermes-lab prep: refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (PrepError, ConfigError) as e:
        print(f"hermes-lab prep: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    k = res.summary["counts"]
    print(
        f"prep: {k['accepted']} accepted, {k['rejected']} rejected, {k['duplicates']} duplicates, "
        f"{k['blank']} blank; {res.summary['split']['grpo_prompts']} GRPO prompts, "
        f"{res.summary['split']['heldout_prompts']} held out; gates passed -> {res.output_dir}"
    )
    if k["rejected"]:
        print(f"prep: rejected lines are in {res.paths['rejects']}: {res.summary['by_reason']}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.cli import run_module

    return run_module("hermes_lab.prep", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
