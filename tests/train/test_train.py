"""hermes_lab.train.grpo: the YAML -> TRL GRPOConfig / PEFT mapping, the long-prompt filter, the health guards, CLI
errors (fast); real GRPO + LoRA training of the tiny policy with TRL, MLflow in a real SQLite store, the
user's YAML against a real fake-OpenAI judge, continuing from an adapter, a NaN reward, and torchrun (slow).

The tiny policy is built once per machine under the repo's runs/policies/ (the session fixture), never in
tmp_path: building it takes minutes, reusing it takes a second."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hermes_lab.config.schema import ConfigError, load_config
from hermes_lab.tasks import suite as T

from conftest import mlflow_db
from repo_paths import REPO

USER_YAML = REPO / "params" / "hermes_grpo_lora.yaml"
EMBEDDED_YAML = REPO / "params" / "embedded.yaml"
KEY = "sk-test-TRAIN-7e4b1a9d3c55"
USER_ENV = {
    "HERMES_POLICY_MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
    "TAOTOKEN_BASE_URL": "https://api.example.com",
    "TAOTOKEN_API_KEY": KEY,
    "HERMES_REWARD_MODEL": "judge-1",
}
PER_STEP_KEYS = {"reward", "kl", "entropy", "frac_reward_zero_std", "rewards/system/mean", "learning_rate"}


# ============================================================================================ fast
def test_grpo_kwargs_map_the_users_yaml_and_trl_accepts_them(tmp_path):
    from trl import GRPOConfig

    from hermes_lab.config.trl import grpo_kwargs

    cfg = load_config(USER_YAML, env=USER_ENV)
    kw = grpo_kwargs(cfg, tmp_path, 256, [1.0, 0.5])
    assert kw["num_generations"] == 8  # group_size
    assert kw["beta"] == 0.04  # kl_coefficient, passed explicitly
    assert kw["epsilon"] == 0.2  # clip_range
    assert kw["learning_rate"] == 1.0e-5
    assert kw["max_steps"] == 300
    assert kw["per_device_train_batch_size"] == 2 * 8  # prompts x group_size = completions
    assert kw["gradient_accumulation_steps"] == 8
    assert kw["temperature"] == 0.9
    assert kw["max_completion_length"] == 256
    assert kw["reward_weights"] == [1.0, 0.5]
    assert kw["report_to"] == "none" and kw["save_strategy"] == "steps"
    assert kw["save_steps"] == 50 and kw["save_total_limit"] == 2  # 300 steps: every 50 (at most), 2 kept
    assert kw["remove_unused_columns"] is False  # reference / ref_reward reach the rewards
    assert kw["output_dir"] == str(tmp_path / "trl")

    args = GRPOConfig(**kw)  # the real TRL config: every key exists and the values pass its checks
    assert (args.num_generations, args.beta, args.epsilon, args.learning_rate) == (8, 0.04, 0.2, 1.0e-5)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 8)
    assert (args.temperature, args.max_steps, args.max_completion_length) == (0.9, 300, 256)
    assert args.reward_weights == [1.0, 0.5] and args.report_to in ("none", [], ["none"])
    assert args.generation_batch_size % args.num_generations == 0


def test_checkpoint_interval(tmp_path):
    from hermes_lab.config.trl import grpo_kwargs

    kw = grpo_kwargs(load_config(EMBEDDED_YAML), tmp_path, 16, [1.0, 0.25])
    assert kw["save_steps"] == 10  # the embedded 40-step run saves four times
    kw = grpo_kwargs(load_config(EMBEDDED_YAML, {"grpo.save_steps": 3}), tmp_path, 16, [1.0, 0.25])
    assert kw["save_steps"] == 3
    with pytest.raises(ConfigError, match="grpo.save_total_limit"):
        load_config(EMBEDDED_YAML, {"grpo.save_total_limit": 0})


def test_judge_failures_in_the_inspect_diagnostics(tmp_path):
    from hermes_lab.train.state import judge_diagnostic

    assert judge_diagnostic(tmp_path, 0.2) is None  # no health.json
    (tmp_path / "health.json").write_text(json.dumps({"status": "completed", "judge": None}))
    assert judge_diagnostic(tmp_path, 0.2) is None  # the local judge: nothing to report
    judge = {"judge_samples": 200, "judge_failures": 10, "imputed_from_group": 8, "system_reward_only": 2}
    (tmp_path / "health.json").write_text(json.dumps({"judge": {**judge, "by_kind": {"ApiStatusError": 10}}}))
    d = judge_diagnostic(tmp_path, 0.2)
    assert d["rule"] == "judge_failures" and d["severity"] == "warn" and d["value"] == 0.05
    assert "10 of 200 judged samples failed (5.0%)" in d["message"] and "doctor" in d["advice"]
    assert judge_diagnostic(tmp_path, 0.04)["severity"] == "fail"


def test_grpo_kwargs_always_pass_beta_even_zero(tmp_path):
    from hermes_lab.config.trl import grpo_kwargs

    cfg = load_config(USER_YAML, {"grpo.kl_coefficient": 0.0, "grpo.group_size": 4}, env=USER_ENV)
    kw = grpo_kwargs(cfg, tmp_path, 16, [1.0, 1.0])
    assert "beta" in kw and kw["beta"] == 0.0
    assert kw["num_generations"] == 4 and kw["per_device_train_batch_size"] == 8


def _ds(prompts):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts, "reference": ["r"] * len(prompts)})


def test_filter_long_prompts_flags_too_long_and_keeps_the_rest():
    from hermes_lab.policy.model import build_tokenizer  # one token per character: lengths are easy to reason about
    from hermes_lab.train.prompts import filter_long_prompts

    tok = build_tokenizer()
    cfg = load_config(None, {"data.max_seq_len": 64, "grpo.max_completion_length": 16})  # room for 48 tokens
    prompts = ["a" * 10, "b" * 48, "c" * 49, "d" * 60, "e" * 100, "f" * 20]
    kept, flagged, completion = filter_long_prompts(_ds(prompts), tok, cfg)
    assert completion == 16  # never shortened to make a long prompt fit
    assert kept["prompt"] == ["a" * 10, "b" * 48, "f" * 20]
    assert kept["reference"] == ["r"] * 3  # other columns follow
    assert [f["prompt_tokens"] for f in flagged] == [49, 60, 100]
    assert all("data.max_seq_len 64" in f["reason"] for f in flagged)
    assert flagged[2]["prompt"] == "e" * 100

    # the same prompt is kept or flagged on its own length, whatever else is in the set
    _, flagged2, completion2 = filter_long_prompts(_ds(["a" * 10, "d" * 60]), tok, cfg)
    assert completion2 == 16 and [f["prompt_tokens"] for f in flagged2] == [60]

    kept3, flagged3, _ = filter_long_prompts(_ds(["up cat=", "rev abc="]), tok, cfg)
    assert len(kept3) == 2 and flagged3 == []

    with pytest.raises(ValueError, match="data.max_seq_len=64"):
        filter_long_prompts(_ds(["x" * 70]), tok, cfg)
    with pytest.raises(ConfigError, match="grpo.max_completion_length=64.*data.max_seq_len=64"):
        load_config(None, {"data.max_seq_len": 64, "grpo.max_completion_length": 64})  # caught at load time


def _callback(tmp_path, is_main=True, **overrides):
    from hermes_lab.rewards.registry import SampleLog
    from hermes_lab.train.callback import make_callback

    # the guard thresholds set here, not taken from a YAML that may be retuned
    cfg = load_config(
        None,
        {
            "grpo.kl_warn": 0.5,
            "grpo.zero_std_warn": 0.8,
            "grpo.kl_coefficient": 0.04,
            "grpo.temperature": 0.9,
            **overrides,
        },
    )
    return make_callback(cfg, tmp_path / "train_log.jsonl", SampleLog(), is_main)


def _log(cb, step, **logs):
    cb.on_log(None, SimpleNamespace(global_step=step, epoch=step / 10), None, logs=logs)


def test_kl_guards_and_nan_loss(tmp_path):
    from hermes_lab.train.callback import TrainingHealthError

    cb = _callback(tmp_path)
    for step, kl in enumerate([0.01, 0.012, 0.011, 0.02], start=1):
        _log(cb, step, loss=0.1, kl=kl, frac_reward_zero_std=0.1, reward=2.0, entropy=None)
    assert cb.warnings == []
    _log(cb, 5, loss=0.1, kl=0.3, frac_reward_zero_std=0.1)  # 25x the recent median: a spike
    _log(cb, 6, loss=0.1, kl=0.013, frac_reward_zero_std=0.1)  # back the next step: the estimator's noise
    assert cb.warnings == []
    _log(cb, 7, loss=0.1, kl=0.3, frac_reward_zero_std=0.1)
    _log(cb, 8, loss=0.1, kl=0.35, frac_reward_zero_std=0.1)  # and this time it stays: a trend
    assert len(cb.warnings) == 1, cb.warnings
    assert "rose to 0.350 by step 8 and stayed (median 0.013 before step 7)" in cb.warnings[0]
    assert "raise kl_coefficient (now 0.04)" in cb.warnings[0]
    _log(cb, 9, loss=0.1, kl=0.9, frac_reward_zero_std=0.1)  # above kl_warn 0.5
    _log(cb, 10, loss=0.1, kl=1.2, frac_reward_zero_std=0.1)  # each kind warns once
    assert len(cb.warnings) == 2, cb.warnings
    assert "exceeds 0.5" in cb.warnings[1] and "raise kl_coefficient (now 0.04)" in cb.warnings[1]
    rows = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 11)) and rows[0]["entropy"] is None
    with pytest.raises(TrainingHealthError, match="NaN/inf loss at step 11.*reward outliers"):
        _log(cb, 11, loss=float("nan"), kl=0.1)
    assert len((tmp_path / "train_log.jsonl").read_text().splitlines()) == 10


def test_zero_std_guard_and_other_ranks_write_nothing(tmp_path):
    cb = _callback(tmp_path, is_main=False)
    for step, zero in enumerate([0.0, 0.0, 0.0, 0.0, 1.0, 0.25], start=1):  # one all-solved batch: no alarm
        _log(cb, step, loss=0.1, kl=0.01, frac_reward_zero_std=zero)
    assert cb.warnings == []
    for step in range(7, 12):
        _log(cb, step, loss=0.1, kl=0.01, frac_reward_zero_std=1.0)
    assert len(cb.warnings) == 1 and "raise temperature (now 0.9)" in cb.warnings[0]  # every rank runs the guards
    assert not (tmp_path / "train_log.jsonl").exists()  # ... only the main one writes


def test_mlflow_metrics_are_batched_then_flushed(tmp_path, mlflow_store, monkeypatch):
    """A SQL store write costs ~16 ms a call + ~0.14 ms a metric and a disk wait (a tiny-policy step is ~130
    ms): metrics go to MLflow's writer thread in batches of MetricBuffer.every_steps steps, and the end of
    training waits until all are written, as train/<TRL name>; NaN/None values never reach MLflow
    (train_log.jsonl keeps them, at once)."""
    cb = _callback(tmp_path)
    client = mlflow_store.MlflowClient()
    with mlflow_store.start_run(experiment_id=mlflow_store.get_experiment_by_name("hermes-lab").experiment_id) as run:
        rid = run.info.run_id
        cb.metrics.every_steps, cb.metrics.every_s = 3, 3600.0
        for step in (1, 2):
            _log(cb, step, loss=0.1, reward=float(step), kl=float("nan"), entropy=None)
        assert client.get_metric_history(rid, "train/reward") == []  # buffered
        assert len((tmp_path / "train_log.jsonl").read_text().splitlines()) == 2  # ... the JSONL is not
        _log(cb, 3, loss=0.1, reward=3.0)  # the batch is full: handed to MLflow's writer thread
        assert cb.metrics._pending == [] and len(cb.metrics._writes) == 1
        cb.metrics.flush(wait=True)
        got = [(m.step, m.value) for m in client.get_metric_history(rid, "train/reward")]
        assert got == [(1, 1.0), (2, 2.0), (3, 3.0)]
        _log(cb, 4, loss=0.1, reward=4.0)
        cb.on_train_end(None, None, None)  # the end writes the rest
        assert len(client.get_metric_history(rid, "train/reward")) == 4
        assert (
            client.get_metric_history(rid, "train/kl") == [] and client.get_metric_history(rid, "train/entropy") == []
        )
        assert client.get_metric_history(rid, "reward") == []  # one namespace: stage/metric
    rows = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and math.isnan(rows[0]["kl"]) and rows[0]["entropy"] is None


def _cli(args, env_over, cwd):
    env = {k: v for k, v in os.environ.items() if k not in USER_ENV}
    env.update(env_over)
    return subprocess.run(
        [sys.executable, "-m", "hermes_lab.train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_missing_policy_env_var_is_one_line_exit_2(tmp_path):
    env = {k: v for k, v in USER_ENV.items() if k != "HERMES_POLICY_MODEL"}
    p = _cli(["--config", str(USER_YAML), "--data", "x", "--output", "y"], env, tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "HERMES_POLICY_MODEL" in lines[0] and "hermes_grpo_lora.yaml:3" in lines[0] and "base_model" in lines[0]
    assert KEY not in p.stderr + p.stdout
    assert not (tmp_path / "y").exists()


def test_cli_unknown_key_is_one_line_exit_2_listing_valid_keys(tmp_path):
    text = USER_YAML.read_text().replace("  clip_range: 0.2", "  clip_range: 0.2\n  kl_coef: 0.1")
    bad = tmp_path / "my_grpo.yaml"
    bad.write_text(text)
    p = _cli(["--config", str(bad), "--data", "x", "--output", "y"], USER_ENV, tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "my_grpo.yaml" in lines[0] and "unknown key 'kl_coef'" in lines[0]
    assert "Valid keys:" in lines[0] and "kl_coefficient" in lines[0] and "group_size" in lines[0]


def test_cli_missing_data_is_one_line_exit_2(tmp_path):
    p = _cli(["--config", str(EMBEDDED_YAML), "--data", str(tmp_path / "nope.jsonl"), "--output", "y"], {}, tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"error: --data {tmp_path / 'nope.jsonl'}: no such file or directory"]


def test_cli_unknown_reward_is_a_config_error_before_loading_the_model(tmp_path):
    # a base model that does not exist: reaching it would fail differently (and, for real models, slowly)
    text = (
        EMBEDDED_YAML.read_text()
        .replace("types: [system, tests, comparison]", "types: [system, tests, bleu]")
        .replace("base_model: embedded:tiny", f"base_model: {tmp_path / 'no-such-model'}")
    )
    assert "bleu" in text and "no-such-model" in text
    (tmp_path / "bad_reward.yaml").write_text(text)
    data = tmp_path / "ds"
    from datasets import Dataset

    Dataset.from_dict({"prompt": ["up cat="], "reference": ["CAT"]}).save_to_disk(str(data))
    p = _cli(["--config", str(tmp_path / "bad_reward.yaml"), "--data", str(data), "--output", "y"], {}, tmp_path)
    assert p.returncode == 2, p.stderr  # a config error now: config.py knows the reward registry
    (line,) = p.stderr.strip().splitlines()
    assert "reward.types entry 'bleu' is unknown" in line and "system, comparison" in line


# ============================================================================================ slow
@pytest.fixture(scope="session")
def tiny_policy() -> Path:
    """The embedded tiny policy, cached under the repo's runs/policies/ (built once per machine)."""
    from hermes_lab.policy.model import build_tiny_policy

    return build_tiny_policy(REPO / "runs", 0, quiet=True)


@pytest.fixture(scope="session")
def prompt_set(tmp_path_factory) -> Path:
    """A small saved GRPO dataset (prompt, reference, ref_reward, tests) like prep writes, half the references
    wrong; the code family's prompts carry their tests (JSON), the others none."""
    import random

    from datasets import Dataset

    rng = random.Random(0)
    ts = T.generate_tasks(40, split="train", seed=0)
    refs = [t.answer if i % 2 == 0 else T.corrupt(t.answer, rng) for i, t in enumerate(ts)]
    ds = Dataset.from_dict(
        {
            "prompt": [t.prompt for t in ts],
            "reference": refs,
            "ref_reward": [T.verify(t.prompt, r) for t, r in zip(ts, refs)],
            "tests": [json.dumps(T.tests_of(t)) if t.family == "code" else None for t in ts],
        }
    )
    path = tmp_path_factory.mktemp("data") / "grpo_dataset"
    ds.save_to_disk(str(path))
    return path


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def _step_rows(out: Path) -> list[dict]:
    return [r for r in _rows(out) if "reward" in r]


def _adapter_tensors(adapter: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(adapter / "adapter_model.safetensors"))


@pytest.fixture(scope="session")
def trained(tiny_policy, prompt_set, tmp_path_factory):
    """(a) once per session: the embedded YAML, 4 steps, nested under a parent run, MLflow in a SQLite store.

    The environment and working directory are patched for the training only, and restored before the tests
    that read the results run (a session fixture must not leave the rest of the session in its tmp dir)."""
    import mlflow

    from hermes_lab.train.grpo import train

    tmp = tmp_path_factory.mktemp("train_a")
    uri = mlflow_db(tmp / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.setenv("TAOTOKEN_API_KEY", KEY)  # set, as on the user's machine: it must reach no param or file
        mp.chdir(tmp)
        mlflow.set_tracking_uri(uri)
        exp_id = mlflow.create_experiment("hermes-lab", artifact_location=(tmp / "mlartifacts").as_uri())
        with mlflow.start_run(experiment_id=exp_id, run_name="round-01") as parent:
            parent_id = parent.info.run_id
        # the episode phase too (hermes_lab.train.episodes), 2 steps: its adapter is the result
        cfg = load_config(
            EMBEDDED_YAML, {"grpo.max_steps": 4, "grpo.episode_steps": 2, "round.runs_dir": str(REPO / "runs")}
        )
        t0 = time.time()
        res = train(cfg, prompt_set, tmp / "train", parent_run_id=parent_id, evaluate_heldout=False)
        seconds = time.time() - t0
    return SimpleNamespace(
        res=res,
        out=tmp / "train",
        parent_id=parent_id,
        client=mlflow.MlflowClient(uri),
        cfg=cfg,
        seconds=seconds,
        tmp=tmp,
    )


@pytest.mark.slow
def test_train_embedded_writes_adapter_log_and_samples(trained, tiny_policy):
    res, out = trained.res, trained.out
    assert res.steps == 4 and res.adapter_dir == out / "adapter"
    print(f"train (a): 4 steps in {trained.seconds:.1f} s")
    names = {p.name for p in res.adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= names
    acfg = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(tiny_policy) and acfg["r"] == trained.cfg.lora.r
    assert set(acfg["target_modules"]) == set(trained.cfg.lora.target_modules)
    tensors = _adapter_tensors(res.adapter_dir)
    assert tensors and not any(".ref." in k for k in tensors)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in tensors.items())  # it trained: B left zero
    # the final norm trained in full (lora.modules_to_save) at its own learning rate: Adam moves a parameter by
    # about its learning rate a step, so 6 steps at grpo.learning_rate could not move a gain by 10x that much
    from safetensors.torch import load_file

    assert acfg["modules_to_save"] == ["model.norm"] == trained.cfg.lora.modules_to_save
    (norm_key,) = [k for k in tensors if "norm" in k]
    base_norm = load_file(str(tiny_policy / "model.safetensors"))["model.norm.weight"]
    moved = float((tensors[norm_key] - base_norm).abs().max())
    assert moved > 10 * 6 * trained.cfg.grpo.learning_rate, moved
    assert trained.cfg.lora.modules_to_save_learning_rate > 10 * trained.cfg.grpo.learning_rate

    steps = _step_rows(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert PER_STEP_KEYS <= set(r), sorted(r)
        assert 0 <= r["reward"] <= 5 * sum(trained.cfg.reward.weights or [1.0, 1.0]) and r["learning_rate"] > 0
        assert "rewards/comparison/mean" in r
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the identity: no drift yet

    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["reward_fn"] for s in samples} == {"system", "tests", "comparison"}
    # the code family's completions are the tests reward's (run in the sandbox), every other one the verifier's
    for s in samples:
        code = T.family_of(s["prompt"]) == "code"
        if s["reward_fn"] in ("system", "tests"):
            assert (s["reward"] is None) == (code == (s["reward_fn"] == "system")), s
    assert all(T.parse_prompt(s["prompt"]) is not None for s in samples)
    sample_steps = {s["step"] for s in samples}  # the step numbers of train_log.jsonl and MLflow
    assert sample_steps <= {1, 2, 3, 4} and 4 in sample_steps
    health = json.loads((out / "health.json").read_text())
    assert health["steps"] == 4 and health["flagged_prompts"] == []
    sandbox = health["sandbox"]  # the tests reward's completions by kind, and what isolated them
    n_code = sum(1 for s in samples if s["reward_fn"] == "tests" and s["reward"] is not None)
    assert sandbox["completions"] >= n_code > 0 and sum(sandbox["by_kind"].values()) == sandbox["completions"]
    assert sandbox["isolation"]["executor"] == "local" and sandbox["sandbox_errors"] == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["mlflow_run_id"] == res.mlflow_run_id and meta["start_adapter"] is None
    assert yaml.safe_load((out / "config.yaml").read_text())["grpo"]["max_steps"] == 4
    for f in out.rglob("*"):
        if f.is_file() and f.suffix in {".json", ".jsonl", ".yaml", ".txt"}:
            assert KEY not in f.read_text(errors="ignore"), f

    # the episode phase continued the prompt phase's adapter; its adapter is the result
    ep_steps = [r for r in _step_rows(out / "episodes")]
    assert [r["step"] for r in ep_steps] == [1, 2] and all("episode_success" in r for r in ep_steps)
    ep_health = json.loads((out / "episodes" / "health.json").read_text())
    assert ep_health["status"] == "completed" and ep_health["episodes"]["episodes"] == 2 * 4 * 8
    assert res.episodes["steps"] == 2
    # on the round's agent family: hermes workspace tasks, Hermes's own tools served by TRL from WorkspaceEnv
    from hermes_lab.tasks import hermes as H

    assert trained.cfg.grpo.environment == H.ENVIRONMENT
    ep_samples = [json.loads(x) for x in (out / "episodes" / "samples.jsonl").read_text().splitlines()]
    called = [c["function"]["name"] for s in ep_samples for m in s["episode"] for c in m.get("tool_calls") or []]
    # sampled at 0.9 a call may misspell a tool's name (a slip, shown the tool's error): most name Hermes's tools
    assert called and sum(n in H.TOOLS for n in called) >= 0.8 * len(called), called
    assert _adapter_tensors(out / "episodes" / "adapter").keys() == tensors.keys()
    assert all((_adapter_tensors(out / "episodes" / "adapter")[k] == v).all() for k, v in tensors.items())

    # the adapter loads the way every later stage loads it, and generates
    from hermes_lab.policy.model import load_policy

    pol = load_policy(str(res.adapter_dir))
    assert len(pol.generate(["up cat=", "rev abc="], temperature=0, max_new_tokens=8)) == 2


@pytest.mark.slow
def test_train_embedded_mlflow(trained):
    client, run_id = trained.client, trained.res.mlflow_run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train"
    assert run.data.tags["mlflow.parentRunId"] == trained.parent_id
    for metric in ("reward", "kl", "entropy", "frac_reward_zero_std", "rewards/system/mean", "learning_rate"):
        hist = client.get_metric_history(run_id, f"train/{metric}")
        assert sorted(m.step for m in hist) == [1, 2, 3, 4], metric
    rewards = {m.step: m.value for m in client.get_metric_history(run_id, "train/reward")}
    assert rewards == {r["step"]: pytest.approx(r["reward"]) for r in _step_rows(trained.out)}
    # the tests reward's completions by kind, cumulative per step (the last step's counts are health.json's)
    kinds = json.loads((trained.out / "health.json").read_text())["sandbox"]["by_kind"]
    for kind in ("passed", "failed", "compile_error", "timeout", "crash"):
        hist = sorted(client.get_metric_history(run_id, f"train/tests_{kind}"), key=lambda m: m.step)
        assert [m.step for m in hist] == [1, 2, 3, 4] and hist[-1].value == kinds.get(kind, 0), kind
    params, g = run.data.params, trained.cfg.grpo
    assert params["grpo.kl_coefficient"] == str(g.kl_coefficient) and params["trl.beta"] == str(g.kl_coefficient)
    assert float(params["trl.beta"]) > 0  # KL on: TRL keeps a reference
    assert params["trl.num_generations"] == str(g.group_size)
    assert params["trl.per_device_train_batch_size"] == str(g.per_device_batch_size * g.group_size)
    assert params["trl.learning_rate"] == str(g.learning_rate) and params["trl.epsilon"] == str(g.clip_range)
    assert params["train.prompts"] == "40" and params["train.flagged_prompts"] == "0"
    assert all(KEY not in v for v in params.values())
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"adapter", "samples.jsonl", "train_log.jsonl", "config.yaml", "health.json"} <= top
    adapter = {a.path for a in client.list_artifacts(run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= adapter


@pytest.mark.slow
def test_continue_from_adapter(trained, prompt_set, tmp_path, mlflow_store):
    """(b) round N+1 continues the champion: TRL keeps a frozen copy as the KL reference."""
    from hermes_lab.train.grpo import train

    start = trained.res.adapter_dir
    before = _adapter_tensors(start)
    cfg = load_config(
        EMBEDDED_YAML, {"grpo.max_steps": 2, "grpo.environment": "", "round.runs_dir": str(REPO / "runs")}
    )
    res = train(cfg, prompt_set, tmp_path / "train_b", start_adapter=str(start), evaluate_heldout=False)
    assert res.steps == 2
    after = _adapter_tensors(res.adapter_dir)
    assert after.keys() == before.keys()  # the "default" adapter only; the frozen "ref" copy is not saved
    changed = [k for k in after if not (after[k] == before[k]).all()]
    assert changed, "the continued adapter is identical to the start adapter: nothing trained"
    assert _adapter_tensors(start).keys() == before.keys()  # the start adapter on disk is untouched
    assert all((_adapter_tensors(start)[k] == before[k]).all() for k in before)
    steps = _step_rows(tmp_path / "train_b")
    # KL is measured against the start adapter, not the bare base: zero before the first update, although
    # the start adapter has drifted from the base (run (a)'s last step measured that drift)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert _step_rows(trained.out)[-1]["kl"] > 1e-5  # ten times the tolerance of the zero above
    assert json.loads((tmp_path / "train_b" / "run.json").read_text())["start_adapter"] == str(start)
    run = mlflow_store.MlflowClient().get_run(res.mlflow_run_id)
    assert run.data.params["train.start_adapter"] == str(start)


@pytest.mark.slow
def test_users_yaml_as_is_with_fake_judge(
    tiny_policy, prompt_set, tmp_path, monkeypatch, mlflow_store, fake_openai, capfd
):
    """(c) params/hermes_grpo_lora.yaml untouched; the four env vars; only grpo.max_steps=1 overridden."""
    from hermes_lab.train.grpo import train

    fake_openai.api_key = KEY
    monkeypatch.setenv("HERMES_POLICY_MODEL", str(tiny_policy))
    monkeypatch.setenv("TAOTOKEN_BASE_URL", fake_openai.url)
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    monkeypatch.setenv("HERMES_REWARD_MODEL", "judge-1")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERMES_LAB_ROOT", str(tmp_path))  # the user's runs_dir is the project's runs/: tmp_path's
    cfg = load_config(USER_YAML, {"grpo.max_steps": 1})
    t0 = time.time()
    res = train(cfg, prompt_set, tmp_path / "train_c", evaluate_heldout=False)
    print(f"train (c): user's YAML, 1 step x 8 micro-batches in {time.time() - t0:.1f} s")
    assert res.steps == 1
    assert (res.adapter_dir / "adapter_config.json").is_file()
    acfg = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert set(acfg["target_modules"]) == {"q_proj", "v_proj", "k_proj", "o_proj"} and acfg["lora_dropout"] == 0.05
    chats = [r for r in fake_openai.requests if r.path == "/v1/chat/completions"]
    assert chats, "the comparison reward never reached the judge"
    assert all(r.headers["authorization"] == f"Bearer {KEY}" and r.body["model"] == "judge-1" for r in chats)
    assert (tmp_path / "runs" / "cache" / "judge.jsonl").is_file()
    (row,) = _step_rows(tmp_path / "train_c")
    assert PER_STEP_KEYS | {"rewards/comparison/mean"} <= set(row)
    assert 0 <= row["rewards/comparison/mean"] <= 5
    params = mlflow_store.MlflowClient().get_run(res.mlflow_run_id).data.params
    assert params["trl.gradient_accumulation_steps"] == "8" and params["trl.per_device_train_batch_size"] == "16"
    assert params["reward.model"] == "judge-1" and params["model.base_model"] == str(tiny_policy)
    assert all(KEY not in v for v in params.values())
    printed = capfd.readouterr()
    assert KEY not in printed.out + printed.err
    for f in (tmp_path / "train_c").rglob("*"):
        if f.is_file() and f.suffix in {".json", ".jsonl", ".yaml"}:
            assert KEY not in f.read_text(errors="ignore"), f


@pytest.mark.slow
def test_nan_reward_stops_training_with_diagnosis(tiny_policy, prompt_set, tmp_path, monkeypatch, mlflow_store):
    """(d) a user reward returning NaN stops training at the first step, with the diagnosis."""
    from hermes_lab.rewards.registry import RewardError
    from hermes_lab.train.grpo import train

    mod = f"nan_reward_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{mod}.py").write_text(
        "import math\n"
        "def flaky(prompts, completions, **kw):\n"
        "    return [math.nan if i == 3 else 1.0 for i in range(len(completions))]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        EMBEDDED_YAML,
        {
            "grpo.max_steps": 3,
            "grpo.environment": "",
            "reward.types": ["system", f"{mod}:flaky"],
            "reward.weights": [1.0, 1.0],  # the embedded file weighs its three types
            "round.runs_dir": str(REPO / "runs"),
        },
    )
    with pytest.raises(RewardError, match="reward 'flaky' returned nan.*poisons the GRPO advantage"):
        train(cfg, prompt_set, tmp_path / "train_d", evaluate_heldout=False)
    assert not (tmp_path / "train_d" / "adapter").exists()
    runs = mlflow_store.search_runs(experiment_names=["hermes-lab"], output_format="list")
    assert [r.info.status for r in runs] == ["FAILED"]


# ================================================================================ hardening (issue 16)
@pytest.mark.slow
def test_judge_faults_are_per_sample_in_a_real_training(tiny_policy, prompt_set, tmp_path, monkeypatch, fake_openai):
    """A 429 after the retries, or an unparsable reply, used to raise out of the reward function and end training:
    now each fails its own sample, is counted in health.json and the train log, and only a failure share past
    reward.max_judge_failure_rate stops training, with health.json saying why."""
    from hermes_lab.rewards.registry import RewardError
    from hermes_lab.train.grpo import train

    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    judge = {
        "reward.model": "judge-1",
        "reward.base_url": fake_openai.url,
        "reward.judge_retries": 0,
        "model.base_model": str(tiny_policy),
    }
    fake_openai.fail_429 = 6  # the first six judge requests are rate-limited (no retries left)
    cfg = load_config(
        EMBEDDED_YAML,
        {
            **judge,
            "grpo.max_steps": 2,
            "grpo.environment": "",
            "reward.max_judge_failure_rate": 0.6,
            "round.runs_dir": str(tmp_path / "r1"),
        },
    )
    res = train(cfg, prompt_set, tmp_path / "ok", evaluate_heldout=False)
    assert res.steps == 2
    health = json.loads((tmp_path / "ok" / "health.json").read_text())
    j = health["judge"]
    assert health["status"] == "completed" and j["judge_failed_requests"] == 6 and health["judge_failures"] >= 6
    assert j["judge_samples"] == 2 * 4 * 8 and j["imputed_from_group"] + j["system_reward_only"] == j["judge_failures"]
    assert health["judge_requests"] == j["judge_requests"] > 6 and j["by_kind"] == {
        "ApiStatusError": j["judge_failures"]
    }
    rows = _step_rows(tmp_path / "ok")
    assert rows[-1]["judge_failures"] == j["judge_failures"] and all("rewards/comparison/mean" in r for r in rows)

    fake_openai.chat_reply = "I cannot say."  # every judgement unparsable: past the limit at the first step
    cfg = load_config(
        EMBEDDED_YAML, {**judge, "grpo.max_steps": 2, "grpo.environment": "", "round.runs_dir": str(tmp_path / "r2")}
    )
    with pytest.raises(RewardError, match=r"judge failed on (\d+) of the last \1 samples.*max_judge_failure_rate 20%"):
        train(cfg, prompt_set, tmp_path / "stop", evaluate_heldout=False)
    health = json.loads((tmp_path / "stop" / "health.json").read_text())
    assert health["status"] == "stopped" and "max_judge_failure_rate" in health["error"]
    assert health["judge"]["by_kind"] == {"JudgeParseError": 32} and KEY not in json.dumps(health)


@pytest.mark.slow
def test_a_killed_training_resumes_from_its_last_checkpoint(tiny_policy, prompt_set, tmp_path, monkeypatch, capsys):
    """SIGKILL after a checkpoint, then --resume: training continues from that step (not from 0) and ends at
    max_steps, with one train_log row per step and the same MLflow run."""
    import signal

    import mlflow

    from hermes_lab.train.state import RESUME_FILE, last_checkpoint

    uri = mlflow_db(tmp_path / "mlflow.db")
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment("hermes-lab", artifact_location=(tmp_path / "mlartifacts").as_uri())
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "hermes_lab.train", "--config", str(EMBEDDED_YAML), "--data", str(prompt_set)]
    argv += ["--output", str(out), "--max-steps", "6", "--no-eval", "--set", "grpo.save_steps=2"]
    argv += ["--set", "grpo.environment="]  # the prompt phase's checkpoints are what is resumed here
    argv += ["--set", f"model.base_model={tiny_policy}", "--set", f"round.runs_dir={tmp_path}"]
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1")
    first = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and first.poll() is None:
            steps = [r["step"] for r in _step_rows(out)] if (out / "train_log.jsonl").exists() else []
            if (out / "trl" / "checkpoint-2" / "trainer_state.json").exists() and steps and max(steps) >= 3:
                break
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # no cleanup, no final save: a killed kernel
    finally:
        first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    ckpt = last_checkpoint(out / "trl")
    k = int(ckpt.name.split("-")[1])
    assert 2 <= k < 6 and not (out / "adapter").exists()
    run_id = json.loads((out / "trl" / RESUME_FILE).read_text())["mlflow_run_id"]

    second = subprocess.run(argv + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from the checkpoint at step {k}" in second.stdout and f"checkpoint-{k}" in second.stderr
    assert [r["step"] for r in _step_rows(out)] == list(range(1, 7))  # steps 1..k from the first run, then the rest
    state = json.loads((out / "trl" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 6
    health = json.loads((out / "health.json").read_text())
    assert health["status"] == "completed" and health["resumed_from_step"] == k and health["steps"] == 6
    assert json.loads((out / "run.json").read_text())["mlflow_run_id"] == run_id  # the same MLflow run continued
    client = mlflow.MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(run_id, "train/reward")} >= set(range(k + 1, 7))
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # a resume with other settings is refused, naming what changed: the same command's entry point in this
    # process (it refuses before any training; a third interpreter would only import torch and transformers again)
    from hermes_lab.train.grpo import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    capsys.readouterr()
    assert main(argv[3:] + ["--resume", "--set", "grpo.learning_rate=0.01"]) == 1
    err = capsys.readouterr().err
    assert "grpo.learning_rate" in err and "other settings" in err, err


# ========================================================================================= torchrun
@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
    reason="torchrun is not installed next to this Python",
)
def test_torchrun_two_processes_on_cpu(tiny_policy, prompt_set, tmp_path):
    """``torchrun --nproc_per_node 2 -m hermes_lab.train`` on CPU (gloo): it completes, and only the main
    process writes the adapter, train_log.jsonl and the MLflow run."""
    cfg = yaml.safe_load(EMBEDDED_YAML.read_text())
    cfg["model"]["base_model"] = str(tiny_policy)
    cfg["grpo"]["per_device_batch_size"] = 2  # 2 prompts x 8 per process: 4 prompts a step in all
    cfg["grpo"]["environment"] = ""  # the episode phase is single-process
    (tmp_path / "dist.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MLFLOW_TRACKING_URI=mlflow_db(tmp_path / "mlflow.db"),
        TAOTOKEN_API_KEY=KEY,
    )
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.create_experiment("hermes-lab", artifact_location=(tmp_path / "mlartifacts").as_uri())
    torchrun = str(Path(sys.executable).parent / "torchrun")
    t0 = time.time()
    p = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            "-m",
            "hermes_lab.train",
            "--config",
            str(tmp_path / "dist.yaml"),
            "--data",
            str(prompt_set),
            "--output",
            str(tmp_path / "out"),
            "--max-steps",
            "2",
            "--no-eval",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    print(f"torchrun x2: {time.time() - t0:.1f} s")
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.count("adapter: ") == 1, p.stdout  # only rank 0 reports
    out = tmp_path / "out"
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    steps = _step_rows(out)
    assert [r["step"] for r in steps] == [1, 2]  # one line a step, not one per process
    assert steps[-1]["epoch"] == pytest.approx(2 * 2 * 2 / 40)  # data-parallel: 2 processes x 2 prompts a step
    runs = mlflow.search_runs(experiment_names=["hermes-lab"], output_format="list")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "train/reward")) == [
        1,
        2,
    ]
    assert KEY not in p.stdout + p.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
