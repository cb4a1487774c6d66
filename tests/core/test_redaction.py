"""Secrets kept out of MLflow and printed output BY VALUE (core.redaction, core.tracking), through a
real prep stage in a real SQLite MLflow store: a key in a variable with an innocent name never reaches a param,
a tag or the terminal, and the params the old name filter dropped are logged again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core import redaction as R
from hermes_lab.core import tracking
from hermes_lab.prep.run import run_prep

from repo_paths import REPO

RANDOM_KEY = "Zq8wK3mP9xL2vB7nT4rY6uJ1hG5fD0sA"  # no known prefix: caught as key-shaped, and as api_key_env's value
PREFIXED = "sk-live-4f7a0c2e9b1d8a6f3c5e"  # a known prefix, in a variable whose name says nothing
HEX_KEY = "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c"  # hex: not key-shaped, so only its api_key_env reference catches it
BASE = "https://bob:hunter2-pass@api.example.com/v1"


@pytest.fixture
def secrets(monkeypatch):
    monkeypatch.setenv("HERMES_JUDGE_ACCESS", RANDOM_KEY)
    monkeypatch.setenv("MY_TOOL_SETTING", PREFIXED)
    monkeypatch.setenv("TEAM_VALUE", HEX_KEY)
    monkeypatch.setenv("TAOTOKEN_BASE_URL", BASE)
    return (RANDOM_KEY, PREFIXED, HEX_KEY, "hunter2-pass")


def _records(n: int) -> str:
    return "".join(
        json.dumps({"prompt": f"up w{i}=", "response": f"W{i}", "reward": 5.0, "task_id": f"t{i}"}) + "\n"
        for i in range(n)
    )


def test_secrets_never_reach_mlflow_params_or_tags_and_legit_params_are_logged(secrets, tmp_path, mlflow_store):
    cfg = load_config(
        None,
        {
            "data.min_samples": 1,
            "model.api_key_env": "TEAM_VALUE",
            "reward.api_key_env": "HERMES_JUDGE_ACCESS",
            "reward.base_url": BASE,
            "ab.salt": f"salt-{PREFIXED}",  # a secret pasted into an ordinary field
        },
    )
    (tmp_path / "t.jsonl").write_text(_records(30))
    with tracking.stage_run("prep", runs_dir=tmp_path, tags={"note": f"key {RANDOM_KEY}"}) as run:
        tracking.log_params(cfg.flat_params())  # what the stage notebooks log
        tracking.set_tags({"team": HEX_KEY, "judge": f"at {BASE}"})
        run_prep([tmp_path / "t.jsonl"], tmp_path / "out", cfg, override_cooldown=True, override_reason=f"x {HEX_KEY}")
    data = mlflow_store.MlflowClient().get_run(run.info.run_id).data
    logged = json.dumps([data.params, {k: v for k, v in data.tags.items() if k != "note"}])
    for s in secrets:
        assert s not in logged, s
    # the keys the name filter used to drop are back, with the URL's credentials masked
    assert data.params["reward.base_url"] == "https://***@api.example.com/v1"
    assert data.params["execute.max_new_tokens"] == "16" and data.params["grpo.max_completion_length"] == "256"
    assert (
        data.params["model.api_key_env"] == "TEAM_VALUE" and data.params["reward.api_key_env"] == "HERMES_JUDGE_ACCESS"
    )
    assert data.params["prep.override_reason"] == "x ***" and data.tags["team"] == "***"
    assert data.params["ab.salt"] == "salt-***"


def test_a_key_echoed_from_the_data_is_not_printed(secrets, tmp_path):
    """The prep CLI prints the first rejected lines' details; a key that sits in the data is masked there."""
    noisy = tmp_path / "noisy.jsonl"
    bad = {"prompt": "p", "response": "r", "reward": 1, "task_id": {"token": RANDOM_KEY}}
    noisy.write_text(json.dumps(bad) + "\n" + _records(1))
    p = subprocess.run(
        [sys.executable, "-m", "hermes_lab.prep", "--input", str(noisy), "--output", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "bad task_id" in p.stderr
    assert RANDOM_KEY not in p.stdout + p.stderr and RANDOM_KEY[:12] not in p.stderr


def test_what_counts_as_a_secret():
    for v in (RANDOM_KEY, PREFIXED, "ghp_" + "a1" * 12, "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl"):
        assert R.looks_like_key(v), v
    for v in ("Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "/work/runs/policies/tiny-s0", HEX_KEY[:32]):
        assert not R.looks_like_key(v), v  # model ids, paths and 32-hex run ids are not keys
    for name in ("TAOTOKEN_API_KEY", "HF_TOKEN", "MY_CRED", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
        assert R.secret_env_name(name), name
    for name in ("TAOTOKEN_BASE_URL", "SSH_AUTH_SOCK", "PWD", "HOME", "KEYBOARD", "MAX_NEW_TOKENS_DEFAULT_FILE"):
        assert not R.secret_env_name(name), name
    assert (
        R.strip_url_credentials(f"see {BASE} and http://tok@h/x")
        == "see https://***@api.example.com/v1 and http://***@h/x"
    )
    assert R.redact(f"Authorization: Bearer {HEX_KEY}") == "Authorization: Bearer ***"
