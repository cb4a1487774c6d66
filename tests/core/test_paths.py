"""hermes_lab.core.paths: one project root whatever the cwd, so one runs/ (issue 16), and notebooks whose path
parameters resolve against it (issue 15: JupyterLab starts kernels in notebooks/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from hermes_lab.config.schema import ConfigError, load_config
from hermes_lab.core import paths

from repo_paths import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _project(d: Path) -> Path:
    (d / "params").mkdir(parents=True)
    (d / "notebooks").mkdir()
    return d


def test_project_root_order(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.ENV_ROOT, raising=False)
    proj = _project(tmp_path / "proj")
    deep = proj / "notebooks" / "sub"
    deep.mkdir()
    monkeypatch.chdir(deep)
    assert paths.project_root() == proj  # the nearest ancestor that looks like the project
    monkeypatch.setenv(paths.ENV_ROOT, str(tmp_path / "elsewhere"))
    assert paths.project_root() == tmp_path / "elsewhere"  # the env var wins
    monkeypatch.delenv(paths.ENV_ROOT)
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)
    assert paths.project_root() == paths.PACKAGE_REPO == REPO  # the checkout holding the package
    monkeypatch.setattr(paths, "PACKAGE_REPO", tmp_path / "not-a-project")
    assert paths.project_root() == outside  # nothing looks like the project: the cwd
    pp = tmp_path / "pp"
    pp.mkdir()
    (pp / "pyproject.toml").write_text('[project]\nname = "hermes-lab"\n')
    monkeypatch.chdir(pp)
    assert paths.project_root() == pp  # a pyproject.toml naming hermes-lab also marks the root


def test_resolve_config_file_and_specs(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.ENV_ROOT, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert paths.resolve("/abs/x") == Path("/abs/x")
    assert paths.resolve("runs/../runs/review") == tmp_path / "runs" / "review"
    other = tmp_path / "cwd"
    other.mkdir()
    monkeypatch.chdir(other)
    (tmp_path / "c.yaml").write_text("{}")
    assert paths.config_file("c.yaml") == tmp_path / "c.yaml"  # not in the cwd: the root's
    (other / "c.yaml").write_text("{}")
    assert paths.config_file("c.yaml") == other / "c.yaml"  # in the cwd: the cwd's wins
    (tmp_path / "runs" / "round-01").mkdir(parents=True)
    assert paths.resolve_spec("runs/round-01") == str(tmp_path / "runs" / "round-01")
    for keep in ("embedded:tiny", "champion", "Qwen/Qwen2.5-0.5B-Instruct", "", "s3://b/k"):
        assert paths.resolve_spec(keep) == keep
    assert paths.resolve_spec("./new-dir") == str(tmp_path / "new-dir")


def test_resolve_params_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.ENV_ROOT, str(tmp_path))
    run_id = "0123456789abcdef0123456789abcdef"
    ns = {
        "config_path": "params/embedded.yaml",
        "round_dir": "runs/round-02",
        "queue_path": "",
        "trajectories": "a.jsonl, /abs/b.jsonl",
        "compare_rounds": f"runs/round-01/train,{run_id}",
        "baseline": "champion",
        "candidate": "embedded:tiny",
        "adapter": "./ckpt",
        "seed": 3,
        "reviewer": "runs/not-a-path-parameter",
    }
    changed = paths.resolve_params(ns)
    assert ns["config_path"] == str(tmp_path / "params" / "embedded.yaml")
    assert ns["round_dir"] == str(tmp_path / "runs" / "round-02")
    assert ns["trajectories"] == f"{tmp_path / 'a.jsonl'},/abs/b.jsonl"
    assert ns["compare_rounds"] == f"{tmp_path / 'runs/round-01/train'},{run_id}"
    assert ns["adapter"] == str(tmp_path / "ckpt")
    assert (ns["queue_path"], ns["baseline"], ns["candidate"], ns["seed"]) == ("", "champion", "embedded:tiny", 3)
    assert ns["reviewer"] == "runs/not-a-path-parameter"
    assert set(changed) == {"config_path", "round_dir", "trajectories", "compare_rounds", "adapter"}


def test_load_config_resolves_against_the_root(project_copy, monkeypatch):
    monkeypatch.delenv(paths.ENV_ROOT, raising=False)
    monkeypatch.chdir(project_copy / "notebooks")  # where JupyterLab starts a notebook's kernel
    cfg = load_config("params/embedded.yaml")
    assert cfg.source == str(project_copy / "params" / "embedded.yaml")
    assert cfg.round.runs_dir == str(project_copy / "runs")
    cfg = load_config(overrides={"round.runs_dir": "elsewhere/runs", "model.adapter": "./a"})
    assert cfg.round.runs_dir == str(project_copy / "elsewhere" / "runs")
    assert cfg.model.adapter == str(project_copy / "a")
    assert load_config(overrides={"round.runs_dir": "/abs/runs"}).round.runs_dir == "/abs/runs"
    with pytest.raises(ConfigError, match=r"config file not found: nope.yaml \(looked in .* project root"):
        load_config("nope.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_config_cell_runs_with_notebooks_as_cwd(path, project_copy, monkeypatch):
    """Issue 15: each notebook's parameters cell and config cell, default parameters, kernel cwd notebooks/
    (as JupyterLab starts it), no HERMES_LAB_ROOT: paths resolve inside the project, not in notebooks/."""
    from nbclient import NotebookClient

    from hermes_lab.core import quiet

    monkeypatch.delenv(paths.ENV_ROOT, raising=False)
    nb = nbformat.read(project_copy / "notebooks" / path.name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"][:2]
    probe = nbformat.v4.new_code_cell(
        "import json\nprint(json.dumps({'config': config_path, 'round_dir': round_dir, "
        "'runs_dir': cfg.round.runs_dir, 'source': cfg.source}))"
    )
    nb.cells = [*code, probe]
    client = NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(project_copy / "notebooks")}},
        config=quiet.kernel_config(),
    )
    client.execute()
    out = json.loads(nb.cells[-1].outputs[0]["text"])
    assert out["config"] == out["source"] == str(project_copy / "params" / "embedded.yaml")
    assert out["runs_dir"] == str(project_copy / "runs")
    assert out["round_dir"] in ("", str(project_copy / "runs" / "round-01"))
    assert not (project_copy / "notebooks" / "runs").exists()


def write_trajectories(path: Path, n: int = 520, seed: int = 0) -> Path:
    """n trajectories in the user's format over real embedded tasks; every third response is corrupted."""
    import random

    from hermes_lab.tasks.suite import corrupt, generate_tasks, verify

    rng = random.Random(seed)
    lines = []
    for i, t in enumerate(generate_tasks(n, split="train", seed=seed)):
        resp = corrupt(t.answer, rng) if i % 3 == 0 else t.answer
        rec = {"prompt": t.prompt, "response": resp, "reward": verify(t.prompt, resp), "task_id": t.task_id}
        lines.append(json.dumps(rec) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


@pytest.mark.slow
def test_commands_from_another_cwd_use_one_runs_dir(project_copy, tmp_path):
    """Issue 16: commands run from a folder outside the project write the project's runs/ (label store,
    MLflow store, policies) and nothing lands in a second runs/ under the cwd. Paths typed on the command
    line keep the shell's convention: --input / --output are relative to the cwd."""
    other = tmp_path / "somewhere-else"
    write_trajectories(other / "traj.jsonl")
    env = {**os.environ, paths.ENV_ROOT: str(project_copy)}
    env.pop("MLFLOW_TRACKING_URI", None)
    env.setdefault("OMP_NUM_THREADS", "1")  # a 0.3M-parameter policy: two contended threads are 10x slower than one
    py = [sys.executable, "-m"]
    steps = [
        [*py, "hermes_lab.prep", "--input", "traj.jsonl", "--output", "prep", "--params", "params/embedded.yaml"],
        [
            *py,
            "hermes_lab.review.gate",
            "--queue",
            "prep/review_queue.jsonl",
            "--simulate",
            "--params",
            "params/embedded.yaml",
        ],
        [*py, "hermes_lab.ab_run", "--baseline", "embedded:tiny", "--candidate", "embedded:tiny"]
        + ["--duration", "120", "--output", "ab/ab_report.json"],
    ]
    for args in steps:
        r = _run(args, other, env)
        assert r.returncode in (0, 3, 4), f"{args[2]}: exit {r.returncode}\n{r.stderr[-2000:]}"
    assert (other / "prep" / "review_queue.jsonl").is_file() and (other / "ab" / "ab_report.json").is_file()
    labels = project_copy / "runs" / "review" / "labels.jsonl"
    assert labels.is_file() and "simulated:verifier" in labels.read_text()
    assert (project_copy / "runs" / "mlflow.db").is_file() and (project_copy / "runs" / "mlartifacts").is_dir()
    assert not (other / "runs").exists() and not (other / "mlruns").exists(), sorted(os.listdir(other))
    assert not (other / "prep" / "runs").exists()


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
