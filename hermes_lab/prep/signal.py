"""The learning-signal gate (stage: prep): can the conversations' rewards teach GRPO anything, can an A/B on them
measure anything?

Reads prep's ``conversations/`` dataset (its task_id, reward, reward_source and outcome columns, memory-mapped);
writes nothing (prep puts the result in ``summary.json`` as ``learning_signal`` and its gate in ``verdict.json``;
the reward audit names it again, ``hermes_lab.rewards.audit``).

A conversation carries a learning signal when its reward comes from a source that checks the task (``log``: a
reward the log carried; ``feedback:*``: a verifier's or a person's, joined by conversation id; ``judge``;
``atropos``) and differs from another such reward of its task: GRPO's advantage is the reward less its group's
mean, so a group paid the same everywhere teaches nothing, and an A/B on that score compares two constants.
Tasks with one rewarded conversation (most agent logs: every session its own prompt) are compared with each
other, as one group. The outcome rules (``reward_source: outcome``, ``hermes_lab.prep.outcomes``) check nothing:
they say how a run ended ("completed" is not success), so their rewards never count as signal, whatever they pay.

Below ``conversations.min_signal_share`` of the accepted conversations with a signal, the verdict is
``no_learning_signal`` and it names the source responsible: the outcome rules when no checking source rewarded
anything ("outcome: 6 of 6 conversations are rewarded only by how the run ended (6 'completed') ..."), else the
checking source that paid every conversation of its tasks the same ("log: 40 conversations, every task's paid
the same (5/5 x40)"). ``conversations.no_signal: block`` (the default) stops the round at prep ("stopped: no
learning signal", prep exits 3); ``warn`` says so and goes on. Seed records (prompt/response/reward lines) are not
conversations: their rewards are the executor's verifier's, not checked here.

    hermes-lab prep --input ~/.hermes/sessions --output runs/round-01/prep   # exit 3: no_learning_signal
    hermes-lab prep --input ~/.hermes/sessions --feedback verdicts.jsonl --output runs/round-01/prep
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

GATE = "learning_signal"
NO_SIGNAL = "no_learning_signal"
EPS = 1e-9


def _columns(path: Path | None) -> dict[str, Any]:
    """task codes, rewards, reward sources (full names) and completed flags of the conversations/ dataset."""
    import numpy as np
    import pyarrow.compute as pc

    if path is None or not Path(path).exists():
        return {"n": 0}
    from datasets import load_from_disk

    t = load_from_disk(str(path)).data.table
    if not t.num_rows:
        return {"n": 0}
    task = pc.dictionary_encode(pc.fill_null(t.column("task_id").combine_chunks(), ""))
    src = pc.dictionary_encode(pc.fill_null(t.column("reward_source").combine_chunks(), "unknown"))
    done = pc.fill_null(pc.struct_field(t.column("outcome").combine_chunks(), "completed"), False)
    return {
        "n": t.num_rows,
        "task": np.asarray(task.indices, dtype=np.int64),
        "reward": np.asarray(t.column("reward").to_numpy(zero_copy_only=False), dtype=np.float64),
        "source": np.asarray(src.indices, dtype=np.int64),
        "source_names": [str(x) for x in src.dictionary.to_pylist()],
        "completed": np.asarray(done.to_numpy(zero_copy_only=False), dtype=bool),
    }


def _signal_mask(task: Any, reward: Any) -> Any:
    """Per conversation (all of them checked): whether its group's rewards differ. A group: a task with two or
    more conversations; the tasks with one are one group together."""
    import numpy as np

    n = len(task)
    out = np.zeros(n, dtype=bool)
    if n < 2:
        return out
    _, inv, counts = np.unique(task, return_inverse=True, return_counts=True)
    single = counts[inv] == 1
    k = len(counts)
    lo, hi = np.full(k, np.inf), np.full(k, -np.inf)
    np.minimum.at(lo, inv, reward)
    np.maximum.at(hi, inv, reward)
    out[~single] = (hi - lo)[inv[~single]] > EPS
    if single.sum() >= 2:
        r = reward[single]
        out[single] = bool(r.max() - r.min() > EPS)
    return out


def _paid(values: Any, scale: float, top: int = 3) -> str:
    """'5/5 x5, 4.5/5 x1': the rewards paid, the most common first."""
    got = Counter(round(float(v), 4) for v in values).most_common()
    text = ", ".join(f"{v:g}/{scale:g} x{c}" for v, c in got[:top])
    return text + (f", {len(got) - top} other values" if len(got) > top else "")


def learning_signal(conversations: Path | None, cfg: Any) -> dict[str, Any]:
    """The gate's result: ``verdict`` (ok / no_learning_signal), ``passed`` (the signal is there),
    ``gate_passed`` (the round may go on: passed, or ``conversations.no_signal: warn``), the counts, the source
    named and a one-line ``detail``."""
    import numpy as np

    c = cfg.conversations
    scale, need, mode = float(cfg.reward.scale), float(c.min_signal_share), c.no_signal
    col = _columns(conversations)
    n = col["n"]
    base: dict[str, Any] = {"gate": GATE, "mode": mode, "min_signal_share": need, "conversations": n}
    if not n:
        detail = "no conversations (seed records carry their executor's rewards: not checked here)"
        return base | {"verdict": "ok", "passed": True, "gate_passed": True, "detail": detail, "source": None}
    names = col["source_names"]
    roots = np.asarray([s.split(":", 1)[0] != "outcome" for s in names], dtype=bool)
    checked = roots[col["source"]]
    mask = np.zeros(n, dtype=bool)
    mask[checked] = _signal_mask(col["task"][checked], col["reward"][checked])
    with_signal = int(mask.sum())
    share = with_signal / n
    by_source: dict[str, Any] = {}
    for i, name in enumerate(names):
        sel = col["source"] == i
        if sel.any():
            by_source[name] = {
                "conversations": int(sel.sum()),
                "with_signal": int(mask[sel].sum()),
                "paid": _paid(col["reward"][sel], scale),
                "completed": int(col["completed"][sel].sum()),
            }
    passed = share >= need if need > 0 else True
    res = base | {
        "verified": int(checked.sum()),
        "with_signal": with_signal,
        "signal_share": round(share, 4),
        "by_source": by_source,
        "passed": passed,
        "gate_passed": passed or mode == "warn",
        "verdict": "ok" if passed else NO_SIGNAL,
    }
    if passed:
        res["source"] = None
        res["detail"] = (
            f"{with_signal} of {n} conversations ({share:.0%}) carry a learning signal: rewards of a checking "
            f"source that differ within their task (need >= {need:.0%}, conversations.min_signal_share)"
        )
        return res
    # the source responsible: the one that pays the most conversations without a signal
    src = max(by_source, key=lambda k: (by_source[k]["conversations"] - by_source[k]["with_signal"], k))
    v = by_source[src]
    if src.split(":", 1)[0] == "outcome":
        why = (
            f"{src}: {v['conversations']} of {n} conversations are rewarded only by how the run ended "
            f"({v['completed']} 'completed'; paid {v['paid']}); no verifier, feedback, tests or judge scored "
            + ("any" if not checked.any() else f"them (it scored {int(checked.sum())})")
        )
    else:  # a checking source paid every conversation of its tasks the same
        why = (
            f"{src}: {v['conversations']} of {n} conversations, every task's paid the same ({v['paid']}; "
            f"{v['with_signal']} differ within their task)"
        )
    res["source"] = src
    res["detail"] = (
        f"{'' if mode == 'block' else 'WARN: '}{NO_SIGNAL}: {why}. {with_signal} of {n} carry a signal ({share:.0%} "
        f"< conversations.min_signal_share {need:.0%}): GRPO's group advantages are zero and an A/B on this score "
        "measures nothing. Add a verifier or feedback (conversations.feedback, prep --feedback) or "
        "conversations.reward: judge"
    )
    return res


def describe_signal(sig: dict[str, Any]) -> str:
    """prep's line about the gate."""
    mark = "PASS" if sig["passed"] else "WARN" if sig["gate_passed"] else "STOP"
    return f"prep: {sig['gate']}: {mark}: {sig['detail'].removeprefix('WARN: ')}"
