"""The requests of an A/B, in and out: the traffic it serves (simulated arrivals on the simulated clock, or a
request log replayed) and the log it writes (``RequestLog``: the JSONL and the analysis columns beside it).

Stage: validate (A/B). Reads a replayed log (``--replay``: JSONL with ``prompt``; optional request_id, unit,
t seconds, timestamp ISO, task_id) and, for ``read_log``, a request log ab-run wrote; ``hermes_lab.ab.run``
routes the traffic through the user's router, serves it stage by stage and writes ``runs/round-NN/ab/
requests.jsonl`` through ``RequestLog``.

    hermes-lab ab-run --params params/embedded.yaml --baseline ... --candidate ... --replay old/requests.jsonl
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from hermes_lab.ab import adjust as ab_adjust
from hermes_lab.ab import covariates as ab_cov
from hermes_lab.config.schema import HermesConfig
from hermes_lab.core.jsonl import iter_objects
from hermes_lab.core.layout import REQUESTS
from hermes_lab.policy.episodes import family_of_environment
from hermes_lab.tasks import agent as A
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T

LOG_NAME = REQUESTS  # the request log, in a round's ab/ as in a live log dir (core.layout)
COLUMNS = ("t", "stage", "arm", "reward", "error", "latency_ms", "family", "unit")
FAM_INDEX = {f: i for i, f in enumerate((*T.FAMILIES, A.FAMILY, H.FAMILY))}
FAM_NAMES = [*FAM_INDEX, "other"]


def plays_agent(cfg: HermesConfig) -> bool:
    """Whether the A/B serves the embedded agent family as episodes: when the round trains it (grpo.environment
    is the embedded one and execute logs its episodes). A user's own environment has no simulated traffic."""
    return family_of_environment(cfg.grpo.environment) is not None and cfg.execute.agent_tasks > 0


class Traffic:
    """Requests in time order: (t, request_id, unit, prompt, task_id). Simulated or replayed. ``agent``: the
    requests that are agent-family episodes (index -> task): a conversation each, played whole by the arm."""

    def __init__(
        self,
        t: np.ndarray,
        ids: list[str],
        units: list[str],
        prompts: list[str],
        task_ids: list[str],
        agent: dict[int, Any] | None = None,
    ):
        t = np.round(t, 3)  # ms resolution, as logged: windows and the log's re-analysis see the same times
        self.t, self.ids, self.units, self.prompts, self.task_ids = t, ids, units, prompts, task_ids
        self.agent = agent or {}

    @classmethod
    def simulate(cls, cfg: HermesConfig, horizon: float, seed: int, start: float = 0.0, agent: bool = False) -> Traffic:
        """Poisson arrivals at ``ab.request_rate`` in (start, horizon] (start > 0: a continued experiment).
        ``agent``: a family's share of them (one in len(families) + 1) are agent-family episodes instead, drawn
        from their own random stream, so the other requests' times, tasks and units stay as without."""
        a = cfg.ab
        rng = np.random.default_rng([seed, 7])
        n_guess = int(a.request_rate * (horizon - start) * 1.2 + 50)
        t = start + np.cumsum(rng.exponential(1 / a.request_rate, n_guess))
        while t[-1] < horizon:  # rare: Poisson ran long
            t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1 / a.request_rate, n_guess))])
        t = t[t <= horizon]
        tasks = T.generate_tasks(len(t), split=a.task_split, seed=seed, families=cfg.execute.families or None)
        # shuffle so the families' round-robin order does not line up with look windows
        tasks = [tasks[i] for i in rng.permutation(len(tasks))]
        ids = [f"req-{seed}-{i:08d}" for i in range(len(t))]
        if a.unit == "user":  # a few heavy users, many light ones (Zipf-like), as real traffic has
            w = 1 / np.arange(1, a.num_users + 1) ** 0.8
            units = [f"user-{seed}-{k:06d}" for k in rng.choice(a.num_users, len(t), p=w / w.sum())]
        else:
            units = ids
        prompts, task_ids = [x.prompt for x in tasks], [x.task_id for x in tasks]
        episodes: dict[int, Any] = {}
        fam = family_of_environment(cfg.grpo.environment) or H
        if agent and len(t):
            share = 1 / (len(T.check_families(cfg.execute.families or None)) + 1)
            where = np.flatnonzero(np.random.default_rng([seed, 13]).random(len(t)) < share)
            for i, task in zip(where, fam.generate_tasks(len(where), split=a.task_split, seed=seed)):
                episodes[int(i)] = task
                prompts[i], task_ids[i] = task.question, task.task_id
        return cls(t, ids, units, prompts, task_ids, episodes)

    @classmethod
    def replay(cls, path: str | Path, rate: float, seed: int) -> Traffic:
        """A request log (JSONL with prompt; optional request_id, unit, t seconds, timestamp ISO, task_id)."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"replay log not found: {p}")
        rows = []
        for i, r in iter_objects(p):
            if not isinstance(r.get("prompt"), str):
                raise ValueError(f"{p}:{i}: each line needs a string 'prompt'")
            rows.append((i, r))
        if not rows:
            raise ValueError(f"{p}: no requests to replay")
        if all("t" in r for _, r in rows):
            t = np.array([float(r["t"]) for _, r in rows])
        elif all("timestamp" in r for _, r in rows):
            ts = [datetime.fromisoformat(str(r["timestamp"]).replace("Z", "+00:00")) for _, r in rows]
            t = np.array([(x - ts[0]).total_seconds() for x in ts])
        else:  # no times in the log: arrivals at the configured rate
            t = np.cumsum(np.random.default_rng([seed, 7]).exponential(1 / rate, len(rows)))
        order = np.argsort(t, kind="stable")
        t, rows = t[order] - t.min(), [rows[k] for k in order]  # the replay starts with the log's first request
        ids = [str(r.get("request_id", f"replay-{i}")) for i, r in rows]
        units = [str(r.get("unit", rid)) for (_, r), rid in zip(rows, ids)]
        tasks = [T.parse_prompt(r["prompt"]) for _, r in rows]
        task_ids = [str(r.get("task_id") or (x.task_id if x else "")) for (_, r), x in zip(rows, tasks)]
        return cls(t, ids, units, [r["prompt"] for _, r in rows], task_ids)


@dataclass
class RequestLog:
    """Where served requests go: the JSONL request log, and the analysis columns built alongside it."""

    file: Any
    unit: str = "request"
    cols: dict[str, list] = field(default_factory=lambda: {k: [] for k in COLUMNS})
    unit_codes: dict[str, int] = field(default_factory=dict)
    covariates: ab_cov.Encoder | None = None  # the adjustment's columns, one row per request (ab.covariates)
    cov_rows: list[tuple] = field(default_factory=list)

    def rows(self) -> int:
        return len(self.cols["t"])

    def keep(self, recs: list[dict[str, Any]]) -> None:
        """Rows a continued experiment keeps (its held stage's requests, as logged): analysed, not re-logged."""
        for rec in recs:
            if self.covariates:
                self.cov_rows.append(self.covariates.row(rec))
            fam = rec.get("family") or "other"
            for key, val in (
                ("t", float(rec["t"])),
                ("stage", int(rec["stage"])),
                ("arm", int(rec["arm"] == "candidate")),
                ("reward", float(rec["reward"])),
                ("error", rec.get("status") != "ok"),
                ("latency_ms", float(rec["latency_ms"])),
                ("family", FAM_INDEX.get(fam, len(FAM_INDEX))),
                ("unit", self.unit_codes.setdefault(str(rec.get("unit")), len(self.unit_codes))),
            ):
                self.cols[key].append(val)

    def columns(self, since: int = 0) -> dict[str, np.ndarray]:
        """Typed columns of the rows from ``since`` on (unit codes only for user-level randomisation;
        covariate columns only for request and conversation units (one reward row each), which the adjustment
        is for)."""
        part = {k: np.asarray(v[since:]) for k, v in self.cols.items()}
        if self.unit != "user":
            part["unit"] = None
            if self.covariates:
                arr = np.array(self.cov_rows[since:], np.float64).reshape(-1, len(ab_adjust.COLUMNS))
                part.update({k: arr[:, j] for j, k in enumerate(ab_adjust.COLUMNS)})
        return _cols(part)


def _cols(c: dict[str, Any]) -> dict[str, Any]:
    """Typed columns for hermes_lab.ab.stats (a list-built dict or one read back from a log)."""
    out = {
        "t": np.asarray(c["t"], np.float64),
        "stage": np.asarray(c["stage"], np.int64),
        "arm": np.asarray(c["arm"], np.int8),
        "reward": np.asarray(c["reward"], np.float64),
        "error": np.asarray(c["error"], bool),
        "latency_ms": np.asarray(c["latency_ms"], np.float64),
        "family": np.asarray(c["family"], np.int64),
    }
    if c.get("unit") is not None:
        out["unit"] = np.asarray(c["unit"], np.int64)
    for k in ab_adjust.COLUMNS:  # the adjustment's covariates (hermes_lab.ab.covariates), when there are any
        if c.get(k) is not None:
            out[k] = np.asarray(c[k], np.int64 if k in ("cell", "task") else np.float64)
    return out


def read_log(path: str | Path) -> tuple[dict[str, np.ndarray], list[str]]:
    """A request log written by run_ab, as analysis columns (and the family names)."""
    import pandas as pd

    df = pd.read_json(path, lines=True)
    fams = FAM_NAMES
    cols = _cols(
        {
            "t": df["t"],
            "stage": df["stage"],
            "arm": (df["arm"] == "candidate").astype(int),
            "reward": df["reward"],
            "error": df["status"] != "ok",
            "latency_ms": df["latency_ms"],
            "family": df["family"].map({f: i for i, f in enumerate(fams)}).fillna(len(fams) - 1),
            "unit": pd.factorize(df["unit"])[0],
        }
    )
    return cols, fams
