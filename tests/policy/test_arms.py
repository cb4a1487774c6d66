"""hermes_lab.policy.arms: every flag that takes a policy or an adapter accepts the same kinds, and anything else is
one line naming the flag and the kinds (issue 15). The user's two commands run as written after a real
`python -m hermes_lab.train` (slow test at the end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.state import FlywheelState, state_path
from hermes_lab.policy import arms

from repo_paths import REPO


def _adapter(d: Path, base: str = "/models/base") -> Path:
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA"}))
    return d


@pytest.fixture
def cfg(tmp_path):
    return load_config(overrides={"round.runs_dir": str(tmp_path / "runs")})


def test_every_kind(tmp_path, cfg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    _adapter(tmp_path / "ad")
    _adapter(tmp_path / "ckpt" / "round-01" / "adapter", base="/models/b2")
    got = {s: arms.resolve_arm(s, "--x", cfg) for s in ("model", "./ad", "ckpt/round-01", "org/name", "embedded:tiny")}
    assert (got["model"].kind, got["model"].base, got["model"].adapter) == ("model dir", str(tmp_path / "model"), None)
    ad = got["./ad"]
    assert (ad.kind, ad.base, ad.adapter, ad.label) == ("adapter dir", "/models/base", str(tmp_path / "ad"), "./ad")
    tr = got["ckpt/round-01"]
    train_adapter = str(tmp_path / "ckpt" / "round-01" / "adapter")
    assert (tr.kind, tr.base, tr.adapter) == ("train output", "/models/b2", train_adapter)
    assert (got["org/name"].kind, got["embedded:tiny"].kind) == ("hub id", "embedded")
    assert arms.resolve_adapter("ckpt/round-01", "--a", cfg) == train_adapter
    # relative to base_dir when given (notebooks pass the project root)
    assert arms.resolve_arm("ad", "--x", cfg, base_dir=tmp_path).adapter == str(tmp_path / "ad")


@pytest.mark.parametrize(
    "spec, why",
    [
        ("./checkpoints/baseline", "no such directory"),
        ("checkpoints/baseline", "no such directory"),  # checkpoints/ exists here: a path, not a hub id
        ("empty-dir", "holds no model"),
        ("file.txt", "is a file"),
        ("embedded:other", "no such directory"),
        ("  ", "is empty"),
    ],
)
def test_bad_specs_are_one_line_naming_flag_and_kinds(spec, why, tmp_path, cfg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / "round-01").mkdir(parents=True)
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(arms.ArmError) as ei:
        arms.resolve_arm(spec, "--baseline", cfg)
    msg = str(ei.value)
    assert "\n" not in msg and why in msg and msg.startswith("--baseline ")
    assert "hub id" in msg and "champion" in msg and "train output dir" in msg


def test_adapter_flags_refuse_non_adapters(tmp_path, cfg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for spec, why in (("model", "names a model dir"), ("org/name", "names a hub id"), ("./nope", "no such")):
        with pytest.raises(arms.ArmError, match=why) as ei:
            arms.resolve_adapter(spec, "--start-adapter", cfg)
        assert str(ei.value).endswith(arms.ADAPTER_KINDS)
    assert arms.resolve_adapter("", "--start-adapter", cfg) is None


def test_champion_registry_then_state_then_base(tmp_path, cfg, mlflow_store):
    from mlflow import MlflowClient

    runs = Path(cfg.round.runs_dir)
    arm = arms.resolve_arm("champion", "--baseline", cfg)
    assert (arm.kind, arm.base, arm.adapter) == ("champion", "embedded:tiny", None)  # nothing promoted: the base
    assert "no champion promoted yet" in arm.note
    state_champ = _adapter(runs / "round-01" / "train" / "adapter", base="/models/s")
    FlywheelState(champion_adapter=str(state_champ)).save(state_path(runs))
    arm = arms.resolve_arm("champion", "--baseline", cfg)
    assert (arm.adapter, arm.base) == (str(state_champ), "/models/s")
    # the registry alias wins: first its round's copy on disk, else a download of the registered artifact
    src = _adapter(tmp_path / "artifacts" / "adapter", base="/models/r")
    client = MlflowClient()
    client.create_registered_model(cfg.round.registered_model)
    mv = client.create_model_version(cfg.round.registered_model, source=src.as_uri(), tags={"round": "round-02"})
    client.set_registered_model_alias(cfg.round.registered_model, "champion", mv.version)
    arm = arms.resolve_arm("champion", "--baseline", cfg)
    assert arm.base == "/models/r" and Path(arm.adapter).is_relative_to(runs / "cache") and "registry" in arm.note
    local = _adapter(runs / "round-02" / "train" / "adapter", base="/models/r")
    assert arms.resolve_adapter("champion", "--start-adapter", cfg) == str(local)


def test_cli_flags_give_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from hermes_lab.agents import execute
    from hermes_lab.evaluate import validate
    from hermes_lab.train import grpo as train

    monkeypatch.chdir(tmp_path)
    emb = str(REPO / "params" / "embedded.yaml")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    calls = [
        (train.main, ["--config", emb, "--data", "d.jsonl", "--output", "o", "--start-adapter", "./nope"]),
        (execute.main, ["--params", emb, "--output", "t.jsonl", "--adapter", "model"]),
        (validate.main, ["--base", "embedded:tiny", "--candidate-adapter", "./nope", "--output", "v"]),
    ]
    for main, argv in calls:
        assert main(argv) == 2
        err = capsys.readouterr().err
        flag = next(a for a in argv if a in ("--start-adapter", "--adapter", "--candidate-adapter"))
        assert err.count("\n") == 1 and f": {flag} " in err and arms.ADAPTER_KINDS in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "t.jsonl").exists()  # failed before any work


@pytest.mark.slow
def test_users_two_commands_after_train(project_copy):
    """SPEC's commands as the user types them, in the project: train to ./checkpoints/round-01, then ab_run with
    that train output dir as the candidate. The missing ./checkpoints/baseline is one line naming --baseline;
    with --baseline champion (nothing promoted yet: the base policy) the A/B runs and reports."""
    from test_paths import write_trajectories

    write_trajectories(project_copy / "trajectories.jsonl", n=600)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HERMES_LAB_ROOT")}
    env.setdefault("OMP_NUM_THREADS", "1")  # a 0.3M-parameter policy: two contended threads are 10x slower than one
    py = [sys.executable, "-m"]
    train = [*py, "hermes_lab.train", "--config", "params/embedded.yaml", "--data", "./trajectories.jsonl"]
    train += ["--output", "./checkpoints/round-01", "--max-steps", "2", "--no-eval"]
    r = subprocess.run(train, cwd=project_copy, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FutureWarning" not in r.stderr and "gradient_checkpointing" not in r.stderr
    ab = [*py, "hermes_lab.ab_run", "--baseline", "./checkpoints/baseline", "--candidate", "./checkpoints/round-01"]
    ab += ["--ratio", "0.1", "--duration", "7200", "--output", "./ab_report.json"]
    r = subprocess.run(ab, cwd=project_copy, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    assert "--baseline './checkpoints/baseline': no such directory" in line and "champion" in line
    ab[4] = "champion"
    r = subprocess.run(ab, cwd=project_copy, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((project_copy / "ab_report.json").read_text())
    assert {"delta", "p_value", "significant"} <= rep.keys() and rep["n_requests"] > 1000
    assert (rep["baseline"], rep["candidate"]) == ("champion", "./checkpoints/round-01")
    assert (project_copy / "runs" / "mlflow.db").is_file()  # the project's store, not ./mlruns
    assert not (project_copy / "mlruns").exists()
