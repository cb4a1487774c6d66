"""hermes_lab.validate: the regression gate's decision, its inputs, MLflow records, and -- on the real tiny
policy -- an untouched LoRA adapter passing and a deliberately broken one being stopped (function, CLI,
``python -m`` and the papermill notebook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_lab import tasks as T
from hermes_lab import validate as V
from hermes_lab.config import load_config

REPO = Path(__file__).resolve().parents[1]


def evaluation(rates: dict[str, float], n: int = 100) -> dict:
    """A policy.evaluate()-shaped result with the given per-family pass rates."""
    per = {f: {"pass_rate": r, "mean_reward": 5 * r, "n": n} for f, r in rates.items()}
    overall = sum(rates.values()) / len(rates)
    return {"pass_rate": overall, "mean_reward": 5 * overall, "n": n * len(rates), "per_family": per}


# ------------------------------------------------------------------------------------------- decision
def test_equal_arms_pass():
    e = evaluation({"add": 0.4, "sort": 0.6})
    rep = V.compare(e, e, tolerance=0.05)
    assert rep["passed"] and rep["reasons"] == []
    assert rep["per_family"]["add"]["delta"] == 0 and rep["overall"]["p_value"] == pytest.approx(0.5)


def test_one_family_beyond_tolerance_stops():
    base = evaluation({"add": 0.40, "sort": 0.60, "tool": 0.50})
    cand = evaluation({"add": 0.50, "sort": 0.50, "tool": 0.50})  # sort -10 points; overall up
    rep = V.compare(base, cand, tolerance=0.05)
    assert not rep["passed"]
    assert len(rep["reasons"]) == 1 and rep["reasons"][0].startswith("family 'sort'")
    assert rep["per_family"]["sort"]["regressed"] and not rep["per_family"]["add"]["regressed"]
    assert rep["per_family"]["sort"]["delta"] == pytest.approx(-0.1)


def test_drop_within_tolerance_passes_and_the_boundary_is_allowed():
    base = evaluation({"add": 0.40, "sort": 0.60})
    assert V.compare(base, evaluation({"add": 0.37, "sort": 0.60}), tolerance=0.05)["passed"]
    assert V.compare(base, evaluation({"add": 0.35, "sort": 0.60}), tolerance=0.05)["passed"]  # exactly -tol
    assert not V.compare(base, evaluation({"add": 0.34, "sort": 0.60}), tolerance=0.05)["passed"]


def test_overall_drop_stops_even_when_no_family_is_beyond():
    base = {"pass_rate": 0.5, "mean_reward": 2.5, "n": 100, "per_family": {}}
    cand = {"pass_rate": 0.4, "mean_reward": 2.0, "n": 100, "per_family": {}}
    rep = V.compare(base, cand, tolerance=0.05)
    assert not rep["passed"] and rep["reasons"][0].startswith("overall")


def test_require_significance_spares_a_noisy_small_sample():
    base, cand = evaluation({"add": 0.5}, n=10), evaluation({"add": 0.4}, n=10)
    assert not V.compare(base, cand, tolerance=0.05)["passed"]  # the tolerance rule alone
    rep = V.compare(base, cand, tolerance=0.05, require_significance=True)
    assert rep["passed"] and rep["per_family"]["add"]["beyond_tolerance"]
    big_b, big_c = evaluation({"add": 0.5}, n=2000), evaluation({"add": 0.4}, n=2000)
    assert not V.compare(big_b, big_c, tolerance=0.05, require_significance=True)["passed"]


def test_family_missing_in_one_arm_stops():
    rep = V.compare(evaluation({"add": 0.5, "sort": 0.5}), evaluation({"add": 0.5}))
    assert not rep["passed"] and "only one arm" in rep["reasons"][0]


def test_two_proportion_test_matches_statsmodels():
    from statsmodels.stats.proportion import proportions_ztest

    z, p = V.two_proportion_test(60, 100, 45, 100)
    zs, ps = proportions_ztest([45, 60], [100, 100], alternative="smaller")
    assert z == pytest.approx(zs) and p == pytest.approx(ps)
    assert V.two_proportion_test(0, 50, 0, 50) == (0.0, 1.0)


def test_stop_exception_carries_the_reasons():
    rep = V.compare(evaluation({"add": 0.9}), evaluation({"add": 0.1}))
    V.raise_if_stopped(V.compare(evaluation({"add": 0.5}), evaluation({"add": 0.5})))  # passes: no raise
    with pytest.raises(V.RegressionGateStop, match="family 'add'") as ei:
        V.raise_if_stopped(rep)
    assert ei.value.report is rep


# ------------------------------------------------------------------------------------------- inputs
def test_generated_regression_set_is_held_out_and_balanced():
    cfg = load_config(overrides={"validate.eval_tasks_per_family": 20})
    tasks, note = V.regression_tasks(cfg)
    assert note["per_family"] == {f: 20 for f in T.FAMILIES} and note["heldout_dataset"] is None
    assert all(T.split_of(t.prompt) == "heldout" for t in tasks)
    assert note["repeated"] > 0  # 'tool' has fewer than 20 distinct held-out prompts
    assert V.regression_tasks(cfg)[0] == tasks  # deterministic: both arms and reruns see the same set


def test_regression_set_from_prep_heldout_dataset(tmp_path):
    from datasets import Dataset

    cfg = load_config(overrides={"validate.eval_tasks_per_family": 4})
    held = [t for t in T.generate_tasks(30, split="heldout", seed=5) if t.family == "sort"][:6]
    prompts = [t.prompt for t in held] + [held[0].prompt, "not one of our prompts"]
    chat = [[{"role": "user", "content": held[1].prompt}]]
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts] + chat})
    path = tmp_path / "round-01" / "prep" / "heldout_dataset"
    ds.save_to_disk(str(path))
    tasks, note = V.regression_tasks(cfg, round_dir=tmp_path / "round-01")
    assert note["heldout_dataset"] == str(path) and note["from_dataset"] == 6 and note["unknown_prompts"] == 1
    assert {t.prompt for t in held} <= {t.prompt for t in tasks}
    assert note["per_family"]["sort"] == 6 and note["per_family"]["add"] == 4  # topped up, not cut
    Dataset.from_dict({"text": ["x"]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        V.regression_tasks(cfg, heldout_dir=tmp_path / "bad")


def test_candidate_and_baseline_resolution(tmp_path):
    from hermes_lab.state import FlywheelState, state_path

    cfg = load_config(overrides={"round.runs_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="candidate adapter not found"):
        V.candidate_from_train_dir(tmp_path / "train", cfg)
    adapter = tmp_path / "train" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert V.candidate_from_train_dir(tmp_path / "train", cfg) == ("embedded:tiny", str(adapter))
    (tmp_path / "train" / "run.json").write_text(json.dumps({"base_model": "/m", "adapter": str(adapter)}))
    assert V.candidate_from_train_dir(tmp_path / "train", cfg)[0] == "/m"
    assert V.resolve_baseline_adapter(cfg) is None  # no champion yet: the bare base
    FlywheelState(champion_adapter="/champ").save(state_path(tmp_path))
    assert V.resolve_baseline_adapter(cfg) == "/champ"
    assert V.resolve_baseline_adapter(cfg, "/explicit") == "/explicit"


def test_report_is_logged_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    from mlflow.tracking import MlflowClient

    from hermes_lab import tracking

    base, cand = evaluation({"add": 0.6, "sort": 0.5}), evaluation({"add": 0.2, "sort": 0.5})
    rep = {
        "passed": False,
        "baseline": base,
        "candidate": cand,
        **{k: v for k, v in V.compare(base, cand).items() if k != "passed"},
    }
    with tracking.stage_run("validate", runs_dir=tmp_path) as run:
        V.log_report(rep)
    r = MlflowClient().get_run(run.info.run_id)
    assert r.data.tags["regression_gate"] == "stopped" and "family 'add'" in r.data.tags["regression_reasons"]
    assert r.data.metrics["validate/regression_add_delta"] == pytest.approx(-0.4)
    assert r.data.metrics["validate/regression_passed"] == 0.0
    table = V.report_table(rep)
    assert list(table.index) == ["add", "sort", "overall"] and bool(table.loc["add", "regressed"])


# ------------------------------------------------------------------------------------------- real policy
@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    import shutil

    from hermes_lab.policy import build_tiny_policy

    # Built once (~1-2 min) in the shared cache under the repo's runs/ (git-ignored), then copied: a
    # rebuild of the shared cache by another process must not pull the model away mid-test.
    dest = tmp_path_factory.mktemp("policy") / "tiny"
    for _attempt in range(3):
        try:
            shutil.copytree(build_tiny_policy(REPO / "runs", seed=0, quiet=True), dest)
            return dest
        except (FileNotFoundError, shutil.Error):
            shutil.rmtree(dest, ignore_errors=True)
    raise RuntimeError("could not copy the tiny policy out of runs/policies")


def make_adapter(base: Path, out: Path, broken: bool) -> Path:
    """A LoRA adapter on the tiny policy: lora_B zero (PEFT's init) is the identity; large random lora_B
    is a broken adapter that wrecks the policy, the way a diverged training run would."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "k_proj", "o_proj"], task_type="CAUSAL_LM"),
    )
    if broken:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_base, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("adapters")
    return {
        "identity": make_adapter(tiny_base, d / "identity", False),
        "broken": make_adapter(tiny_base, d / "broken", True),
    }


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    params = tmp_path / "params.yaml"
    params.write_text(f"round:\n  runs_dir: {tmp_path}\nvalidate:\n  eval_tasks_per_family: 24\n")
    return params


@pytest.mark.slow
def test_cli_passes_an_untouched_adapter(tiny_base, adapters, store, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "round-01" / "validate"
    rc = V.main(
        [
            "--base",
            str(tiny_base),
            "--candidate-adapter",
            str(adapters["identity"]),
            "--params",
            str(store),
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    rep = json.loads((out / "regression.json").read_text())
    assert rep["passed"] and rep["reasons"] == []
    assert rep["baseline"]["adapter"] is None  # no champion: the bare base is the baseline
    assert rep["candidate"]["pass_rate"] == rep["baseline"]["pass_rate"] > 0
    assert rep["sampling"]["temperature"] == 0.9 and rep["baseline"]["n"] == rep["candidate"]["n"] == 5 * 24
    assert set(rep["per_family"]) == set(T.FAMILIES)
    (run,) = MlflowClient().search_runs([MlflowClient().get_experiment_by_name("hermes-lab").experiment_id])
    assert run.data.tags["regression_gate"] == "passed" and run.data.metrics["validate/regression_delta"] == 0.0


@pytest.mark.slow
def test_gate_stops_a_broken_adapter(tiny_base, adapters, store, tmp_path):
    cfg = load_config(store)
    rep = V.regression_gate(
        cfg, str(tiny_base), str(adapters["broken"]), adapters["identity"].as_posix(), round_dir=tmp_path / "round-01"
    )
    assert not rep["passed"] and rep["reasons"]
    assert rep["candidate"]["pass_rate"] < rep["baseline"]["pass_rate"] - cfg.validate.tolerance
    saved = json.loads((tmp_path / "round-01" / "validate" / "regression.json").read_text())
    assert saved["reasons"] == rep["reasons"] and saved["passed"] is False
    assert saved["baseline"]["adapter"] == adapters["identity"].as_posix()
    with pytest.raises(V.RegressionGateStop):
        V.raise_if_stopped(rep)


@pytest.mark.slow
def test_python_m_exits_4_when_stopped(tiny_base, adapters, store, tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.validate",
            "--base",
            str(tiny_base),
            "--candidate-adapter",
            str(adapters["broken"]),
            "--params",
            str(store),
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == V.EXIT_STOPPED, res.stderr[-2000:]
    assert "regression gate: STOPPED" in res.stderr
    assert json.loads((tmp_path / "out" / "regression.json").read_text())["passed"] is False


def synthetic_round(tmp_path: Path, base: Path, adapter: Path) -> tuple[Path, Path]:
    """runs/round-01 and round-02 train dirs the way train leaves them, with MLflow off (no run id)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_inspect import curves, write_log

    for n, seed in ((1, 1), (2, 2)):
        train = tmp_path / f"round-{n:02d}" / "train"
        write_log(train / "train_log.jsonl", curves(seed))
    (train / "run.json").write_text(
        json.dumps({"mlflow_run_id": None, "base_model": str(base), "adapter": str(adapter)})
    )
    params = tmp_path / "params.yaml"
    params.write_text(f"round:\n  runs_dir: {tmp_path}\nvalidate:\n  eval_tasks_per_family: 16\n")
    return tmp_path / "round-02", params


@pytest.mark.slow
@pytest.mark.parametrize("which", ["identity", "broken"])
def test_notebook_runs_with_papermill(which, tiny_base, adapters, tmp_path, monkeypatch):
    import papermill as pm
    from mlflow.tracking import MlflowClient

    from hermes_lab import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    round_dir, params = synthetic_round(tmp_path, tiny_base, adapters[which])
    exp_id = tracking.setup(tmp_path, "hermes-lab")  # before any client: it points MLflow at this store
    parent = MlflowClient().create_run(exp_id, run_name="round-02").info.run_id
    kwargs = dict(
        parameters={"config_path": str(params), "round_dir": str(round_dir), "parent_run_id": parent},
        kernel_name="python3",
        cwd=str(REPO),
        progress_bar=False,
    )
    out_nb = tmp_path / "30.ipynb"
    if which == "identity":
        pm.execute_notebook(str(REPO / "notebooks" / "30_inspect_validate.ipynb"), str(out_nb), **kwargs)
    else:
        with pytest.raises(pm.PapermillExecutionError, match="RegressionGateStop"):
            pm.execute_notebook(str(REPO / "notebooks" / "30_inspect_validate.ipynb"), str(out_nb), **kwargs)
    val = round_dir / "validate"
    diag = json.loads((val / "diagnostics.json").read_text())
    assert diag["compared_with"] == ["round-01"] and diag["source"].endswith("train_log.jsonl")
    assert len(list((val / "plots").glob("*.png"))) == 9
    rep = json.loads((val / "regression.json").read_text())
    assert rep["passed"] is (which == "identity")
    client = MlflowClient()
    (child,) = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert child.info.status == "FINISHED"  # closed before the stop failed the notebook
    assert child.data.tags["regression_gate"] == ("passed" if which == "identity" else "stopped")
    assert {a.path for a in client.list_artifacts(child.info.run_id)} >= {
        "plots",
        "diagnostics.json",
        "regression.json",
    }
