"""The round: papermill stages in order, MLflow parent + nested runs, lock, resume, status."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hermes_lab.core.state import FlywheelState, state_path
from hermes_lab.policy.model import build_tiny_policy
from hermes_lab.round import runner as R
from hermes_lab.round.stages import STAGES, all_gates

from conftest import mlflow_db
from repo_paths import REPO

HERMES = [sys.executable, "-m", "hermes_lab.cli.main"]


def small_params(tmp_path: Path, **sections) -> Path:
    """params/embedded.yaml scaled down for CI, with runs/ under tmp_path (the tiny policy is shared)."""
    cfg = yaml.safe_load((REPO / "params" / "embedded.yaml").read_text())
    runs = tmp_path / "runs"
    (runs / "policies").mkdir(parents=True)
    tiny = build_tiny_policy(REPO / "runs", seed=0)
    os.symlink(tiny, runs / "policies" / tiny.name)  # built once per machine, reused
    cfg["round"]["runs_dir"] = str(runs)
    mlflow_db(runs / "mlflow.db")  # the store the round would create, without migrating it once more
    cfg["execute"]["num_tasks"] = 250  # ~8% exact duplicates: still >= min_samples new samples
    cfg["execute"]["samples_per_task"] = 1  # 250 logged samples, as many tasks
    cfg["data"]["min_samples"] = 200  # the gate at the scale of these rounds (the runner, not the volume, is tested)
    cfg["data"]["review_fraction"] = 0.25  # ~50 labels: enough for the review gate to decide (35 at 100% agreement)
    cfg["grpo"]["max_steps"] = 2  # the runner is under test, not the gain
    cfg["grpo"]["episode_steps"] = 1  # the agent family's episode phase, exercised at CI scale
    # no agent episodes logged: at this scale the few agent conversations in the review queue (the simulated
    # reviewer cannot label them) leave the review gate inconclusive; the episode phase starts from the round's
    # agent environment's own rows (grpo.environment: the hermes family's WorkspaceEnv)
    cfg["execute"]["agent_tasks"] = 0
    # the built-in loop plays the agent family: these rounds test the runner; the real Hermes Agent's execute and
    # validate are tests/e2e/test_hermes_loop.py's
    cfg["agent"]["runner"] = "builtin"
    cfg["validate"]["eval_tasks_per_family"] = 8
    cfg["validate"]["samples_per_task"] = 2
    # 8 tasks x 2 samples per family cannot resolve the default 5-point non-inferiority margin (the gate warns
    # so): these rounds test the runner, not the gate, so the gate gets a margin it can decide on this sample
    cfg["validate"]["tolerance"] = 0.5
    # the train stage's before/after check (60 tasks and 10 episodes at 10, 27 s of a loaded round's train stage):
    # that it runs and is reported is what these rounds need, not a resolved gain
    cfg["validate"]["gain_tasks_per_family"] = 4
    cfg.setdefault("ab", {}).update(request_rate=0.01, plan_power=0)  # a fixed, cheap rate (~215 requests): no planning
    for sec, kv in sections.items():
        cfg.setdefault(sec, {}).update(kv)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_lock_refuses_a_second_round(tmp_path):
    params = small_params(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from hermes_lab.round.runner import RoundLock\n"
                f"with RoundLock(Path({str(tmp_path / 'runs')!r})):\n"
                "    print('locked', flush=True); time.sleep(60)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        p = subprocess.run([*HERMES, "round", "--params", str(params)], capture_output=True, text=True)
        assert p.returncode == 1
        assert "another round is running" in p.stderr and f"pid {holder.pid}" in p.stderr
    finally:
        holder.kill()
        holder.wait()
    with R.RoundLock(tmp_path / "runs"):  # released by the kernel when its holder died
        pass


def test_status_explains_why_no_round_is_due(tmp_path):
    params = small_params(tmp_path, data={"min_samples": 5000})
    runs = tmp_path / "runs"
    st = FlywheelState(last_train_time="2026-01-01T00:00:00+00:00", simulated_now="2026-01-01T05:00:00+00:00")
    st.save(state_path(runs))
    s = R.status(str(params))
    assert not s["due"]
    assert any(r.startswith("cooldown: 19.0 h left") for r in s["reasons"])
    assert any(r.startswith("samples: 250 of 5000") for r in s["reasons"])
    p = subprocess.run([*HERMES, "status", "--params", str(params)], capture_output=True, text=True)
    assert p.returncode == 3 and "not due" in p.stdout


def test_trl_is_asked_once_per_machine_about_the_sections_it_checks(tmp_path, monkeypatch):
    """The round's deep config check (TRL's GRPOConfig, PEFT's LoraConfig: ~8 s of imports) leaves a stamp in
    the machine's cache under what it asked: another project or data setting is not asked again, another
    grpo setting is, and a config they refuse is refused each time, never stamped."""
    from hermes_lab.config import check
    from hermes_lab.config.schema import ConfigError, load_config

    monkeypatch.setenv("HERMES_LAB_CACHE", str(tmp_path / "cache"))
    real, asked = check.deep_problems, []
    monkeypatch.setattr(check, "deep_problems", lambda cfg: asked.append(cfg.source) or real(cfg))

    def project(name: str, **sections) -> tuple:
        cfg = yaml.safe_load((REPO / "params" / "embedded.yaml").read_text())
        cfg["round"]["runs_dir"] = str(tmp_path / name / "runs")
        for sec, kv in sections.items():
            cfg[sec].update(kv)
        (tmp_path / name).mkdir()
        (tmp_path / name / "p.yaml").write_text(yaml.safe_dump(cfg))
        return load_config(tmp_path / name / "p.yaml"), tmp_path / name / "runs"

    R._check_deep(*project("a"))
    R._check_deep(*project("b", data={"min_samples": 7}, execute={"num_tasks": 9}))
    assert len(asked) == 1 and len(list((tmp_path / "cache" / "checked-configs").iterdir())) == 1
    R._check_deep(*project("c", grpo={"learning_rate": 3e-5}))
    assert len(asked) == 2
    with pytest.raises(ConfigError, match="lora.task_type"):  # PEFT's TaskType says CAUSAL_LM
        R._check_deep(*project("d", lora={"task_type": "CAUSAL"}))
    assert len(asked) == 3
    assert len(list((tmp_path / "cache" / "checked-configs").iterdir())) == 2  # not stamped: asked again next time


def test_unknown_notebook_parameter_is_refused(tmp_path):
    with pytest.raises(R.RoundError, match="unknown parameter"):
        R.run_notebook("00_execute.ipynb", tmp_path / "x.ipynb", {"config_path": "x", "api_key": "nope"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    mlflow_db(tmp_path / "server.db")  # migrated already: the server starts in seconds
    srv = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # MLflow 3's server starts ten job consumers by default (its "jobs" feature, which the round does not
        # use): ~30 s of CPU at start, and processes of their own session that outlive the server's group
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.time() + 300  # seconds on a quiet machine; much longer while other suites run
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            if srv.poll() is not None or time.time() > deadline:
                if srv.poll() is None:
                    os.killpg(srv.pid, signal.SIGKILL)
                pytest.fail(f"mlflow server did not start (exit code {srv.poll()})")
            time.sleep(0.5)
    yield url
    os.killpg(srv.pid, signal.SIGTERM)
    srv.wait(timeout=30)


@pytest.mark.slow
def test_round_killed_then_resumed_against_an_mlflow_server(tmp_path, mlflow_server):
    params = small_params(tmp_path)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server, "PYTHONUNBUFFERED": "1"}
    rd = tmp_path / "runs" / "round-01"
    proc = subprocess.Popen(
        [*HERMES, "round", "--params", str(params)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it once the first two stages are done
        prog = json.loads((rd / "progress.json").read_text()) if (rd / "progress.json").exists() else {}
        if "prep" in prog.get("completed", []):
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    executed_first = (rd / "00_execute.ipynb").stat().st_mtime
    # the unfinished round is refused without --resume, then continued with it
    p = subprocess.run([*HERMES, "round", "--params", str(params)], env=env, cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 1 and "--resume" in p.stderr
    p = subprocess.run(
        [*HERMES, "round", "--params", str(params), "--resume"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (rd / "00_execute.ipynb").stat().st_mtime == executed_first  # not run again
    assert "where the time went" in p.stdout
    for stage in STAGES:
        assert (rd / stage.notebook).exists(), stage.notebook
    assert (rd / "train" / "adapter" / "adapter_config.json").exists()
    # the round's agent family is hermes: trained on whole episodes, checked held-out before/after, gated by validate
    from hermes_lab.core.layout import RoundLayout

    lay = RoundLayout(rd)
    ev = json.loads(lay.train.eval.read_text())
    assert ev["agent"]["before"]["task_ids"][0].startswith("hermes-") and "after" in ev["agent"]
    per_family = json.loads(lay.validate.regression.read_text())["per_family"]
    assert "hermes" in per_family and "agent" not in per_family
    report = json.loads((rd / "ab" / "ab_report.json").read_text())
    assert {"delta", "p_value", "significant", "decision"} <= set(report)
    summary = json.loads((rd / "summary.json").read_text())
    assert [g["gate"] for g in summary["gates"]] == [g for _, g in all_gates()]  # every gate, in order
    assert all(g["passed"] is not None for g in summary["gates"])  # a completed round ran them all
    state = FlywheelState.load(state_path(tmp_path / "runs"))
    assert state.last_round == 1 and state.last_train_time
    if summary["promoted"]:
        assert state.champion_adapter == str(rd / "train" / "adapter")
    assert state.progress is None  # the round is done: nothing left to resume
    # MLflow on the server: one parent run, a nested run per stage
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    runs = mlflow.search_runs(experiment_names=["hermes-lab"])
    parent = summary["parent_run_id"]
    children = runs[runs["tags.mlflow.parentRunId"] == parent]
    assert {"execute", "prep", "review", "train", "validate", "ab"} <= set(children["tags.mlflow.runName"])
    train = children[children["tags.mlflow.runName"] == "train"].iloc[0]
    hist = mlflow.MlflowClient().get_metric_history(train["run_id"], "train/reward")
    assert len(hist) >= yaml.safe_load(params.read_text())["grpo"]["max_steps"]  # a point per prompt-phase step
    parent_run = mlflow.get_run(parent)
    assert parent_run.data.tags["gate.regression"] in {"pass", "stop"}
    assert parent_run.data.tags["round.status"] == summary["status"]


def test_a_round_says_who_plays_the_agent_family_and_what_the_real_agent_did(tmp_path, capsys):
    """The round's first lines name the agent runner (agent.runner); with the real Hermes Agent playing validate's
    held-out tasks, the summary reads regression.json's agent_played and prints each arm's success and the paired
    gain; the built-in loop's reports carry none, and nothing is printed for it."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.core.layout import RoundLayout
    from hermes_lab.policy.model import paired_gain
    from hermes_lab.round import outcome as O

    params = REPO / "params" / "embedded.yaml"
    assert "real Hermes Agent" in R.who_plays(load_config(params))  # make round's default
    assert load_config(None).agent.runner == "hermes"  # and the config's
    assert "built-in loop plays the hermes family" in R.who_plays(load_config(params, {"agent.runner": "builtin"}))
    assert "none" in R.who_plays(load_config(params, {"agent.runner": "hermes", "grpo.environment": "my.env:Shop"}))
    lay = RoundLayout(tmp_path / "round-01")
    lay.validate.root.mkdir(parents=True)
    assert O.agent_played(lay.validate.regression) is None  # no report yet
    ids = [f"t{i}" for i in range(4)]
    b = {"pass_rate": 0.25, "tasks": 4, "seconds": 3.0, "samples_per_task": 1, "task_ids": ids, "passes": "1000"}
    a = {**b, "pass_rate": 0.75, "passes": "1110"}
    lay.validate.regression.write_text(
        json.dumps({"agent_played": {"runner": "hermes", "before": b, "after": a, "gain": paired_gain(b, a)}})
    )
    played = O.agent_played(lay.validate.regression)
    assert played["before"]["pass_rate"] == 0.25 and played["gain"]["gain"] == 0.5 and "passes" not in played["after"]
    s = {"round": 1, "status": "promoted", "decision": "promote", "total_s": 1.0, "gates": [], "timings_s": {}}
    O.print_summary({**s, "agent_played": played})
    assert "played by the real Hermes Agent (validate, baseline -> candidate): 25.0% -> 75.0%, +50.0 points" in (
        capsys.readouterr().out
    )
    O.print_summary(s)
    assert "real Hermes" not in capsys.readouterr().out


def test_a_round_whose_real_agent_cannot_run_stops_before_any_stage_and_names_the_key(tmp_path, monkeypatch):
    """agent.runner hermes (the default) on a machine where the pinned hermes-agent cannot be installed: the round
    stops at its start with a RoundError naming agent.runner and the way out (builtin), not a kernel's traceback
    minutes into execute; nothing of the round is run."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the virtualenv's parent would be")
    monkeypatch.setenv("HERMES_FIXTURE_VENV", str(blocker / "venv"))  # python -m venv cannot make it
    params = small_params(tmp_path, agent={"runner": "hermes"})
    with pytest.raises(R.RoundError, match=r"agent\.runner: hermes, but the real Hermes Agent cannot run here") as e:
        R.run_round(str(params), quiet=True)
    assert "cannot install hermes-agent==0.19.0" in str(e.value) and "agent.runner: builtin" in str(e.value)
    from hermes_lab.core.layout import RunsLayout

    rd = RunsLayout(tmp_path / "runs").round(1)
    assert not rd.trajectories.exists() and not rd.hermes.root.exists()
