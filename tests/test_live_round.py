"""A round on live traffic: its data from a gateway log (execute.source: live), its A/B stage decided live by the
gateway (ab.mode: live): the round waits ("awaiting live A/B"), `hermes-lab status` says where the rollout is,
the gateway serves the round's experiment, `hermes-lab round --resume` takes its decision.

Real components throughout: a uvicorn gateway subprocess, real upstreams (tests/openai_stub.py) for the traffic
the round trains on, the tiny policy and the round's own adapter as the live arms, papermill, TRL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from openai_stub import OpenAIStub  # noqa: E402
from test_live_rollout import Traffic, wait_for  # noqa: E402
from test_round import HERMES, REPO, small_params  # noqa: E402
from test_serve import Gateway  # noqa: E402

from hermes_lab.config.schema import load_config  # noqa: E402
from hermes_lab.core.state import FlywheelState, state_path  # noqa: E402
from hermes_lab.data import gateway  # noqa: E402


def traffic_log(tmp: Path, n: int = 300) -> Path:
    """A gateway log of ``n`` requests with feedback: a bad and a perfect upstream, half and half."""
    good, bad = OpenAIStub(models=("good",)).start(), OpenAIStub(models=("bad",))
    bad.reply = "no idea"
    bad.start()
    args = ["--ratio", "0.5", "--set", "serve.rollout=false", "--baseline", bad.url, "--baseline-model", "bad"]
    args += ["--candidate", good.url, "--candidate-model", "good"]
    (tmp / "traffic").mkdir()
    gw = Gateway(tmp / "traffic", args).start()
    traffic = Traffic(gw.url, threads=4, prefix="live")
    try:
        wait_for(gw, lambda e: sum(e["feedback"].values()) >= n, timeout=300)
    finally:
        traffic.stop()
        gw.stop()
        good.stop()
        bad.stop()
    return gw.log_dir


@pytest.mark.slow
def test_a_round_trains_on_a_live_log_and_waits_for_its_live_ab(tmp_path):
    log = traffic_log(tmp_path)
    live_ids = {json.loads(x)["request_id"] for x in (log / "requests.jsonl").read_text().splitlines()}
    params = small_params(
        tmp_path,
        execute={"source": "live", "live_dir": str(log)},
        ab={"mode": "live", "stages": [[0.5, 120], [1.0, 0]], "look_every": 40, "min_per_arm": 10},
        serve={"time_scale": 20.0},
    )
    runs = tmp_path / "runs"
    rd = runs / "round-01"
    p = subprocess.run(
        [*HERMES, "round", "--params", str(params)], cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # the round's data is the live log, joined with its feedback: every trajectory is one of its requests
    traj = [json.loads(x) for x in (rd / "trajectories.jsonl").read_text().splitlines()]
    assert len(traj) >= 300 and {t["request_id"] for t in traj} <= live_ids
    assert all(t["gateway_log"].startswith(str(log)) for t in traj)
    prep = json.loads((rd / "prep" / "summary.json").read_text())
    assert prep["counts"]["new_samples"] >= 200  # small_params' data.min_samples
    assert (rd / "train" / "adapter" / "adapter_config.json").is_file(), p.stdout[-3000:]  # trained on it
    # the A/B stage prepared the round's experiment and the round waits for it
    assert "awaiting live A/B" in p.stdout
    state = FlywheelState.load(state_path(runs))
    assert state.last_round == 0 and state.progress["status"] == "awaiting live A/B"
    exp_dir = runs / "live" / "round-01"
    exp = json.loads((exp_dir / "experiment.json").read_text())
    assert exp["arms"]["baseline"]["base"] == "embedded:tiny" and exp["status"] == "running"
    assert exp["arm_specs"]["candidate"]["spec"] == str(rd / "train")
    s = subprocess.run([*HERMES, "status", "--params", str(params)], cwd=REPO, capture_output=True, text=True)
    assert "round 1 is awaiting its live A/B" in s.stdout and "not served yet" in s.stdout, s.stdout
    # the gateway serves it (its arms from the experiment), traffic until the rollout is decided
    (tmp_path / "gw").mkdir()
    gw = Gateway(tmp_path / "gw", ["--params", str(params), "--set", f"round.runs_dir={runs}"])
    gw.log_dir = exp_dir
    gw.start(timeout=300)
    traffic = Traffic(gw.url, threads=3, prefix="round")
    try:
        wait_for(gw, lambda e: e["looks"] >= 1, timeout=120)
        s = subprocess.run([*HERMES, "status", "--params", str(params)], cwd=REPO, capture_output=True, text=True)
        assert "ab: live stage 1 (50%)" in s.stdout or "ab: live rollout" in s.stdout, s.stdout
        final = wait_for(gw, lambda e: e["report"] is not None, timeout=300)
    finally:
        traffic.stop()
        gw.stop()
    assert "candidate" in gw.output() and "[look" in gw.output()
    p = subprocess.run(
        [*HERMES, "round", "--params", str(params), "--resume"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((rd / "summary.json").read_text())
    report = json.loads((rd / "ab" / "ab_report.json").read_text())
    assert report["mode"] == "live" and report["decision"] == final["rollout_decision"]["decision"]
    assert summary["decision"] == report["decision"] and summary["ab"]["delta"] == report["delta"]
    state = FlywheelState.load(state_path(runs))
    assert state.last_round == 1 and state.progress is None
    # the champion moves only when the live rollout reached 100%
    assert (state.champion_adapter == str(rd / "train" / "adapter")) == (report["promoted"] is True)
    assert (rd / "ab" / "live_trajectories.jsonl").stat().st_size > 0  # the traffic: the next round's fuel
    cfg = load_config(params)
    assert gateway.source_dir(cfg, runs / "round-02") == log  # execute.live_dir set: the same log again
