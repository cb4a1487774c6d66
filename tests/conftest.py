"""Shared pytest fixtures. Each fixture is self-contained; add yours below the others.

tests/ mirrors the packages: tests/<package>/test_*.py for hermes_lab.<package>, tests/house/ for the checks of the
whole project (imports, docs, notebooks), tests/e2e/ for the slow end-to-end tests (whole rounds, the live flywheel,
the real Hermes Agent, the browser: `make test-fast` leaves them out). Here at the root: this file, the shared helpers
(repo_paths.py, fake_openai.py, gateway_process.py: a `hermes-lab serve` for a test, families.py, forced_lm.py,
browser_deps.sh) and the shared data (fixtures/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hermes_lab.core import kernels

# tests/ and each of its test folders on sys.path, once, before any test module is imported. tests/ itself: the shared
# helpers import by name from every folder (`from fake_openai import FakeOpenAI`, `from repo_paths import REPO`),
# and no test computes a path to them. The folders: a test module may import another's helpers by its name, from
# another folder (`from test_paths import write_trajectories` in policy/ and e2e/, `from test_live_rollout import
# Traffic` in e2e/), which pytest's default import mode ("prepend": a module is its file's basename, its folder put on
# sys.path when collected) would make importable only once that folder was collected, and never under
# `pytest tests/e2e`. A module's name being its basename, basenames stay unique across the folders (LONGEST_FIRST
# and POLICY_FREE below name files by basename too).
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [
    str(d) for d in (TESTS, *sorted({p.parent for p in TESTS.glob("*/test_*.py")})) if str(d) not in sys.path
]

kernels.skip_unused_imports()  # before any test module imports nbformat: 2 s of CPU per worker, for nothing


def pytest_configure(config):
    """Each test process (make test's pytest-xdist workers, a worker per core and two more, or a plain pytest
    run), and every process it starts (papermill kernels, CLI subprocesses, torchrun), gets one BLAS/OpenMP
    thread unless told otherwise: two workers each running torch with a thread per core would fight for the
    cores, and the tiny policy is ~10x slower that way; a plain run with two threads is ~2x slower than with
    one, and would not time what make test times."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")


# The files whose tests run longest, longest first, by basename (their wall time under `make test`, pytest --durations):
# `make test` hands whole files to its pytest-xdist workers in this order (--dist loadfile
# --no-loadscope-reorder: each file's module and session fixtures built once, and xdist's own reorder, by
# number of tests, off), the files not listed after them. Longest first is what keeps every core busy to the
# end: a 20-second file handed out last leaves the other core idle for most of it.
# Two short files break the order on purpose. An xdist worker starts a test only once it holds the next one
# (that test's teardown needs it), so the worker that takes the live flywheel's file, one test of minutes,
# takes the next file in the queue with it and runs it only after the flywheel. The file second in this list
# is that partner on a fresh machine (the files that need no policy first, then the flywheel's), the file
# fifth is it when the policy is built (make test's 4 workers on 2 cores take the first four at once): a
# short file each, not test_round's minutes queued behind the flywheel's while another worker idles.
LONGEST_FIRST = (
    "test_live_flywheel.py",
    "test_policy.py",  # the flywheel's partner on a fresh machine (above)
    "test_train.py",
    "test_round.py",
    "test_execute.py",  # the flywheel's partner once the policy is built (above)
    "test_validate.py",
    "test_stages.py",
    "test_ab_run.py",
    "test_arms.py",
    "test_prep_fuzz.py",  # one test of 95-120 s: handed out late, it would run on alone at the end
    "test_prep.py",
    "test_serve.py",
    "test_served_agent.py",
    "test_live_rollout.py",
    "test_browser.py",
    "test_quiet.py",
    "test_paths.py",
    "test_humaneval.py",
    "test_sandbox_escapes.py",
    "test_sandbox_fusion.py",
    "test_sandbox.py",
    "test_kernels.py",
    "test_turns.py",
    "test_gateway_conversations.py",
    "test_browser_conversations.py",
    "test_switch.py",
    "test_config.py",
    "test_agent_logs.py",
    "test_conversations.py",
    "test_ab_held.py",
    "test_ab_plan.py",
)
# Files whose tests never load the embedded tiny policy. On a fresh clone the policy is not built yet (3-4
# minutes): the first worker starts its build in the background, these files run meanwhile, and the first test
# that needs the policy waits on the build's lock (hermes_lab.policy.model.build_tiny_policy), so it is built
# once whatever this list says; a file listed here by mistake only waits.
POLICY_FREE = (
    "test_ab.py",
    "test_ab_plan.py",
    "test_agent_logs.py",
    "test_api.py",
    "test_architecture.py",
    "test_audit.py",
    "test_browser_conversations.py",
    "test_conversations.py",
    "test_doctor.py",
    "test_group_judge.py",
    "test_humaneval.py",
    "test_inspect.py",
    "test_jsonl.py",
    "test_notebooks.py",
    "test_prep_fuzz.py",
    "test_redaction.py",
    "test_reward_hostile.py",
    "test_rewards.py",
    "test_sandbox.py",
    "test_sandbox_escapes.py",
    "test_sandbox_fusion.py",
    "test_status_page.py",
    "test_supervisor.py",
    "test_tasks.py",
    "test_tests_tree.py",
)
_POLICY_BUILD: list = []


def _policy_built() -> bool:
    from hermes_lab.policy.model import cached_build, tiny_dir

    tiny = tiny_dir(TESTS.parent / "runs", 0)
    return (tiny / "build.json").exists() or cached_build(tiny.name) is not None  # a copy takes seconds


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    key = lambda item: rank.get(item.path.name, len(rank))  # noqa: E731
    if _policy_built() or all(item.path.name in POLICY_FREE for item in items):
        items.sort(key=key)  # stable: the rest keep their order
        return
    items.sort(key=lambda item: (item.path.name not in POLICY_FREE, key(item)))
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # one builder: the first worker, or plain pytest
        import subprocess

        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the workers hold the other core(s)
        cmd = [sys.executable, "-m", "hermes_lab.policy.model"]
        _POLICY_BUILD.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_unconfigure(config):
    for proc in _POLICY_BUILD:  # a session that ends first (a -k selection) does not leave it running
        if proc.poll() is None:
            proc.terminate()
        proc.wait()


@pytest.fixture(autouse=True)
def _mlflow_tracking_uri_restored():
    """mlflow.set_tracking_uri() is global and also sets MLFLOW_TRACKING_URI in os.environ: without this, a test
    that pointed MLflow at its own server (stopped since) would send every later test's runs there."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        import mlflow

        mlflow.set_tracking_uri(before)  # None unsets the variable again
    elif before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture
def fake_openai(monkeypatch):
    """A running fake OpenAI-compatible server (tests/fake_openai.py) on 127.0.0.1.

    Proxy variables are cleared so that requests reach it directly, whatever the machine's environment."""
    from fake_openai import PROXY_ENV_VARS, FakeOpenAI

    for name in PROXY_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    server = FakeOpenAI().start()
    yield server
    server.stop()


def mlflow_db(dest) -> str:
    """A new, empty SQLite MLflow store at ``dest`` (a file path); returns its tracking URI.

    A copy of the machine's empty, migrated store (``hermes_lab.core.tracking.new_store``), as a project's first
    round gets it: MLflow's ~50 schema migrations (2-3 s of CPU) run once per machine, not once per test. Still a
    real store of its own. Where the machine cache is off, MLflow creates and migrates it."""
    from hermes_lab.core import tracking

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    if not tracking.new_store(dest):
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{dest}").search_experiments()
    return f"sqlite:///{dest}"


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A real SQLite MLflow store with the 'hermes-lab' experiment; artifacts under tmp_path (never ./mlruns)."""
    import mlflow

    mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    mlflow.create_experiment("hermes-lab", artifact_location=(tmp_path / "mlartifacts").as_uri())
    yield mlflow
    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture
def project_copy(tmp_path):
    """A second hermes-lab project in tmp_path/proj: copies of params/ and notebooks/ (what makes a folder the
    project, hermes_lab.core.paths), and runs/policies linked to this checkout's built tiny policy (no rebuild)."""
    import shutil

    from hermes_lab.policy.model import build_tiny_policy

    repo = TESTS.parent
    proj = tmp_path / "proj"
    for d in ("params", "notebooks"):
        shutil.copytree(repo / d, proj / d)
    tiny = build_tiny_policy(repo / "runs", 0, quiet=True)
    (proj / "runs").mkdir()
    (proj / "runs" / "policies").symlink_to(tiny.parent.resolve(), target_is_directory=True)
    return proj
