"""hermes_lab.ab.run: the staged rollout end to end (fake policies: fast; the real tiny policy: slow)."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hermes_lab.ab import analysis as ab_analysis
from hermes_lab.ab import report as ab_report
from hermes_lab.ab import run as ab_run
from hermes_lab.ab import stats as ab
from hermes_lab.config.schema import ConfigError, load_config
from hermes_lab.core.kernels import manager
from hermes_lab.tasks import suite as T

from conftest import mlflow_db
from repo_paths import REPO

FIELDS = {
    "request_id",
    "unit",
    "arm",
    "stage",
    "status",
    "latency_ms",
    "reward",
    "response",
    "prompt",
    "task_id",
    "family",
    "timestamp",
    "policy",
}


class FakePolicy:
    """Duck-typed policy: right answer with probability p, else a plausible wrong one (or nothing)."""

    def __init__(self, p: float, name: str, empty: float = 0.0):
        self.p, self.name, self.empty, self.calls = p, name, empty, []

    def generate(self, prompts, temperature=0.9, max_new_tokens=16, seed=0):
        self.calls.append(len(prompts))
        rng = random.Random(seed)
        out = []
        for pr in prompts:
            t = T.parse_prompt(pr)
            u = rng.random()
            out.append("" if u < self.empty else t.answer if u < self.empty + self.p else T.corrupt(t.answer, rng))
        return out


def _cfg(tmp_path, **ab_over):
    over = {"round.runs_dir": str(tmp_path / "runs"), **{f"ab.{k}": v for k, v in ab_over.items()}}
    return load_config(None, overrides=over)


def _log(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_better_candidate_is_promoted_through_all_stages(tmp_path):
    base, cand = FakePolicy(0.45, "base"), FakePolicy(0.7, "cand")
    rep = ab_run.run_ab(_cfg(tmp_path), base, cand, output=tmp_path / "ab_report.json", seed=1)
    assert rep["decision"] == "promote" and rep["promoted"] and rep["final_ratio"] == 1.0
    assert [s["ratio"] for s in rep["stages"]] == [0.1, 0.3]
    assert all(s["sequential_decision"] == "widen" for s in rep["stages"])  # each stage widened; the rollout promoted
    assert rep["delta"] > 0 and rep["significant"] and rep["decisions"]["user"] == "promote"
    on_disk = json.loads((tmp_path / "ab_report.json").read_text())
    assert on_disk["decision"] == "promote" and len(on_disk["plots"]) == 3
    verdict = json.loads((tmp_path / "verdict.json").read_text())  # what the round runner reads
    assert verdict["gates"][0]["gate"] == "ab_decision" and verdict["gates"][0]["passed"] is True
    assert verdict["candidate"]["promoted"] is True and verdict["stop"] is None
    assert all(Path(p).stat().st_size > 5000 for p in on_disk["plots"])
    rows = _log(tmp_path / "requests.jsonl")
    assert len(rows) == rep["n_requests"] and FIELDS <= set(rows[0])
    # responses were generated per look window and arm, in batches, never one request at a time
    assert max(base.calls) > 50 and len(base.calls) + len(cand.calls) < 60
    # the user's fields of each stage are compare() on that stage's logged rewards
    for s in rep["stages"]:
        b = [r["reward"] for r in rows if r["stage"] == s["index"] and r["arm"] == "baseline"]
        c = [r["reward"] for r in rows if r["stage"] == s["index"] and r["arm"] == "candidate"]
        ref = ab.compare(b, c)
        assert s["delta"] == pytest.approx(ref["delta"]) and s["p_value"] == pytest.approx(ref["p_value"], rel=1e-9)
    # the router decided each arm: re-route the logged units with the stage's ratio
    for r in rows[:300]:
        assert ab.ABRouter("b", "c", r["ratio"]).route(r["unit"])[0] == r["arm"]
    # the logs are trajectories: reward is the verifier's score of the response
    assert all(r["reward"] == T.verify(r["prompt"], r["response"]) for r in rows[:300])
    # the report's decision is reproducible from the log alone
    cols, fams = ab_run.read_log(tmp_path / "requests.jsonl")
    stages = ab.plan_stages(rep["stages_planned"], 0.25, 900, 1.0)
    starts = {s["index"]: s["start"] for s in rep["stages"]}
    stages = [
        ab.Stage(s.index, s.ratio, starts[s.index], s.seconds, 1.0, 900, s.planned_n)
        for s in stages
        if s.index in starts
    ]
    until = {s["index"]: s["sequential_look"]["t"] for s in rep["stages"]}
    again = ab_analysis.analyse_log(cols, stages, ab.Settings(), fams, until)
    assert [s["sequential_decision"] for s in again["stages"]] == [s["sequential_decision"] for s in rep["stages"]]


def test_duration_7200_runs_only_the_first_stage(tmp_path):
    rep = ab_run.run_ab(
        _cfg(tmp_path),
        FakePolicy(0.5, "b"),
        FakePolicy(0.5, "c"),
        duration=7200,
        output=tmp_path / "r.json",
        seed=3,
        plots=False,
    )
    assert [s["index"] for s in rep["stages"]] == [0]
    assert max(r["t"] for r in _log(tmp_path / "requests.jsonl")) <= 7200
    assert rep["decision"] in ("keep observing", "widen", "hold", "roll back")  # never "promote" below 100%
    assert not rep["promoted"]
    assert rep["simulated_seconds"] == 7200 and rep["stopped_by"] in (
        None,
        "duration",
        "keep observing",
        "roll back",
        "hold",
    )
    for k in ("delta", "p_value", "significant"):
        assert k in rep and k in rep["stages"][0]


def test_harmful_candidate_is_rolled_back_and_its_data_marked_negative(tmp_path):
    rep = ab_run.run_ab(
        _cfg(tmp_path), FakePolicy(0.6, "b"), FakePolicy(0.1, "c"), output=tmp_path / "r.json", seed=4, plots=False
    )
    assert rep["decision"] == "roll back" and rep["negative"] and rep["final_ratio"] == 0.0
    assert len(rep["stages"]) == 1  # roll back stops the rollout
    assert rep["stages"][0]["sequential_look"]["t"] < 7200  # harm is acted on at an interim look
    assert any("significant harm" in r for r in rep["reasons"])


def test_error_guardrail_rolls_back_a_candidate_that_scores_well(tmp_path):
    rep = ab_run.run_ab(
        _cfg(tmp_path),
        FakePolicy(0.3, "b"),
        FakePolicy(0.6, "c", empty=0.15),
        output=tmp_path / "r.json",
        seed=5,
        plots=False,
    )
    assert rep["decision"] == "roll back" and rep["guardrails"]["error_rate_failed"]
    assert any("guardrail" in r for r in rep["reasons"])
    assert {r["status"] for r in _log(tmp_path / "requests.jsonl")} == {"ok", "error"}


def test_user_rule_can_drive_the_rollout(tmp_path):
    rep = ab_run.run_ab(
        _cfg(tmp_path, rule="user"),
        FakePolicy(0.5, "b"),
        FakePolicy(0.5, "c"),
        output=tmp_path / "r.json",
        seed=6,
        plots=False,
    )
    assert rep["rule"] == "user" and rep["decision"] == rep["decisions"]["user"]
    assert rep["user_rule"]["per_stage"][0]["reason"]


def test_replay_a_request_log_with_salt_and_user_units(tmp_path):
    tasks = T.generate_tasks(400, split="any", seed=9)
    log = tmp_path / "input.jsonl"
    log.write_text(
        "\n".join(
            json.dumps({"request_id": f"r{i}", "unit": f"user-{i % 40}", "prompt": t.prompt, "t": 10.0 * i})
            for i, t in enumerate(tasks)
        )
    )
    cfg = _cfg(tmp_path, salt="exp-9", stages=[[0.5, 2000], [1.0, 0]], unit="user")
    rep = ab_run.run_ab(
        cfg, FakePolicy(0.5, "b"), FakePolicy(0.5, "c"), replay=log, output=tmp_path / "r.json", plots=False
    )
    rows = _log(tmp_path / "requests.jsonl")
    assert len(rows) == rep["n_requests"] <= 400 and rows[0]["request_id"] == "r0"
    arms = {}
    for r in rows:  # every request of a user in the user's arm, split by the salted bucket
        assert arms.setdefault(r["unit"], r["arm"]) == r["arm"]
        assert (ab.bucket(r["unit"], "exp-9") < 0.5) == (r["arm"] == "candidate")
    assert rep["config"]["salt"] == "exp-9"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "up abc="}\n{"no_prompt": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        ab_run.run_ab(cfg, FakePolicy(0.5, "b"), FakePolicy(0.5, "c"), replay=bad, output=tmp_path / "x.json")


def test_debug_log_has_request_id_arm_and_status(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="hermes_lab.ab")
    ab_run.run_ab(
        _cfg(tmp_path),
        FakePolicy(0.5, "b"),
        FakePolicy(0.5, "c"),
        duration=900,
        output=tmp_path / "r.json",
        plots=False,
    )
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "hermes_lab.ab"]
    assert len(lines) > 100 and all(x.startswith("request_id=req-0-") for x in lines)
    assert any("arm=candidate status=ok" in x for x in lines) and any("arm=baseline" in x for x in lines)


def test_bad_stages_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="ab.stages"):
        _cfg(tmp_path, stages=[[0.3, 100], [0.1, 100]])
    with pytest.raises(ConfigError, match="ab.unit"):
        _cfg(tmp_path, unit="session")
    with pytest.raises(ConfigError, match="--ratio"):  # a --ratio above the next stage breaks the monotone ramp
        ab_run.run_ab(_cfg(tmp_path), FakePolicy(0.5, "b"), FakePolicy(0.5, "c"), ratio=0.5, output=tmp_path / "r.json")


def test_traffic_ratio_is_an_alias_of_the_first_stage(tmp_path):
    assert _cfg(tmp_path, traffic_ratio=0.2).ab.stages[0] == [0.2, 7200]  # set alone: it moves the first stage
    cfg = _cfg(tmp_path, stages=[[0.05, 600], [1.0, 0]])
    assert cfg.ab.traffic_ratio == 0.05  # stages set alone: the alias follows
    assert _cfg(tmp_path, traffic_ratio=0.05, stages=[[0.05, 600], [1.0, 0]]).ab.stages[0][0] == 0.05
    with pytest.raises(ConfigError, match="disagree"):
        _cfg(tmp_path, traffic_ratio=0.2, stages=[[0.05, 600], [1.0, 0]])


def test_cli_and_mlflow(tmp_path, monkeypatch, capsys):
    """The CLI path (policies patched to fakes) logs params, metrics, report and plots to a real MLflow store."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db(tmp_path / "mlflow.db"))
    fakes = {"B": FakePolicy(0.45, "B"), "C": FakePolicy(0.75, "C")}
    monkeypatch.setattr(ab_run, "load_arm", lambda spec, cfg, cache: fakes[spec])
    monkeypatch.chdir(tmp_path)
    for name in fakes:  # model dirs, as the command checks its arms before MLflow's run; the fakes answer
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    params = tmp_path / "p.yaml"
    params.write_text(f"round:\n  runs_dir: {tmp_path / 'runs'}\nab:\n  request_rate: 0.5\n")
    out = tmp_path / "ab" / "ab_report.json"
    rc = ab_run.main(
        [
            "--params",
            str(params),
            "--baseline",
            "B",
            "--candidate",
            "C",
            "--ratio",
            "0.1",
            "--duration",
            "7200",
            "--output",
            str(out),
        ]
    )
    assert rc == 0 and "decision: widen" in capsys.readouterr().out
    rep = json.loads(out.read_text())
    # issue #14: the first stage passed, so traffic widens to 30%; that is not a promotion
    assert rep["final_ratio"] == 0.3 and rep["decision"] == "widen" and rep["promoted"] is False
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    assert run.data.metrics["ab/delta"] == pytest.approx(rep["delta"])
    assert run.data.params["ab.baseline"] == "B" and run.data.tags["ab.decision"] == "widen"
    client = mlflow.MlflowClient()
    arts = {a.path for d in ("ab", "plots") for a in client.list_artifacts(run.info.run_id, d)}
    assert {"ab/ab_report.json", "ab/requests.jsonl", "plots/ab_sequence.png"} <= arts


@pytest.mark.slow
def test_real_tiny_policy_through_the_command_line(tmp_path):
    """python -m hermes_lab.ab_run on the real tiny policy (A/A: baseline == candidate dir)."""
    from hermes_lab.policy.model import build_tiny_policy

    tiny = build_tiny_policy(REPO / "runs", 0, quiet=True)
    params = tmp_path / "p.yaml"
    params.write_text("ab:\n  request_rate: 0.5\n  look_every: 600\n")
    out = tmp_path / "ab_report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.ab.run",
            "--params",
            str(params),
            "--baseline",
            str(tiny),
            "--candidate",
            str(tiny),
            "--ratio",
            "0.3",
            "--duration",
            "900",
            "--output",
            str(out),
            "--no-mlflow",
            "-v",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["n_requests"] > 300 and rep["decision"] != "promote"  # promotion waits for the 2 h stage end
    assert rep["baseline_mean"] > 0.5 and rep["candidate_mean"] > 0.5  # real responses, scored by the verifier
    assert "request_id=req-0-" in proc.stderr and "status=ok" in proc.stderr
    rows = _log(tmp_path / "requests.jsonl")
    assert np.mean([r["reward"] == T.verify(r["prompt"], r["response"]) for r in rows]) == 1.0


@pytest.mark.slow
def test_the_agent_family_is_served_as_whole_episodes(tmp_path):
    """With the embedded agent family in the round (hermes: workspace tasks on Hermes's tools), a share of the
    simulated traffic is agent episodes: each arm plays the conversation (tool calls, their results, the answer) on
    the task's workspace and the episode's reward, the verifier's verdict on that workspace, is the request's."""
    from hermes_lab.policy.model import build_tiny_policy
    from hermes_lab.tasks import hermes as H

    tiny = str(build_tiny_policy(REPO / "runs", 0, quiet=True))
    cfg = load_config(
        None,
        {
            "round.runs_dir": str(tmp_path / "runs"),
            "ab.request_rate": 0.5,
            "ab.look_every": 600,
            "ab.plan_power": 0,
            "grpo.environment": H.ENVIRONMENT,
            "execute.agent_tasks": 64,
        },
    )
    # 600 s at 0.5/s: 258 requests (fixed seeds), 31 of them episodes, 16 and 15 by arm, 45% answered
    rep = ab_run.run_ab(cfg, tiny, tiny, ratio=0.3, duration=600, output=tmp_path / "ab_report.json", plots=False)
    rows = _log(tmp_path / "requests.jsonl")
    agent = [r for r in rows if r["family"] == H.FAMILY]
    assert 0.08 < len(agent) / len(rows) < 0.22  # one family's share: 1 in 7
    assert {r["arm"] for r in agent} == {"baseline", "candidate"}
    for r in agent:
        msgs = r["messages"]
        assert msgs[0] == {"role": "user", "content": r["prompt"]} and r["task_id"].startswith("hermes-")
        assert H.parse_question(r["prompt"]).task_id == r["task_id"]
        # the logged conversation, its calls replayed in a fresh workspace, is scored as the episode was: the reward
        # is the verifier's verdict on what the calls did, not the answer's claim
        assert H.replay_score(msgs) == r["reward"], msgs
        if r["reward"] >= 3:
            assert any(m.get("tool_calls") for m in msgs)  # no task passes without a call of Hermes's tools
    assert 0 < np.mean([r["reward"] >= 3 for r in agent]) < 1  # the base policy answers some episodes
    time_fam = rep["per_family"].get("agent") or {}
    assert time_fam.get("n_baseline", 0) + time_fam.get("n_candidate", 0) == 0  # no time-family traffic
    assert rep["per_family"]["hermes"]["n_baseline"] + rep["per_family"]["hermes"]["n_candidate"] == len(agent)
    # an arm that cannot play episodes (a stand-in behind generate()) leaves the family out, and says so
    rep2 = ab_run.run_ab(
        cfg,
        FakePolicy(0.5, "a"),
        FakePolicy(0.5, "b"),
        ratio=0.3,
        duration=900,
        output=tmp_path / "fake" / "ab_report.json",
        plots=False,
    )
    assert not any(r["family"] == H.FAMILY for r in _log(tmp_path / "fake" / "requests.jsonl")) and rep2


@pytest.mark.slow
def test_notebook_runs_with_papermill(tmp_path, monkeypatch):
    """40_ab_analysis.ipynb runs the rollout (real tiny policy), then reuses the report it wrote."""
    import mlflow
    import papermill as pm

    from hermes_lab.policy.model import build_tiny_policy
    from hermes_lab.round import stages

    tiny = build_tiny_policy(REPO / "runs", 0, quiet=True)
    uri = mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)  # an earlier test may have pointed this process elsewhere
    cfg_path = tmp_path / "params.yaml"
    cfg_path.write_text(f"round:\n  runs_dir: {tmp_path / 'runs'}\nab:\n  request_rate: 0.2\n")
    params = {
        "config_path": str(cfg_path),
        "round_dir": str(tmp_path / "round-01"),
        "baseline": str(tiny),
        "candidate": str(tiny),
        "duration": 900,
        "seed": 1,
    }
    pm.execute_notebook(
        str(REPO / "notebooks" / "40_ab_analysis.ipynb"),
        str(tmp_path / "run.ipynb"),
        parameters=params,
        kernel_name="python3",
        kernel_manager_class=manager(stages.stage("ab").preload),  # forked, as the round runner starts its kernels
        cwd=str(REPO),
        progress_bar=False,
    )
    rep = json.loads((tmp_path / "round-01" / "ab" / "ab_report.json").read_text())
    assert rep["n_requests"] > 120 and rep["decision"] in ("keep observing", "roll back", "hold")
    text = (tmp_path / "run.ipynb").read_text()
    assert "decision: " in text and text.count("image/png") >= 3
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.info.run_name == "ab" and "ab/delta" in run.data.metrics


def test_notebook_helper_reuses_an_existing_report(tmp_path, monkeypatch):
    """notebook_run on a round that already has ab_report.json: no policy is loaded, plots are redrawn."""
    import mlflow

    uri = mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    cfg = _cfg(tmp_path)
    out = tmp_path / "round-01" / "ab"
    first = ab_run.run_ab(
        cfg, FakePolicy(0.5, "b"), FakePolicy(0.6, "c"), duration=3600, output=out / "ab_report.json", plots=False
    )
    monkeypatch.setattr(ab_run, "load_arm", lambda *a: pytest.fail("a policy was loaded"))
    res = ab_run.notebook_run(cfg, tmp_path / "round-01")
    assert res["report"]["delta"] == first["delta"] and len(res["plots"]) == 3
    assert all(p.is_file() for p in res["plots"])
    assert len(res["cols"]["reward"]) == first["n_requests"]
    assert ab_report.stage_table(res["report"]).loc[0, "delta"] == pytest.approx(first["stages"][0]["delta"])
    assert set(ab_report.family_table(res["report"]).index) >= {"upper", "add"}


def test_round_moves_the_champion_only_on_promotion(tmp_path):
    """round.outcome.finish_round: "widen" (a stage passed, traffic below 100%) is not a promotion (issue #14)."""
    from hermes_lab.core.state import FlywheelState
    from hermes_lab.core.verdict import gate, write_verdict
    from hermes_lab.round import outcome
    from hermes_lab.round.stages import STAGES

    cfg = _cfg(tmp_path)
    for decision, promoted, ratio in (("widen", False, 0.3), ("promote", True, 1.0)):
        rd = tmp_path / f"round-{decision}"
        adapter = str(rd / "train" / "adapter")
        write_verdict(rd / "train", "train", [gate("training_health", True, "no warnings")], adapter=adapter)
        report = {"decision": decision, "promoted": promoted, "rolled_back": False, "final_ratio": ratio, "delta": 0.4}
        ab_report.write_ab_verdict(report, rd / "ab")
        state = FlywheelState()
        prog = {"completed": ["train", "validate", "ab"], "timings": {}, "parent_run_id": "x"}
        summary = outcome.finish_round(cfg, STAGES, state, rd, 1, prog, "completed")
        assert (state.champion_adapter == adapter) is promoted and (state.champion_adapter is None) is not promoted
        assert summary["status"] == ("promoted" if promoted else "candidate held (widen)")
        assert summary["ab"]["promoted"] is promoted and summary["ab"]["final_ratio"] == ratio
        ab_gate = next(g for g in summary["gates"] if g["gate"] == "ab_decision")
        assert ab_gate["passed"] is promoted
