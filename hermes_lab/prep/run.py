"""Distill stage: ingest execution logs, validate every line, distill them into GRPO data, apply the gates.

Reads the trajectories JSONL of a round (``runs/round-NN/trajectories.jsonl`` or any ``--input``, plain or
``.jsonl.gz``; one ``{"prompt", "response", "reward", "task_id"}`` object a line, extra fields kept), or agent
conversations in any shape ``hermes_lab.logs.readers`` knows (OpenAI chat JSONL; the Hermes Agent's
trajectories, session files or folder, state.db; detected per input or ``--format``), the
trajectories of rolled-back rounds (``state.negative_files`` in ``runs/state.json``, or ``--negatives``),
feedback files (``--feedback``, ``conversations.feedback``) and the state's last training time. Inputs are
only ever read. Writes into the output dir (``runs/round-NN/prep/`` by convention), each file through a temp
file renamed into place:

  accepted.jsonl      every valid first-seen line of the --input files, exactly as logged (BOM/CR stripped);
                      a conversation as its canonical record (hermes_lab.logs.record), reward included
  negatives.jsonl     every valid first-seen line of the negative files, plus "_negative": {file, round}
  duplicates.jsonl    every valid line repeating an earlier (prompt, response, task_id): {file, line, duplicate_of, raw}
                      (a conversation also says its kind, exact, near or id, and its conversation_id)
  rejects.jsonl       every invalid line: {file, line (1-based), reason, detail, raw}; a session or state.db
                      conversation: line null, its session (id) and file
  outliers.jsonl      rewards the robust z-score flags (kept unchanged, see below)
  grpo_dataset/       HF dataset (save_to_disk): one row per unique training prompt, its group outcome, a weight,
                      and its tests (JSON, null without: the tests reward's column, hermes_lab.sandbox.specs)
  left_out.jsonl      GRPO prompts data.select left out (weight 0; still in grpo_dataset): prompt, outcome, reason
  selection.json      what went into training: prompts and weight per family / source / group outcome
  heldout_dataset/    the same columns for the held-out task_ids (the regression set)
  conversations/      HF dataset: every accepted conversation, whole (messages, tools, outcome), with its split
                      (train / heldout: the prompt sets' rule) and reward (reward_source); empty for seed input
                      (hermes_lab.logs.record.dataset_schema). A conversation's row in the prompt sets is
                      its (first user message, final answer), and the tests its line carried (null without)
  review_queue.jsonl  the stratified human spot-check sample
  plots/*.png         reward distribution per family, rejects by reason, selection by family; conversations.png
                      (turns, tool calls and errors per conversation, reward by source) when there are any
  summary.json        counts, gate verdicts ({name, passed, detail}), paths (written atomically); "conversations":
                      turns, tool calls, tool errors, conversations and mean reward by reward source, feedback
  verdict.json        the gates in the round runner's format (hermes_lab.round.stages), stop: "skipped: data gate"

Counts, per file and in total: ``lines = blank + read`` and ``read = accepted + rejected + duplicates``
(blank: empty or whitespace-only lines, skipped, not errors; duplicates: valid lines whose
(prompt, response, task_id) was already accepted from any file, inputs first, then negatives).
``new_samples`` = accepted lines of the --input files: the min_samples gate counts those.

Decisions: every field of every line is validated (``hermes_lab.prep.ingest``: bad UTF-8, NaN/Infinity,
numbers that overflow or cannot be converted, duplicate keys, lone surrogates anywhere, wrong types; each a
rejected line with its number and reason). A line over ``data.max_line_bytes`` (16 MiB) is rejected as
"line too long" without being held in memory (rejects.jsonl keeps its first 4 KiB). Rewards outside
0..scale are rejected at ingest: that is the clip which keeps the loss finite. Within range, a robust
z-score ``(r - median) / (1.4826 * MAD)`` (MeanAD * 1.2533 when MAD is 0) beyond ``data.outlier_z`` flags a
reward: listed, counted and kept, never dropped. The split hashes the task_id, so a task (and every prompt
seen under a held-out task_id) lands in one set only. Negative prompts carry ``weight = data.negative_weight``
(1 otherwise); ``data.select: mixed`` weighs prompts by their group outcome, every logged sample of a prompt
text being one group (``hermes_lab.prep.selection.Selection``); ``expand_by_weight(ds)`` repeats the rows.
Free text that becomes an identifier (a family in a plot label or a metric name) is made safe where it is
used (``hermes_lab.core.jsonl.safe_name``); the data keeps it.

Memory: prep streams (``hermes_lab.prep.ingest``, ``hermes_lab.prep.distill``); record text is held within
``data.memory_budget_mb``, plus ~64 bytes of fixed-size fields per accepted record. An input that is one of
prep's own outputs (``--input D/accepted.jsonl --output D``) is refused before anything is opened.
Exit codes: 0 ok, 2 bad input (PrepError), 3 a gate refused (GateRefused); summary.json is written in all three.

    hermes-lab prep --input runs/round-01/trajectories.jsonl --output runs/round-01/prep --params params/embedded.yaml
    python -m hermes_lab.prep --input a.jsonl b.jsonl.gz --output DIR [--override-cooldown --reason TEXT]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import ConfigError, HermesConfig, load_config, set_overrides
from hermes_lab.core import tracking
from hermes_lab.core.inputs import PREP
from hermes_lab.core.jsonl import plot_label, safe_name, write_json_atomic
from hermes_lab.core.layout import PrepLayout
from hermes_lab.core.redaction import redact
from hermes_lab.core.state import Clock, FlywheelState, SimulatedClock, WallClock, parse_time, state_path
from hermes_lab.core.verdict import STOP_DATA, STOP_NO_SIGNAL, gate, write_verdict
from hermes_lab.logs.gateway import describe_gateway, expand_inputs
from hermes_lab.logs.record import FORMATS
from hermes_lab.prep.ingest import LINE_BITS, SINKS, Ingest, estimated_size
from hermes_lab.prep.ingest import split_of as _split_of  # noqa: F401  (part of prep's interface)
from hermes_lab.prep.inputs import PrepError, expand_folders, resolve_inputs
from hermes_lab.prep.outcomes import paying_for, plot_conversations
from hermes_lab.prep.resources import arrow_pool
from hermes_lab.prep.signal import describe_signal, learning_signal

EXIT_BAD_INPUT, EXIT_REFUSED = 2, 3


class GateRefused(Exception):
    """A data gate (min_samples, cooldown, learning_signal) said no. ``result`` holds the full, written PrepResult."""

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


def expand_by_weight(dataset: Any) -> Any:
    """The GRPO prompt set with every row repeated ``weight`` times: hard negatives and mixed-outcome prompts
    count more; weight 0 (left out by data.select, listed in left_out.jsonl) leaves the row out."""
    idx = [i for i, w in enumerate(dataset["weight"]) for _ in range(max(0, int(w)))]
    return dataset.select(idx)


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


def _plots(
    out: Path, fam_names: list[str], fam_ids: Any, rewards: Any, by_reason: Counter, scale: float
) -> dict[str, Path]:
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    counts = np.bincount(fam_ids, minlength=len(fam_names)) if len(fam_ids) else np.zeros(0, np.int64)
    top = sorted(range(len(counts)), key=lambda i: -counts[i])[:8]  # ties: first seen first, like most_common
    for fid in top:
        ax.hist(
            rewards[fam_ids == fid],
            bins=np.linspace(0, scale, 21),
            histtype="step",
            linewidth=1.5,
            label=f"{plot_label(fam_names[fid])} (n={counts[fid]})",  # "$x^2$", "_x": no mathtext, no hidden entry
        )
    ax.set(xlabel="logged reward", ylabel="records", title="Reward distribution per family (8 largest)")
    if top:
        ax.legend(fontsize=8)
    paths = {"plot_rewards": tracking.log_figure(fig, PrepLayout(out).plot_rewards)}
    fig = Figure(figsize=(7, 3))
    ax = fig.subplots()
    if by_reason:
        reasons, n = zip(*by_reason.most_common())
        ax.barh([plot_label(r) for r in reasons][::-1], list(n)[::-1], color="tab:red")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="lines", title="Rejected lines by reason")
    else:
        ax.text(0.5, 0.5, "no rejected lines", ha="center", va="center")
        ax.set_axis_off()
    paths["plot_rejects"] = tracking.log_figure(fig, PrepLayout(out).plot_rejects)
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
    tracking.log_metrics("prep", summary.get("selection") or {})
    tracking.log_metrics("prep", conversation_metrics(summary.get("conversations") or {}))
    tracking.set_tags(
        {
            "prep.status": summary["status"],
            "prep.gates_passed": str(summary["gates_passed"]).lower(),
            "cooldown_override": str(bool(ov["cooldown"])).lower(),
        }
    )
    for name in ("summary", "review_queue", "selection"):
        if name in paths:
            tracking.log_artifact(paths[name], "prep")


def conversation_metrics(conv: dict[str, Any]) -> dict[str, Any]:
    """prep/conv_* metrics: turns, tool calls and errors per conversation, conversations by reward source."""
    if not conv.get("conversations"):
        return {}
    out: dict[str, Any] = {"conv_count": conv["conversations"], "conv_with_tool_errors": conv["with_tool_errors"]}
    for k in ("turns", "tool_calls", "tool_errors"):
        out[f"conv_{k}_mean"], out[f"conv_{k}_total"] = conv[k]["mean"], conv[k]["total"]
    for name, v in conv["reward_sources"].items():
        out[f"conv_reward_source_{safe_name(name)}"] = v["conversations"]
        out[f"conv_reward_mean_{safe_name(name)}"] = v["mean_reward"]
    return out


def _write_summary(summary: dict[str, Any], paths: dict[str, Path]) -> None:
    summary["paths"] = {k: str(v) for k, v in paths.items()}
    write_json_atomic(paths["summary"], summary)  # the round runner reads it back


def _partitions(files: list[Path], budget: int) -> int:
    """How many prompt partitions: a partition's share of the input within a twelfth of the budget (distill holds
    one partition at a time: its text memory-mapped, the columns and prompt rows built from it; 4 partitions for
    bench_prep's 1,000,000 seed records, 169 MB, at the default 512 MiB)."""
    est = sum(estimated_size(p) for p in files)
    return max(1, math.ceil(12 * est / budget))


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
    fmt: str | None = None,
    feedback: list[str | Path] | None = None,
) -> PrepResult:
    """Ingest, validate, distill and gate. Raises PrepError (bad input) or GateRefused, after writing summary.json.
    ``fmt``: the inputs' shape (default ``conversations.format``, auto: detected per input); ``feedback``:
    feedback files joined into conversations by id, besides ``conversations.feedback``."""
    t0 = time.perf_counter()
    if override_cooldown and not override_reason.strip():
        raise PrepError("--override-cooldown needs a --reason (it is recorded in MLflow and summary.json)")
    if not inputs:
        raise PrepError("no input file given")
    if clock is None:
        clock = state.clock(True) if state is not None and cfg.round.simulated_clock else WallClock()
    out = Path(output_dir)
    # a folder -> what it holds; a gateway log dir -> its requests joined with their feedback
    # (hermes_lab.live.log), then the plain files
    inputs, gateway = expand_inputs(expand_folders(list(inputs), out, cfg.data.max_line_bytes), out, cfg)
    in_files, neg_files = resolve_inputs(inputs, negatives, state, out)  # before anything is opened or created
    out.mkdir(parents=True, exist_ok=True)
    lay = PrepLayout(out)
    paths = {n: lay.sink(n) for n in (*SINKS, "outliers", "review_queue")} | {"summary": lay.summary}
    fmt = fmt or cfg.conversations.format
    fb_files = [Path(f) for f in [*cfg.conversations.feedback, *(feedback or [])]]
    for f in fb_files:
        if not f.is_file():
            raise PrepError(f"feedback file not found: {f}")
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=out))  # sinks in progress and spills; removed whatever happens
    import pyarrow as pa

    pool = pa.default_memory_pool()
    pa.set_memory_pool(arrow_pool())  # freed buffers go back to the system (peak RSS)
    try:
        ing = Ingest(
            tmp,
            float(cfg.reward.scale),
            cfg.data.max_line_bytes,
            cfg.data.memory_budget_mb << 20,
            _partitions([*in_files, *(p for p, _, _ in neg_files)], cfg.data.memory_budget_mb << 20),
            cfg,
            fb_files,
        )
        try:
            files = [ing.scan(p, "input", None, fmt) for p in in_files]
            files += [ing.scan(p, "negative", r, fmt) for p, r, _ in neg_files]
            feedback_info = ing.finish()  # the judge's queue, once every reference is known
        finally:
            ing.close()
        ing.commit(paths)
        t_ingest = time.perf_counter()
        summary = _base_summary(files, clock, out, in_files, neg_files, override_cooldown, override_reason)
        summary["gateway"] = gateway
        if gateway:  # the gateway's own failures: left out of the data, counted apart (hermes_lab.logs.gateway)
            summary["gateway_failures"] = {
                "requests": sum(g["errors"] for g in gateway.values()),
                "conversations": sum(g.get("gateway_failed", 0) for g in gateway.values()),
                "files": [g["gateway_failures_file"] for g in gateway.values()],
            }
        conv = ing.conversation_stats()
        arrays = conv.pop("arrays")
        summary["conversations"] = conv | {"feedback": feedback_info}
        summary["counts"]["conversations"] = conv["conversations"]
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
        _distill(ing, cfg, summary, paths, out, tmp, make_plots, arrays)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        pa.set_memory_pool(pool)
    t_distill = time.perf_counter()
    counts = summary["counts"]
    summary["gates"] = evaluate_gates(
        counts["new_samples"], cfg, state, clock.now(), override_cooldown, override_reason
    )
    data_ok = all(g["passed"] for g in summary["gates"])
    conv_dir = paths.get("conversations") if summary["conversations"]["conversations"] else None
    sig = summary["learning_signal"] = learning_signal(conv_dir, cfg)
    summary["gates"].append({"name": sig["gate"], "passed": sig["gate_passed"], "detail": sig["detail"]})
    summary["gates_passed"] = all(g["passed"] for g in summary["gates"])
    summary["status"] = "ok" if summary["gates_passed"] else "gates_refused" if not data_ok else sig["verdict"]
    summary["memory"] = {"budget_mb": cfg.data.memory_budget_mb, "partitions": len(ing.part_paths)}
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
        stop=None if summary["gates_passed"] else STOP_DATA if not data_ok else STOP_NO_SIGNAL,
        learning_signal={k: v for k, v in sig.items() if k != "by_source"} | {"by_source": sig.get("by_source")},
    )
    result = PrepResult(summary, out, paths)
    if not result.gates_passed:
        why = "; ".join(g["detail"] for g in summary["gates"] if not g["passed"])
        raise GateRefused(f"data gates refused training: {why}. Verdicts in {paths['summary']}", result)
    return result


def _base_summary(
    files: list[dict[str, Any]],
    clock: Clock,
    out: Path,
    in_files: list[Path],
    neg_files: list[tuple[Path, int | None, str]],
    override_cooldown: bool,
    override_reason: str,
) -> dict[str, Any]:
    """summary.json as far as the ingest can fill it: counts per file and in total, rejects by reason."""
    counts = {k: sum(f[k] for f in files) for k in ("lines", "blank", "read", "accepted", "rejected", "duplicates")}
    counts["new_samples"] = sum(f["accepted"] for f in files if f["role"] == "input")
    counts["negative_records"] = sum(f["accepted"] for f in files if f["role"] == "negative")
    by_reason: Counter = sum((f["by_reason"] for f in files), Counter())
    return {
        "stage": "prep",
        "status": "ok",
        "now": clock.now().isoformat(),
        "output_dir": str(out),
        "inputs": [str(p) for p in in_files],
        "negatives": [str(p) for p, _, _ in neg_files],
        "identity": "lines = blank + read; read = accepted + rejected + duplicates (per file and in total)",
        "counts": counts,
        "by_reason": dict(by_reason.most_common()),
        "per_file": [dict(f, by_reason=dict(f["by_reason"])) for f in files],
        "override": {"cooldown": bool(override_cooldown), "reason": override_reason if override_cooldown else ""},
        "gates": [],
        "gates_passed": False,
    }


def _distill(
    ing: Ingest,
    cfg: HermesConfig,
    summary: dict[str, Any],
    paths: dict[str, Path],
    out: Path,
    tmp: Path,
    plots: bool,
    conv_arrays: dict[str, Any],
) -> None:
    """Outliers, review sample, prompt tables and plots from the ingested records; fills ``summary`` and ``paths``."""
    import numpy as np

    from hermes_lab.prep import selection as ps
    from hermes_lab.prep.distill import Distill, SortedSpill, outlier_flags, outlier_stats
    from hermes_lab.prep.review_sample import review_selection

    cols, fam_names = ing.columns(), ing.family_names()
    rewards = cols["reward"]
    summary["outliers"] = outlier_stats(rewards, cfg.data.outlier_z)
    is_out = outlier_flags(rewards, summary["outliers"])
    picked, summary["review"] = review_selection(cols, fam_names, cfg)
    spill_budget = (cfg.data.memory_budget_mb << 20) // 8  # one bucket's lines, sorted in memory: ~3x its bytes
    line_bytes = ing.text_bytes / max(1, ing.n) + 200
    review = SortedSpill(tmp, "review", 1 << (64 + LINE_BITS), int(picked.sum() * line_bytes), spill_budget)
    outliers = SortedSpill(tmp, "outliers", ing.n, int(is_out.sum()) * 200, spill_budget)
    distill = Distill(ing, cols, cfg, is_out, picked, summary["outliers"])
    distill.run(review, outliers)
    for spill, name in ((outliers, "outliers"), (review, "review_queue")):
        spill.write_sorted(tmp / f"{name}.jsonl")
        os.replace(tmp / f"{name}.jsonl", paths[name])
    summary["outliers"].update(
        count=int(is_out.sum()), action="flagged and kept; rewards outside 0..scale were rejected at ingest"
    )
    paths.update(distill.save(out))
    summary["split"] = distill.split_summary()
    rep = ps.selection_report(distill.sel, cfg, summary["split"]["heldout_prompts"])
    rep["left_out_file"] = str(paths["left_out"])
    paths["selection"] = write_json_atomic(PrepLayout(out).selection, rep)
    summary["selection"] = ps.selection_metrics(rep)
    if plots:
        paths["plot_selection"] = ps.plot_selection(rep, PrepLayout(out).plot_selection)
    fam_counts = np.bincount(cols["family"], minlength=len(fam_names)).tolist()
    summary["families"] = dict(Counter(dict(zip(fam_names, fam_counts))).most_common())
    summary["conversations"]["split"] = distill.conv_split
    if plots:
        by_reason = Counter(summary["by_reason"])
        paths.update(_plots(out, fam_names, cols["family"], rewards, by_reason, float(cfg.reward.scale)))
        if summary["conversations"]["conversations"]:
            paths["plot_conversations"] = plot_conversations(
                conv_arrays, ing.reward_sources, rewards, float(cfg.reward.scale), PrepLayout(out).plot_conversations
            )


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    PREP.add_arguments(parser, format={"choices": ("auto", *FORMATS)})  # declared in hermes_lab.core.inputs


def run_cli(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.params, overrides=set_overrides(args.set))
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
            fmt=args.format,
            feedback=args.feedback,
        )
    except GateRefused as e:
        for info in (e.result.summary.get("gateway") or {}).values():
            print(describe_gateway(info))
        if "outcome" in ((e.result.summary.get("conversations") or {}).get("reward_sources") or {}):
            print(f"prep: {paying_for(cfg)}")
        print(describe_signal(e.result.summary["learning_signal"]))
        print(f"hermes-lab prep: refused: {redact(str(e))}", file=sys.stderr)
        return EXIT_REFUSED
    except (PrepError, ConfigError) as e:  # details quote the data: a key that sits in it is masked
        print(f"hermes-lab prep: error: {redact(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    k = res.summary["counts"]
    if "outcome" in res.summary["conversations"]["reward_sources"]:  # first: what the outcome rules pay
        print(f"prep: {paying_for(cfg)}")
    print(
        f"prep: {k['accepted']} accepted, {k['rejected']} rejected, {k['duplicates']} duplicates, "
        f"{k['blank']} blank; {res.summary['split']['grpo_prompts']} GRPO prompts, "
        f"{res.summary['split']['heldout_prompts']} held out; gates passed -> {res.output_dir}"
    )
    for info in (res.summary.get("gateway") or {}).values():
        print(describe_gateway(info))
    if res.summary["conversations"]["conversations"]:
        print(describe_conversations(res.summary["conversations"], res.paths["conversations"]))
        print(describe_signal(res.summary["learning_signal"]))
    sel = res.summary["selection"]
    print(
        f"prep: selection ({cfg.data.select}): {sel['select_mixed']} mixed, {sel['select_all_fail']} all-fail, "
        f"{sel['select_all_pass']} all-pass, {sel['select_single']} one-sample prompts; {sel['select_left_out']} "
        f"left out; training weight {sel['select_share_mixed']:.0%} mixed -> {res.paths['selection']}"
    )
    if k["rejected"]:
        print(f"prep: rejected lines are in {res.paths['rejects']}: {res.summary['by_reason']}", file=sys.stderr)
    return 0


def describe_conversations(conv: dict[str, Any], path: Path) -> str:
    """One line: the conversations, their turns, tool calls and errors, and which source set their rewards."""
    src = ", ".join(f"{k} {v['conversations']}" for k, v in conv["reward_sources"].items() if v["conversations"])
    sp = conv.get("split", {})
    extra = ""
    if conv.get("atropos"):
        a = conv["atropos"]
        extra += f"; Atropos: {a['groups']} groups, {a['no_signal']} with every score equal (no signal)"
    if conv.get("tools_from", {}).get("none"):  # state.db / exports without a snapshot or a <tools> block
        extra += f"; {conv['tools_from']['none']} without tool schemas (no session snapshot beside the store)"
    return (
        f"prep: {conv['conversations']} conversations ({sp.get('train', 0)} train, {sp.get('heldout', 0)} held out): "
        f"{conv['turns']['mean']} assistant turns, {conv['tool_calls']['mean']} tool calls, "
        f"{conv['tool_errors']['total']} tool errors in all; rewards from {src}{extra} -> {path}"
    )


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.prep", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
