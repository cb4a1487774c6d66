"""hermes_lab.evaluate.inspect: curve loading (train_log.jsonl and a real SQLite MLflow store), plots, and every
diagnostic rule on synthetic curves that do and do not have the problem."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.evaluate import curves as C
from hermes_lab.evaluate import inspect as I
from hermes_lab.evaluate import plots as P

N = 60
PNG = b"\x89PNG\r\n\x1a\n"


def curves(seed: int = 0, n: int = N, **override: np.ndarray) -> pd.DataFrame:
    """A healthy GRPO run: reward rises with noise, KL grows slowly with noise, groups have spread."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    cols = {
        "loss": 0.05 + rng.normal(0, 0.01, n),
        "reward": np.linspace(4.0, 7.0, n) + rng.normal(0, 0.25, n),
        "reward_std": np.full(n, 1.2) + rng.normal(0, 0.05, n),
        "rewards/system/mean": np.linspace(2.0, 4.0, n) + rng.normal(0, 0.15, n),
        "rewards/system/std": np.full(n, 0.8),
        "rewards/comparison/mean": np.linspace(2.0, 3.0, n) + rng.normal(0, 0.15, n),
        "rewards/comparison/std": np.full(n, 0.6),
        "kl": np.linspace(0.0, 0.06, n) * np.exp(rng.normal(0, 0.15, n)),
        "frac_reward_zero_std": np.clip(0.25 + rng.normal(0, 0.05, n), 0, 1),
        "entropy": np.linspace(1.2, 0.9, n) + rng.normal(0, 0.02, n),
        "completions/mean_length": 8 + rng.normal(0, 0.5, n),
        "completions/min_length": np.full(n, 3.0),
        "completions/max_length": np.full(n, 16.0),
        "completions/clipped_ratio": np.full(n, 0.05),
        "clip_ratio/low_mean": np.abs(rng.normal(0, 0.01, n)),
        "clip_ratio/high_mean": np.abs(rng.normal(0, 0.01, n)),
        "clip_ratio/region_mean": np.abs(rng.normal(0, 0.02, n)),
        "learning_rate": np.linspace(1e-5, 0, n),
        "grad_norm": 0.5 + np.abs(rng.normal(0, 0.1, n)),
    }
    cols.update(override)
    return pd.DataFrame(cols, index=pd.Index(steps, name="step"))


def rule(diags: list[dict], name: str) -> dict:
    (d,) = [d for d in diags if d["rule"] == name]
    return d


# ------------------------------------------------------------------------------------------- rules
def test_healthy_run_is_ok_on_every_rule():
    for seed in range(5):  # several noise draws: no false alarms on a healthy run
        diags = I.diagnose(curves(seed), reward_max=10)
        assert [d["rule"] for d in diags] == list(I.RULES)
        assert {d["rule"]: d["severity"] for d in diags} == {r: "ok" for r in I.RULES}, diags
        for d in diags:
            assert set(d) == {"rule", "severity", "step", "value", "message", "advice"}


def test_kl_spike_detected_with_step_and_advice():
    kl = curves()["kl"].to_numpy().copy()
    kl[40] = 0.9  # step 41, one batch: KL comes straight back down
    d = rule(I.diagnose(curves(kl=kl)), "kl_spike")
    assert d["severity"] == "warn" and d["step"] == 41 and d["value"] == pytest.approx(0.9)
    assert "isolated" in d["message"]
    assert d["advice"] == "KL spike at step 41: the policy ran off; raise kl_coefficient and rerun."
    kl[41:44] = [0.7, 0.8, 0.6]  # KL stays up: the policy moved away
    d = rule(I.diagnose(curves(kl=kl)), "kl_spike")
    assert d["severity"] == "fail" and d["step"] == 41 and "sustained" in d["message"]
    kl = curves()["kl"].to_numpy().copy()
    kl[-1] = 0.9  # in the last logged step nothing tells it apart: fail
    assert rule(I.diagnose(curves(kl=kl)), "kl_spike")["severity"] == "fail"


def test_kl_level_shift_is_a_spike_but_a_steady_rise_is_not():
    kl = np.concatenate([np.full(30, 0.01), np.full(30, 0.3)]) + np.random.default_rng(1).normal(0, 0.001, N)
    d = rule(I.diagnose(curves(kl=kl)), "kl_spike")
    assert d["severity"] == "fail" and d["step"] == 31
    steady = np.linspace(0, 0.4, N)  # large but smooth: bounded growth, not a spike
    assert rule(I.diagnose(curves(kl=steady)), "kl_spike")["severity"] == "ok"


def test_kl_high_against_the_guard():
    kl = np.linspace(0, 0.8, N)
    d = rule(I.diagnose(curves(kl=kl), kl_warn=0.5), "kl_high")
    assert d["severity"] == "warn" and d["value"] > 0.5 and "kl_coefficient" in d["advice"]
    assert rule(I.diagnose(curves(kl=kl), kl_warn=1.0), "kl_high")["severity"] == "ok"


def test_reward_plateau_and_fall():
    rng = np.random.default_rng(3)
    flat = 5.0 + rng.normal(0, 0.3, N)
    d = rule(I.diagnose(curves(reward=flat), reward_max=10), "reward_rising")
    assert d["severity"] == "warn" and "not rising" in d["message"] and d["advice"]
    falling = np.linspace(7, 4, N) + rng.normal(0, 0.2, N)
    assert rule(I.diagnose(curves(reward=falling)), "reward_rising")["severity"] == "fail"
    saturated = np.full(N, 9.8) + rng.normal(0, 0.05, N)  # already at the ceiling: nothing to rise to
    assert rule(I.diagnose(curves(reward=saturated), reward_max=10), "reward_rising")["severity"] == "ok"


def test_reward_trend_with_too_few_points_warns():
    d = rule(I.diagnose(curves(n=4)), "reward_rising")
    assert d["severity"] == "warn" and "too few" in d["message"]


def test_nan_anywhere_fails_with_first_step_and_columns():
    loss = curves()["loss"].to_numpy().copy()
    loss[11] = np.nan
    gn = curves()["grad_norm"].to_numpy().copy()
    gn[20] = np.inf
    d = rule(I.diagnose(curves(loss=loss, grad_norm=gn)), "nan")
    assert d["severity"] == "fail" and d["step"] == 12
    assert "loss" in d["message"] and "grad_norm" in d["message"] and "outlier" in d["advice"]
    assert rule(I.diagnose(curves()), "nan")["severity"] == "ok"


def test_zero_reward_spread_groups():
    d = rule(I.diagnose(curves(frac_reward_zero_std=np.full(N, 0.95)), zero_std_warn=0.8), "zero_std_groups")
    assert d["severity"] == "warn" and "raise temperature" in d["advice"] and d["value"] == pytest.approx(0.95)
    d = rule(I.diagnose(curves(frac_reward_zero_std=np.ones(N))), "zero_std_groups")
    assert d["severity"] == "fail"  # no group ever had spread: no learning signal at all
    assert rule(I.diagnose(curves(frac_reward_zero_std=np.full(N, 0.3))), "zero_std_groups")["severity"] == "ok"


def test_reward_outlier_on_a_rising_curve():
    r = curves()["reward"].to_numpy().copy()
    r[30] += 6.0  # step 31
    d = rule(I.diagnose(curves(reward=r), reward_max=10), "reward_outliers")
    assert d["severity"] == "warn" and d["step"] == 31 and "normalise" in d["advice"]
    fn = curves()["rewards/system/mean"].to_numpy().copy()
    fn[10] = -20  # an outlier in one reward function only
    d = rule(I.diagnose(curves(**{"rewards/system/mean": fn}), reward_max=10), "reward_outliers")
    assert d["severity"] == "warn" and d["step"] == 11 and "rewards/system/mean" in d["message"]


def test_rules_cope_with_missing_metrics():
    df = curves()[["loss"]]
    diags = I.diagnose(df)
    sev = {d["rule"]: d["severity"] for d in diags}
    assert sev["reward_rising"] == "warn" and "no reward" in rule(diags, "reward_rising")["message"]
    assert all(sev[r] == "ok" for r in ("nan", "kl_spike", "kl_high", "zero_std_groups", "reward_outliers"))


def test_thresholds_come_from_the_config():
    cfg = load_config(overrides={"grpo.kl_warn": 0.01, "validate.kl_spike_k": 100.0})
    df = curves()
    sev = {d["rule"]: d["severity"] for d in I.diagnose_with_config(df, cfg)}
    assert sev["kl_high"] == "warn"  # 0.06 > 0.01


# ------------------------------------------------------------------------------------------- loading
def write_log(path, df: pd.DataFrame, extra: list[str] | None = None) -> None:
    lines = []
    for step, row in df.iterrows():
        rec = {k: float(v) for k, v in row.items()}
        rec["step"] = int(step)
        lines.append(json.dumps(rec))  # NaN is written as NaN, the way json.dumps does
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines + (extra or [])) + "\n", encoding="utf-8")


def test_load_train_log(tmp_path):
    df = curves(n=10)
    log = tmp_path / "train" / "train_log.jsonl"
    # the end-of-training summary shares the last step and has other keys: merged, and not a NaN
    write_log(
        log,
        df,
        extra=[
            json.dumps({"step": 10, "train_runtime": 12.5, "train_loss": 0.04}),
            json.dumps({"step": 11, "reward": None, "note": "text values are ignored"}),
        ],
    )
    got = C.load_train_log(log.parent)  # a dir works as well as the file
    assert list(got.index) == list(range(1, 12)) and got.index.name == "step"
    assert got.loc[10, "train_runtime"] == 12.5
    np.testing.assert_allclose(got.loc[1:10, "reward"], df["reward"])
    assert "note" not in got.columns
    assert got.attrs["nonfinite"] == {"reward": [11]}  # null counts as a NaN that was logged
    d = rule(I.diagnose(got), "nan")
    assert d["severity"] == "fail" and d["step"] == 11


def test_load_train_log_errors_name_file_and_line(tmp_path):
    p = tmp_path / "train_log.jsonl"
    p.write_text('{"step": 1, "reward": 1.0}\n{oops\n')
    with pytest.raises(ValueError, match=r"train_log.jsonl:2: not valid JSON"):
        C.load_train_log(p)
    p.write_text('{"step": 1, "reward": 1.0}\n{"reward": 2.0}\n')
    with pytest.raises(ValueError, match=r"train_log.jsonl:2: no 'step' key"):
        C.load_train_log(p)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        C.load_train_log(tmp_path / "nowhere")


def log_run(mlflow, df: pd.DataFrame, tmp_path) -> str:
    from hermes_lab.core import tracking

    tracking.setup(tmp_path, "test-train")
    with mlflow.start_run(run_name="train") as run:  # the names train.py gives them: train/<TRL name>
        for step, row in df.iterrows():
            mlflow.log_metrics({f"train/{k}": float(v) for k, v in row.items()}, step=int(step))
        mlflow.log_metrics({"train/seconds": 12.0, "train/eval_pass_rate_after": 0.5})  # summaries, not curves
    return run.info.run_id


def test_load_curves_from_mlflow(tmp_path, mlflow_store):
    df = curves(n=8)[["reward", "reward_std", "rewards/system/mean", "kl", "frac_reward_zero_std"]].copy()
    df.loc[5, "kl"] = np.nan
    run_id = log_run(mlflow_store, df, tmp_path)
    got = C.load_mlflow_curves(run_id)
    assert got.attrs["source"] == f"mlflow:{run_id}"
    assert list(got.index) == list(range(1, 9))
    np.testing.assert_allclose(got["rewards/system/mean"], df["rewards/system/mean"])
    assert set(got.columns) == set(df.columns)  # prefix dropped, summaries left out
    assert got.attrs["nonfinite"] == {"kl": [5]}
    # via run.json, as train writes it; MLflow wins over the JSONL when it has the run
    train = tmp_path / "round-01" / "train"
    write_log(train / "train_log.jsonl", curves(n=3, grad_norm=np.array([0.5, np.nan, 0.4])))
    (train / "run.json").write_text(json.dumps({"mlflow_run_id": run_id, "base_model": "x", "adapter": "y"}))
    via = C.load_curves(train, runs_dir=tmp_path)
    assert via.attrs["source"].startswith("mlflow:") and len(via) == 8
    # train's callback sends only finite values to MLflow: the JSONL's NaN must still reach the NaN rule
    assert via.attrs["nonfinite"] == {"kl": [5], "grad_norm": [2]}
    d = rule(I.diagnose(via), "nan")
    assert d["severity"] == "fail" and d["step"] == 2 and "grad_norm" in d["message"]


def test_load_curves_falls_back_to_the_jsonl(tmp_path, mlflow_store):
    train = tmp_path / "train"
    write_log(train / "train_log.jsonl", curves(n=5))
    (train / "run.json").write_text(json.dumps({"mlflow_run_id": "0" * 32}))  # not in this store
    got = C.load_curves(train, runs_dir=tmp_path)
    assert got.attrs["source"].endswith("train_log.jsonl") and len(got) == 5
    assert "MLflow unavailable" in got.attrs["fallback"]
    (train / "run.json").write_text(json.dumps({"mlflow_run_id": None}))
    assert C.load_curves(train, runs_dir=tmp_path).attrs["fallback"] == "no MLflow run id"


def test_earlier_train_dirs(tmp_path):
    for n in (1, 2, 3, 4):
        write_log(tmp_path / f"round-{n:02d}" / "train" / "train_log.jsonl", curves(n=3))
    (tmp_path / "round-05").mkdir()
    got = C.earlier_train_dirs(tmp_path / "round-03")
    assert got == [tmp_path / "round-01" / "train", tmp_path / "round-02" / "train"]
    assert C.round_label(got[0]) == "round-01"


# ------------------------------------------------------------------------------------------- plots + stage
def test_plots_written_as_png_and_logged(tmp_path, mlflow_store):
    from hermes_lab.core import tracking

    df = curves()
    with tracking.stage_run("validate", runs_dir=tmp_path) as run:
        written = P.plot_curves(df, tmp_path / "plots", compare={"round-00": curves(7)}, diagnostics=I.diagnose(df))
    expected = {
        "reward",
        "reward_functions",
        "kl",
        "frac_reward_zero_std",
        "entropy",
        "completion_lengths",
        "clip_ratios",
        "learning_rate",
        "loss_grad_norm",
    }
    assert set(written) == expected
    for p in written.values():
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    arts = {a.path for a in mlflow_store.tracking.MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert arts == {f"plots/{n}.png" for n in expected}
    # a run that logged only the loss: only that panel, no empty figures
    only = P.plot_curves(df[["loss"]], tmp_path / "few")
    assert set(only) == {"loss_grad_norm"}


def test_inspect_run_writes_diagnostics_json(tmp_path, mlflow_store):
    from hermes_lab.core import tracking

    cfg = load_config(overrides={"round.runs_dir": str(tmp_path)})
    kl = curves()["kl"].to_numpy().copy()
    kl[45:] = 1.5  # KL jumps at step 46 and stays up
    write_log(tmp_path / "round-01" / "train" / "train_log.jsonl", curves(3))
    write_log(tmp_path / "round-02" / "train" / "train_log.jsonl", curves(kl=kl))
    train = tmp_path / "round-02" / "train"
    with tracking.stage_run("validate", runs_dir=tmp_path) as run:
        res = I.inspect_run(train, tmp_path / "round-02" / "validate", cfg, compare=C.earlier_train_dirs(train.parent))
    data = json.loads((tmp_path / "round-02" / "validate" / "diagnostics.json").read_text())
    assert data["worst"] == "fail" and data["compared_with"] == ["round-01"] and data["n_steps"] == N
    spike = rule(data["diagnostics"], "kl_spike")
    assert spike["step"] == 46 and "raise kl_coefficient" in spike["advice"]
    assert all(math.isfinite(d["value"]) for d in data["diagnostics"] if d["value"] is not None)
    r = mlflow_store.tracking.MlflowClient().get_run(run.info.run_id)
    assert r.data.tags["diagnostics.worst"] == "fail" and r.data.metrics["validate/diagnostics_fail_count"] >= 1
    assert len(res["plots"]) == 9


def test_cli(tmp_path, mlflow_store, capsys):
    params = tmp_path / "p.yaml"
    params.write_text(f"round:\n  runs_dir: {tmp_path}\n")
    train = tmp_path / "round-01" / "train"
    write_log(train / "train_log.jsonl", curves())
    assert I.main(["--train-dir", str(train), "--params", str(params), "--output", str(tmp_path / "v")]) == 0
    assert "[  ok] kl_spike" in capsys.readouterr().out
    kl = curves()["kl"].to_numpy().copy()
    kl[30:35] = 2.0
    write_log(train / "train_log.jsonl", curves(kl=kl))
    args = ["--train-dir", str(train), "--params", str(params), "--output", str(tmp_path / "v"), "--strict"]
    assert I.main(args) == 3
    assert "KL spike at step 31" in capsys.readouterr().out
