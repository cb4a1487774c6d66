"""The live experiment's state and decision: ``experiment.json`` of a gateway log dir, read by ``hermes_lab.ab``.

Stage: validate (live A/B). Reads and writes ``<log_dir>/experiment.json`` (atomically, through
``hermes_lab.live_log.save_experiment``); ``hermes-lab serve`` calls it at start and on every
``GET /v1/experiment``.

The state is one JSON object: what identifies the experiment (name, arms, public model, unit, salt), the
planned stages (``ab.stages``), the current ``stage`` and ``ratio``, ``stage_starts`` (seconds since
``start_unix``, one per stage entered), ``looks`` (every look's decision, for the live rollout), the
``decision``, the ``status`` and the number of ``restarts``. A restart with other arms or another unit
is refused: it would mix two experiments in one log. The decision is ``hermes_lab.ab.analyse_stage`` (the
code ``ab-run`` uses) on the current stage's requests that have a reward.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hermes_lab import ab
from hermes_lab import live_log as L
from hermes_lab.config import ConfigError, HermesConfig


def open_experiment(
    log_dir: str | os.PathLike[str], ident: dict[str, Any], stages: list[list[float]], ratio: float | None
) -> dict[str, Any]:
    """The experiment of ``log_dir``: created at the first start, continued (and checked) at a restart."""
    log_dir = Path(log_dir)
    st = L.load_experiment(log_dir)
    if st is None:
        now = time.time()
        st = {
            **ident,
            "created": L.now_iso(now),
            "start_unix": now,
            "status": "running",
            "stages": stages,
            "stage": 0,
            "ratio": stages[0][0],
            "stage_starts": [0.0],
            "looks": [],
            "decision": None,
            "restarts": 0,
        }
    else:
        for k, v in ident.items():
            if k != "experiment" and st.get(k) != v:
                raise ConfigError(
                    f"{log_dir / L.EXPERIMENT}: this log dir holds experiment {st.get('experiment')!r} with {k} "
                    f"{st.get(k)!r}; this start has {v!r}. Continue it with the same settings, or pass another "
                    "--log-dir / --experiment"
                )
        if ratio is not None and float(ratio) != float(st["ratio"]):
            raise ConfigError(
                f"--ratio {ratio}: the experiment in {log_dir} runs at ratio {st['ratio']} (stage and ratio "
                "live in experiment.json); omit --ratio to continue it"
            )
        st["restarts"] = int(st.get("restarts", 0)) + 1
    L.save_experiment(log_dir, st)
    return st


def warm_up() -> None:
    """Import what ``decide`` needs (scipy, statsmodels): seconds on a busy machine, better spent at start."""
    import scipy.stats  # noqa: F401
    import statsmodels.stats.proportion  # noqa: F401


def decide(cfg: HermesConfig, tally: L.Tally, state: dict[str, Any], stages: list[list[float]]) -> dict[str, Any]:
    """The current stage's decision by ``hermes_lab.ab`` on its requests with a reward, and the latest look."""
    a, st = cfg.ab, ab.Settings.from_config(cfg)
    stage, ratio = int(state["stage"]), float(state["ratio"])
    cols = tally.columns(stage)
    if a.unit != "user":
        cols.pop("unit")
    n_c = int(cols["arm"].sum())
    if not n_c or n_c == len(cols["arm"]):
        return {"decision": "keep observing", "look": None, "reasons": ["no scored requests in an arm yet"]}
    seconds = float(stages[stage][1])
    start = float(state["stage_starts"][stage])
    stg = ab.Stage(stage, ratio, start, seconds, a.max_extension, a.look_every, a.request_rate * seconds)
    until = max(time.time() - float(state["start_unix"]), float(cols["t"].max()))
    res = ab.analyse_stage(cols, stg, st, until=min(until, stg.hard_end))
    last = ((res.get("sequential") or {}).get("looks") or [{}])[-1]
    return {
        "decision": res[f"{st.rule}_decision"],
        "reasons": res.get("reasons") if st.rule == "sequential" else [res.get("user_rule_reason")],
        "look": {
            k: last.get(k) for k in ("t", "n_baseline", "n_candidate", "delta", "cs_lower", "cs_upper", "p_value")
        },
        "delta": res.get("delta"),
        "p_value": res.get("p_value"),
        "interval": [last.get("cs_lower"), last.get("cs_upper")],
    }
