"""make live-demo's verdict on the champion (hermes_lab.round.live_demo.champion_series): each policy's live agent
success pools every agent conversation it answered, and the series follows the champion through the rounds; with the
real Hermes Agent (champion_played) the series is validate's held-out tasks the real agent played against each arm."""

from __future__ import annotations

import json
from pathlib import Path

from hermes_lab.core.layout import RunsLayout
from hermes_lab.round.live_demo import champion_played, champion_series, rising


def _collect(runs: Path, outcomes: list[float]) -> None:
    """collect-01's log as the gateway writes it: an agent conversation's first turn offers tools; its feedback."""
    lay = RunsLayout(runs).collect(1)
    lay.root.mkdir(parents=True)
    reqs = [{"conversation_id": f"c{i}", "turn": 0, "tools_hash": "t", "arm": "baseline"} for i in range(len(outcomes))]
    reqs.append({"conversation_id": "s0", "turn": 0, "tools_hash": None, "arm": "baseline"})  # a string task
    lay.requests.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    fb = [{"conversation_id": f"c{i}", "reward": r, "source": "system"} for i, r in enumerate(outcomes)]
    fb.append({"conversation_id": "s0", "reward": 5.0, "source": "system"})
    lay.feedback.write_text("".join(json.dumps(f) + "\n" for f in fb))


def _round(n: int, status: str, base: tuple[float, int], cand: tuple[float, int]) -> dict:
    arm = {"baseline": {"success": base[0], "n": base[1]}, "candidate": {"success": cand[0], "n": cand[1]}}
    return {"round": n, "status": status, "agent": {"live": arm}}


def test_each_champion_pools_every_conversation_it_answered(tmp_path: Path) -> None:
    _collect(tmp_path, [5.0, 0.0, 0.0, 5.0])  # the base: 2 of 4 agent conversations succeed; the string task is not one
    done = [
        _round(1, "promoted", (0.25, 4), (0.75, 8)),  # the base again (1 of 4), round 1's candidate (6 of 8)
        _round(2, "promoted", (0.5, 4), (0.9, 10)),  # round 1 as the baseline (2 of 4), round 2's candidate
    ]
    series = champion_series(tmp_path, done, threshold=2.5)
    assert [who for who, _, _ in series] == ["the base", "round 01", "round 02"]
    assert [n for _, _, n in series] == [8, 12, 10]
    assert [round(v, 4) for _, v, _ in series] == [0.375, round(8 / 12, 4), 0.9]


def test_a_round_not_promoted_keeps_the_champion(tmp_path: Path) -> None:
    _collect(tmp_path, [5.0, 0.0])
    done = [_round(1, "rolled back", (0.5, 2), (0.0, 6))]
    series = champion_series(tmp_path, done, threshold=2.5)
    # the base stays the champion: its figure pools collect-01 and its arm in round 1; the rejected candidate is absent
    assert [(who, n) for who, _, n in series] == [("the base", 4), ("the base", 4)]
    assert series[0][1] == series[1][1] == 0.5


def _played(n: int, status: str, before: float, after: float, live: bool = True) -> dict:
    p = {"runner": "hermes", "before": {"pass_rate": before, "tasks": 96}, "after": {"pass_rate": after, "tasks": 96}}
    return {"round": n, "status": status, "agent": {"live": {}, "played": p if live else None}}


def test_the_real_hermes_series_follows_the_champion_and_must_rise_every_round() -> None:
    done = [_played(1, "promoted", 0.573, 0.646), _played(2, "promoted", 0.646, 0.667)]
    series = champion_played(done)
    assert [(who, v) for who, v, _ in series] == [("the base", 0.573), ("round 01", 0.646), ("round 02", 0.667)]
    assert series[0][2] == 96 and rising(series, 2)
    # round 2 rolled back: the champion it kept is measured again, a flat step is not a rise
    kept = champion_played([done[0], _played(2, "rolled back", 0.646, 0.70)])
    assert [who for who, _, _ in kept] == ["the base", "round 01", "round 01"] and not rising(kept, 2)
    # a promoted round that lost on the held-out tasks is not a rise either; fewer figures than rounds neither
    assert not rising(champion_played([_played(1, "promoted", 0.6, 0.55)]), 1)
    assert not rising(series[:2], 2)
    # a round whose validate the built-in loop played: no real-Hermes series at all (the live one is checked)
    assert champion_played([done[0], _played(2, "promoted", 0.6, 0.7, live=False)]) == []
