"""hermes_lab.evaluate.validate: the regression gate's decision, its inputs, MLflow records, and -- on the real tiny
policy -- an untouched LoRA adapter passing and a deliberately broken one being stopped (function, CLI,
``python -m`` and the papermill notebook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.kernels import manager
from hermes_lab.evaluate import validate as V
from hermes_lab.policy import arms as A
from hermes_lab.round.stages import stage
from hermes_lab.tasks import suite as T

from conftest import mlflow_db
from repo_paths import REPO


def arms(cells: dict[str, tuple[int, int, int, int]]) -> tuple[dict, dict]:
    """Two evaluate_arm()-shaped results from paired counts per family: (both pass, lost, gained, both fail).
    lost = baseline passed and candidate failed on the same (task, sample); gained the reverse."""
    base, cand, fams, ids = [], [], [], []
    for f, (both, lost, gained, neither) in cells.items():
        for b, c, k in ((5.0, 5.0, both), (5.0, 1.0, lost), (1.0, 5.0, gained), (1.0, 1.0, neither)):
            base += [b] * k
            cand += [c] * k
            fams += [f] * k
    ids = [f"t-{i}" for i in range(len(fams))]

    def arm(scores):
        pr = lambda xs: sum(x >= 3 for x in xs) / len(xs)  # noqa: E731
        per = {f: [x for x, g in zip(scores, fams) if g == f] for f in cells}
        return {
            "pass_rate": pr(scores),
            "mean_reward": sum(scores) / len(scores),
            "n": len(scores),
            "per_family": {
                f: {"pass_rate": pr(v), "mean_reward": sum(v) / len(v), "n": len(v)} for f, v in per.items()
            },
            "scores": scores,
            "task_ids": ids,
            "families": fams,
        }

    return arm(base), arm(cand)


CFG = load_config(None)


# ------------------------------------------------------------------------------------------- decision
def test_identical_arms_pass_and_the_bound_is_tango_s():
    b, c = arms({"add": (40, 0, 0, 60), "sort": (60, 0, 0, 40)})
    rep = V.compare(b, c, CFG)
    assert rep["passed"] and rep["reasons"] == []
    # no discordant pair: Tango's bound solves n d / (1 - d) = z^2, i.e. d = z^2 / (n + z^2)
    z2 = 1.6448536**2
    assert rep["per_family"]["add"]["drop_ucb"] == pytest.approx(z2 / (100 + z2), abs=1e-6)
    assert rep["overall"]["drop_ucb"] == pytest.approx(z2 / (200 + z2), abs=1e-6)


def test_one_family_dropping_10_points_stops_even_when_overall_rises():
    b, c = arms({"add": (30, 2, 22, 46), "sort": (50, 12, 2, 36), "tool": (50, 0, 0, 50)})  # sort -10
    rep = V.compare(b, c, CFG)
    assert not rep["passed"]
    assert len(rep["reasons"]) == 1 and rep["reasons"][0].startswith("family 'sort'")
    assert rep["per_family"]["sort"]["regressed"] and not rep["per_family"]["add"]["regressed"]
    assert rep["per_family"]["sort"]["delta"] == pytest.approx(-0.1) and rep["overall"]["delta"] > 0


def test_a_small_set_no_longer_passes_a_real_drop_and_says_it_is_too_small():
    # issue #14: 20 pairs, a true 10-point drop: the old "stop only if significant" gate let this through
    b, c = arms({"add": (8, 3, 1, 8)})
    rep = V.compare(b, c, CFG)
    assert not rep["passed"] and rep["per_family"]["add"]["drop_ucb"] > 0.1
    assert rep["warnings"] and "too few" in rep["warnings"][0] and "eval_tasks_per_family" in rep["warnings"][0]
    # the same candidate on 10x the pairs, with few discordant ones: the bound is tight, and no warning
    b, c = arms({"add": (400, 6, 6, 588)})
    rep = V.compare(b, c, CFG)
    assert rep["passed"] and not rep["warnings"] and rep["per_family"]["add"]["drop_ucb"] < 0.02


def test_noninferiority_error_rate_at_the_margin_and_pairing_helps():
    """A family that truly dropped by the tolerance passes at most alpha of the time (simulated), and pairing
    (few discordant pairs) gives a tighter bound than the same pass rates unpaired would."""
    rng = np.random.default_rng(0)
    n, tol, alpha = 150, CFG.validate.tolerance, CFG.validate.alpha
    p10, p01 = 0.15 + tol / 2, 0.15 - tol / 2  # drop = p10 - p01 = tolerance exactly
    cnt = rng.multinomial(n, [p10, p01, 1 - p10 - p01], 2000)
    passed = [V.drop_upper_bound(a, b, n, alpha) < tol for a, b in cnt[:400, :2]]
    assert np.mean(passed) <= alpha + 0.03
    z = V._tango_z(cnt[:, 0], cnt[:, 1], n, tol)  # the vectorised test the power calculation uses
    assert np.mean(z < -1.6448536) <= alpha + 0.015
    few, many = V.drop_upper_bound(3, 3, 200, alpha), V.drop_upper_bound(40, 40, 200, alpha)
    assert few < many  # the same zero drop, fewer discordant pairs: a tighter bound


def test_tango_restricted_mle_matches_numeric_maximum():
    from scipy.optimize import minimize_scalar

    n10, n01, n, d = 30, 12, 200, 0.05
    n11, n00 = 80, n - 80 - n10 - n01

    def nll(p01):
        p10, rest = p01 + d, 1 - 2 * p01 - d
        return -(n10 * np.log(p10) + n01 * np.log(p01) + (n11 + n00) * np.log(rest))

    p01 = minimize_scalar(nll, bounds=(1e-9, (1 - d) / 2 - 1e-9), method="bounded", options={"xatol": 1e-12}).x
    z = (n10 - n01 - n * d) / np.sqrt(n * (2 * p01 + d * (1 - d)))
    assert float(V._tango_z(n10, n01, n, d)) == pytest.approx(z, rel=1e-6)


def test_power_is_reported_and_grows_with_the_set():
    small = V.gate_power(30, 0.2, 0.05, 0.05, 0.10)
    large = V.gate_power(600, 0.2, 0.05, 0.05, 0.10)
    assert large["stop_if_drop"] >= 0.99 and large["pass_if_equal"] > 0.8
    assert small["pass_if_equal"] < 0.2 < large["pass_if_equal"]
    b, c = arms({"add": (40, 5, 5, 50)})
    row = V.compare(b, c, CFG)["per_family"]["add"]
    assert 0 <= row["pass_if_equal"] <= 1 and row["stop_if_drop"] >= 0.95
    # a candidate that mostly gains is not judged by the disagreement its gains cause: its churn is 2 min(...)
    b, c = arms({"add": (400, 2, 120, 478)})
    rep = V.compare(b, c, CFG)
    assert rep["passed"] and rep["per_family"]["add"]["pass_if_equal"] > 0.9 and not rep["warnings"]


def test_arms_on_different_tasks_stop():
    b, c = arms({"add": (40, 0, 0, 60)})
    rep = V.compare(b, {**c, "task_ids": c["task_ids"][::-1]}, CFG)
    assert not rep["passed"] and "same tasks" in rep["reasons"][0]


def test_stop_exception_carries_the_reasons():
    b, c = arms({"add": (10, 50, 0, 40)})
    rep = V.compare(b, c, CFG)
    V.raise_if_stopped(V.compare(*arms({"add": (400, 0, 0, 600)}), CFG))  # passes: no raise
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
    held = [t for t in T.generate_tasks(60, split="heldout", seed=5) if t.family == "sort"][:6]  # 6 of each family
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
    from hermes_lab.core.state import FlywheelState, state_path

    cfg = load_config(overrides={"round.runs_dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="candidate adapter not found"):
        A.candidate_from_train_dir(tmp_path / "train", cfg)
    adapter = tmp_path / "train" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert A.candidate_from_train_dir(tmp_path / "train", cfg) == ("embedded:tiny", str(adapter))
    (tmp_path / "train" / "run.json").write_text(json.dumps({"base_model": "/m", "adapter": str(adapter)}))
    assert A.candidate_from_train_dir(tmp_path / "train", cfg)[0] == "/m"
    assert A.resolve_baseline_adapter(cfg) is None  # no champion yet: the bare base
    # issue #14: with model.adapter and no champion, both gates compare against model.adapter
    cfg_a = load_config(overrides={"round.runs_dir": str(tmp_path), "model.adapter": "/start"})
    assert A.resolve_baseline(cfg_a) == ("embedded:tiny", "/start")
    from hermes_lab.ab import run as ab_run

    assert ab_run.resolve_arms(cfg_a, tmp_path, candidate=str(adapter))[0] == A.resolve_baseline(cfg_a)
    FlywheelState(champion_adapter="/champ").save(state_path(tmp_path))
    assert A.resolve_baseline_adapter(cfg) == "/champ" and A.resolve_baseline(cfg_a)[1] == "/champ"
    assert A.resolve_baseline_adapter(cfg, str(adapter)) == str(adapter)
    assert A.resolve_baseline_adapter(cfg, str(tmp_path / "train")) == str(adapter)  # a train output dir
    assert ab_run.resolve_arms(cfg_a, tmp_path, candidate=str(adapter))[0] == ("embedded:tiny", "/champ")


def test_report_is_logged_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db(tmp_path / "mlflow.db"))
    from mlflow.tracking import MlflowClient

    from hermes_lab.core import tracking

    base, cand = arms({"add": (20, 40, 0, 40), "sort": (50, 0, 0, 50)})
    rep = {"baseline": base, "candidate": cand, **V.compare(base, cand, CFG)}
    with tracking.stage_run("validate", runs_dir=tmp_path) as run:
        V.log_report(rep)
    r = MlflowClient().get_run(run.info.run_id)
    assert r.data.tags["regression_gate"] == "stopped" and "family 'add'" in r.data.tags["regression_reasons"]
    assert r.data.metrics["validate/regression_add_delta"] == pytest.approx(-0.4)
    assert (
        r.data.metrics["validate/regression_passed"] == 0.0 and r.data.metrics["validate/regression_add_drop_ucb"] > 0.4
    )
    table = V.report_table(rep)
    assert list(table.index) == ["add", "sort", "overall"] and not bool(table.loc["add", "passed"])
    assert {"drop_ucb", "stop_if_drop", "pass_if_equal", "lost", "gained"} <= set(table.columns)


# ------------------------------------------------------------------------------------------- real policy
@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    import shutil

    from hermes_lab.policy.model import build_tiny_policy

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

    from hermes_lab.core.quiet import third_party_deprecations

    with third_party_deprecations():  # PEFT reads a property transformers 5 deprecated: not ours to fix
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base),
            LoraConfig(
                r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "k_proj", "o_proj"], task_type="CAUSAL_LM"
            ),
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
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db(tmp_path / "mlflow.db"))
    params = tmp_path / "params.yaml"
    # 24 tasks x 3 samples = 72 pairs per family: enough for identical outputs to prove a drop < 5 points
    params.write_text(
        f"round:\n  runs_dir: {tmp_path}\nvalidate:\n  eval_tasks_per_family: 24\n  samples_per_task: 3\n"
    )
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
    assert rep["sampling"]["temperature"] == 0.9
    assert rep["baseline"]["n"] == rep["candidate"]["n"] == len(T.FAMILIES) * 72
    assert rep["candidate"]["scores"] == rep["baseline"]["scores"]  # same seeds per (task, sample): exact pairs
    assert all(r["lost"] == r["gained"] == 0 for r in rep["per_family"].values())
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
def test_the_agent_family_is_gated_on_whole_episodes(tiny_base, adapters, store, tmp_path):
    """With the embedded agent family trained (grpo.environment: hermes, workspace tasks on Hermes's tools), its
    held-out episodes are a family of the gate, named ``hermes``: paired (same seeds and tasks in both arms, each
    verified on its own workspace), and a broken adapter is stopped on them too."""
    from hermes_lab.tasks import hermes as H

    # the built-in loop's episodes (agent.runner builtin); the real Hermes Agent's are test_hermes_loop's
    over = {"grpo.environment": H.ENVIRONMENT, "validate.eval_tasks_per_family": 12, "agent.runner": "builtin"}
    cfg = load_config(store, over)
    same = V.regression_gate(cfg, str(tiny_base), str(adapters["identity"]), round_dir=tmp_path / "same")
    assert "agent" not in same["per_family"]
    agent = same["per_family"]["hermes"]
    assert agent["n_pairs"] == 12 * 3 and agent["lost"] == agent["gained"] == 0
    assert 0 < agent["baseline_pass_rate"] == agent["candidate_pass_rate"]  # the base does some tasks with the tools
    assert same["sampling"]["tasks"]["agent_episodes"] == 36
    assert same["candidate"]["families"].count("hermes") == 36
    assert same["candidate"]["per_family"]["hermes"]["n"] == 36
    broken = V.regression_gate(
        cfg, str(tiny_base), str(adapters["broken"]), str(adapters["identity"]), round_dir=tmp_path / "broken"
    )
    row = broken["per_family"]["hermes"]
    assert row["regressed"] and row["candidate_pass_rate"] < row["baseline_pass_rate"]
    assert any(r.startswith("family 'hermes'") for r in broken["reasons"])
    # the gate's held-out tasks are the family's held-out split, every kind among them
    tasks = V.agent_tasks(cfg)
    assert len(tasks) == 12 and {t.kind for t in tasks} == set(H.KINDS)
    assert all(T.split_of(t.question) == "heldout" for t in tasks)
    # a user's own environment: no held-out tasks the gate knows of, so no agent family
    mine = load_config(store, {"grpo.environment": "mypkg.envs:Shop"})
    assert V.agent_tasks(mine) == []


@pytest.mark.slow
def test_python_m_exits_4_when_stopped(tiny_base, adapters, store, tmp_path):
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    store.write_text(store.read_text().replace("samples_per_task: 3", "samples_per_task: 1"))  # a stop needs few
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.evaluate.validate",
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
        timeout=300,
    )
    assert res.returncode == V.EXIT_STOPPED, res.stderr[-2000:]
    assert "regression gate: STOPPED" in res.stderr
    assert json.loads((tmp_path / "out" / "regression.json").read_text())["passed"] is False


def synthetic_round(tmp_path: Path, base: Path, adapter: Path) -> tuple[Path, Path]:
    """runs/round-01 and round-02 train dirs the way train leaves them, with MLflow off (no run id)."""
    from test_inspect import curves, write_log

    for n, seed in ((1, 1), (2, 2)):
        train = tmp_path / f"round-{n:02d}" / "train"
        write_log(train / "train_log.jsonl", curves(seed))
    (train / "run.json").write_text(
        json.dumps({"mlflow_run_id": None, "base_model": str(base), "adapter": str(adapter)})
    )
    params = tmp_path / "params.yaml"
    params.write_text(
        # 8 tasks x 4 samples: identical outputs prove a drop under the wide margin, a wrecked policy's does not
        f"round:\n  runs_dir: {tmp_path}\n"
        "validate:\n  eval_tasks_per_family: 8\n  samples_per_task: 4\n  tolerance: 0.25\n"
    )
    return tmp_path / "round-02", params


@pytest.mark.slow
@pytest.mark.parametrize("which", ["identity", "broken"])
def test_notebook_runs_with_papermill(which, tiny_base, adapters, tmp_path, monkeypatch):
    import papermill as pm
    from mlflow.tracking import MlflowClient

    from hermes_lab.core import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db(tmp_path / "mlflow.db"))
    round_dir, params = synthetic_round(tmp_path, tiny_base, adapters[which])
    exp_id = tracking.setup(tmp_path, "hermes-lab")  # before any client: it points MLflow at this store
    parent = MlflowClient().create_run(exp_id, run_name="round-02").info.run_id
    kwargs = dict(
        parameters={"config_path": str(params), "round_dir": str(round_dir), "parent_run_id": parent},
        kernel_name="python3",
        kernel_manager_class=manager(stage("validate").preload),  # forked, as the round runner starts its kernels
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


def _played(passes: str) -> dict:
    return {
        "pass_rate": passes.count("1") / len(passes),
        "samples_per_task": 1,
        "task_ids": list(range(len(passes))),
        "passes": passes,
    }


def test_the_real_agents_harm_test_stops_only_a_candidate_significantly_worse_for_it():
    """agent.runner hermes: ~100 held-out tasks played once by the real agent cannot show non-inferiority (an equally
    good candidate at 12% churn passed a 5-point margin 35% of the time), so the real agent's pairs stop a candidate
    only when it is significantly worse for it; a few lost tasks more than gained, or a churn that evens out, pass."""
    from hermes_lab.evaluate.played import real_agent_harm

    base = "1" * 58 + "0" * 38
    churned = "0" * 6 + "1" * 52 + "1" * 6 + "0" * 32  # 6 lost, 6 gained: as good, with 12% churn
    gain, harm = real_agent_harm(_played(base), _played(churned), alpha=0.05)
    assert harm is None and gain["gain"] == 0 and gain["changed_tasks"] == 12
    slightly = "0" * 6 + "1" * 52 + "1" * 2 + "0" * 36  # 6 lost, 2 gained: -4.2 points, not significant
    assert real_agent_harm(_played(base), _played(slightly), alpha=0.05)[1] is None
    worse = "0" * 15 + "1" * 43 + "1" * 3 + "0" * 35  # 15 lost, 3 gained: -12.5 points
    gain, harm = real_agent_harm(_played(base), _played(worse), alpha=0.05)
    assert harm is not None and "0.604 -> 0.479 over 96 tasks paired (18 changed)" in harm and gain["gain_hi"] < 0
    # at alpha 0.001 the same drop is no longer significant: the bound moves with validate.alpha
    assert real_agent_harm(_played(base), _played(worse), alpha=0.0001)[1] is None
