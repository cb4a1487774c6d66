"""Rewards for conversations whose logs carry none (stage: prep, through ``hermes_lab.prep.ingest``).

Agent logs (Hermes trajectories, sessions, state.db, most OpenAI chat exports) store no reward. In this order,
the first that applies sets a conversation's reward and names itself in ``reward_source``:

  log          the line carried a reward (0..reward.scale) and, optionally, its reward_source
  feedback     later feedback joined by conversation_id: ``conversations.feedback`` JSONL files, or
               ``hermes-lab prep --feedback FILE`` ({conversation_id, reward, source?}; the latest line of an
               id wins): reward_source "feedback:<source>" (source defaults to "system")
  outcome      the outcome rules (``conversations.completed_reward`` / ``partial_reward`` / ``failed_reward`` /
               ``tool_error_penalty``, shares of reward.scale; ``outcome_reward``)
  judge        with ``conversations.reward: judge``: the comparison judge scores the final answer against the
               best other conversation of the same task (by its reward; outcome rewards for the unrewarded),
               reward.model through the API or the local judge offline; a task with no other conversation
               keeps its outcome reward (source "outcome")

"The run ended" is not success. The outcome rules check nothing: they say how a run ended (completed, partial,
failed, tool errors), so by default a completed run is paid half marks (``completed_reward`` 0.5: 2.5 of 5, below
``reward.success_threshold``), never a success and never above a verified one; a verifier, feedback, tests or the
judge pays the rest. ``paying_for`` is the line prep and the round print first about it. Rewards of the outcome
rules alone carry no learning signal (``hermes_lab.prep.signal``: prep's ``learning_signal`` gate stops a round
whose conversations nothing but them rewarded). For the local judge, a reference answer that only the outcome
rules scored and that completed is a reference of unknown worth (compared by similarity, as a passing one), not
a failure.

Reads the feedback files; writes ``judge-queue.jsonl`` into prep's temp dir (the conversations waiting for
the judge, so that memory stays bounded: only two references per task are held).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab.logs.record import final_answer, task_prompt_of

JUDGE_BATCH = 256


def outcome_reward(outcome: dict[str, Any], rules: Any, scale: float) -> float:
    """The reward the outcome rules give (``rules``: the config's conversations section), on 0..scale:
    completed -> completed_reward less tool_error_penalty per tool error, never below partial_reward;
    partial -> partial_reward less the penalty, never below failed_reward; failed -> failed_reward."""
    errs = int(outcome.get("tool_errors") or 0)
    pen = rules.tool_error_penalty * errs
    if outcome.get("completed"):
        share = max(rules.partial_reward, rules.completed_reward - pen)
    elif outcome.get("partial"):
        share = max(rules.failed_reward, rules.partial_reward - pen)
    else:
        share = rules.failed_reward
    return round(scale * share, 6)


def paying_for(cfg: Any) -> str:
    """One line: what a conversation with no reward of its own is paid, and whether that is a success."""
    c, r = cfg.conversations, cfg.reward
    scale = float(r.scale)
    done = scale * c.completed_reward
    verdict = (
        "PAID AS A SUCCESS though nothing verified it"
        if done >= r.success_threshold
        else f"below the success threshold {r.success_threshold:g}: the run ended, nothing verified it"
    )
    how = "the comparison judge, else the outcome rules" if c.reward == "judge" else "the outcome rules"
    return (
        f"rewards: a conversation without a reward of its own or feedback is paid by {how}: 'completed' "
        f"{done:g}/{scale:g} ({verdict}), partial {scale * c.partial_reward:g}, failed {scale * c.failed_reward:g}; "
        f"the learning_signal gate ({c.no_signal}) needs {c.min_signal_share:.0%} of conversations scored by a "
        "verifier, feedback, tests or the judge and differing within their task"
    )


def load_feedback(files: list[Path] | None, scale: float) -> tuple[dict[str, tuple[float, str]], dict[str, Any]]:
    """conversation_id -> (reward, source) from feedback JSONL files, and an account of every line read."""
    out: dict[str, tuple[float, str]] = {}
    info: dict[str, Any] = {"files": [str(f) for f in files or []], "lines": 0, "bad_lines": 0, "first_errors": []}
    for f in files or []:
        p = Path(f)
        if not p.is_file():
            raise FileNotFoundError(f"feedback file not found: {p}")
        with open(p, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                info["lines"] += 1
                why = None
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    rec, why = None, "not JSON"
                if why is None and not isinstance(rec, dict):
                    why = "not an object"
                elif why is None and not (isinstance(rec.get("conversation_id"), str) and rec["conversation_id"]):
                    why = "no conversation_id"
                elif why is None:
                    r = rec.get("reward")
                    if type(r) not in (int, float) or not 0 <= r <= scale:
                        why = f"reward {str(r)[:20]} is not a number in 0..{scale:g}"
                if why is not None:
                    info["bad_lines"] += 1
                    if len(info["first_errors"]) < 5:
                        info["first_errors"].append(f"{p}:{lineno}: {why}")
                    continue
                src = rec.get("source") if isinstance(rec.get("source"), str) and rec.get("source") else "system"
                out[rec["conversation_id"]] = (float(rec["reward"]), src)
    info["conversations"] = len(out)
    return out, info


def assign_reward(rec: dict[str, Any], feedback: dict[str, tuple[float, str]], rules: Any, scale: float) -> bool:
    """Set the record's reward and reward_source (log, feedback, outcome); False: the judge is to decide
    (the outcome rules' reward waits in ``meta.outcome_reward``)."""
    if rec["reward"] is not None:
        rec["reward_source"] = rec["reward_source"] or "log"
        return True
    fb = feedback.get(rec["conversation_id"])
    if fb is not None:
        rec["reward"], rec["reward_source"] = fb[0], f"feedback:{fb[1]}"
        return True
    r = outcome_reward(rec["outcome"], rules, scale)
    if rules.reward == "judge":
        rec["meta"]["outcome_reward"] = r
        return False
    rec["reward"], rec["reward_source"] = r, "outcome"
    return True


def transcript(rec: dict[str, Any], limit: int = 6000) -> str:
    """The conversation up to its final answer as plain text, for an API judge's prompt (the tail kept)."""
    lines = []
    for m in rec["messages"][:-1]:
        if m["role"] == "tool":
            lines.append(f"[tool {m.get('name')}] {m['content']}")
        else:
            calls = " ".join(
                f"<call {c['function']['name']} {c['function']['arguments']}>" for c in m.get("tool_calls", [])
            )
            lines.append(f"{m['role']}: {m['content'] or ''} {calls}".rstrip())
    text = "\n".join(lines)
    return text if len(text) <= limit else "..." + text[-limit:]


class JudgeQueue:
    """Conversations waiting for the comparison judge (spilled to ``judge-queue.jsonl``) and, per task, the
    two best-rewarded final answers seen (so a conversation is never its own reference)."""

    def __init__(self, tmp: Path, cfg: Any):
        self.cfg, self.path, self.n = cfg, tmp / "judge-queue.jsonl", 0
        self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by drain
        # task_id -> [(reward, conversation_id, answer, the reward the local judge is told)] x2
        self.refs: dict[str, list[tuple[float, str, str, float | None]]] = {}
        self.counts: Counter = Counter()

    def offer(self, rec: dict[str, Any], reward: float) -> None:
        best = self.refs.setdefault(rec["task_id"], [])
        unverified = rec.get("reward_source") in (None, "outcome") and (rec.get("outcome") or {}).get("completed")
        best.append((reward, rec["conversation_id"], final_answer(rec["messages"]), None if unverified else reward))
        best.sort(key=lambda b: -b[0])
        del best[2:]

    def defer(self, fidx: int, role: str, lineno: int | None, rec: dict[str, Any], raw: str) -> None:
        self.offer(rec, rec["meta"]["outcome_reward"])
        self.file.write(json.dumps({"fidx": fidx, "role": role, "line": lineno, "raw": raw[:4096], "rec": rec}) + "\n")
        self.n += 1

    def drain(self) -> Iterator[list[tuple[int, str, int | None, dict[str, Any], str]]]:
        """Batches of (file index, role, line, record with its reward set, raw), in the order they were deferred."""
        self.file.close()
        batch: list[tuple[int, str, int | None, dict[str, Any], str]] = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                q = json.loads(line)
                batch.append((q["fidx"], q["role"], q["line"], q["rec"], q["raw"]))
                if len(batch) >= JUDGE_BATCH:
                    yield self._score(batch)
                    batch = []
        if batch:
            yield self._score(batch)
        self.path.unlink()

    def _score(self, batch: list[tuple[int, str, int | None, dict[str, Any], str]]) -> list[Any]:
        from hermes_lab.rewards.registry import local_judge

        r = self.cfg.reward
        scale, thr = float(r.scale), float(r.success_threshold)
        todo = []
        for item in batch:
            rec = item[3]
            ref = next((b for b in self.refs.get(rec["task_id"], []) if b[1] != rec["conversation_id"]), None)
            if ref is None:  # no other conversation of the task: nothing to compare with
                rec["reward"], rec["reward_source"] = rec["meta"]["outcome_reward"], "outcome"
            else:
                todo.append((rec, ref))
        if todo and r.model and r.model.strip().lower() != "local":
            from hermes_lab.llm.judge import ApiJudge

            scores = ApiJudge.from_config(self.cfg).score(
                [task_prompt_of(rec["messages"]) + "\n\n" + transcript(rec) for rec, _ in todo],
                [final_answer(rec["messages"]) for rec, _ in todo],
                [ref[2] for _, ref in todo],
            )
        else:
            scores = [local_judge(final_answer(rec["messages"]), ref[2], ref[3], scale, thr) for rec, ref in todo]
        for (rec, _), s in zip(todo, scores):
            rec["reward"], rec["reward_source"] = float(s), "judge"
        return batch


def plot_conversations(arrays: dict[str, Any], sources: dict[str, int], rewards: Any, scale: float, path: Path) -> Path:
    """Three panels for the accepted conversations: assistant turns per conversation, tool calls and tool
    errors per conversation, and the reward distribution by the source that set it (PNG + MLflow)."""
    import numpy as np
    from matplotlib.figure import Figure

    from hermes_lab.core import tracking

    fig = Figure(figsize=(12, 3.6))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    turns = arrays["turns"]
    ax1.hist(turns, bins=np.arange(0, max(2, int(turns.max()) + 2)) - 0.5, color="tab:blue")
    ax1.set(xlabel="assistant turns", ylabel="conversations", title=f"Turns per conversation (n={len(turns)})")
    top = max(1, int(max(arrays["tool_calls"].max(), arrays["tool_errors"].max())))
    bins = np.arange(0, top + 2) - 0.5
    ax2.hist([arrays["tool_calls"], arrays["tool_errors"]], bins=bins, label=["tool calls", "tool errors"])
    ax2.set(xlabel="per conversation", ylabel="conversations", title="Tool calls and tool errors")
    ax2.legend(fontsize=8)
    for name, sid in sources.items():
        r = rewards[arrays["seq"][arrays["source"] == sid]]
        if len(r):
            ax3.hist(r, bins=np.linspace(0, scale, 21), histtype="step", linewidth=1.5, label=f"{name} (n={len(r)})")
    ax3.set(xlabel="reward", ylabel="conversations", title="Reward by source")
    ax3.legend(fontsize=8)
    fig.tight_layout()
    return tracking.log_figure(fig, path, laid_out=True)
