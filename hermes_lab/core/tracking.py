"""MLflow plumbing shared by every stage: the store, the runs, one metric namespace, secret-free params.

One way to track: a stage opens its run with ``stage_run(stage, parent_run_id, runs_dir, experiment)``
(in its notebook, or its CLI), and logs with the helpers below, which write to the active run and are
no-ops without one (cheap: when nobody imported mlflow, no run can be active, so mlflow is not even
imported). Metric names are ``<stage>/<metric>`` everywhere (``log_metrics(stage, {...})``): ``prep/accepted``,
``train/reward``, ``validate/regression_delta``, ``ab/delta``, ``review/agreement``, ``round/time_train``.

Writes to the MLflow store: by default the SQLite file ``runs/mlflow.db`` with artifacts under
``runs/mlartifacts/`` (MLflow 3 refuses a plain ``./mlruns`` folder store). ``MLFLOW_TRACKING_URI``
overrides it, e.g. an ``mlflow server`` for a team. A project's new store starts as a copy of the machine's
empty, migrated one (``new_store``): MLflow would otherwise run its ~50 schema migrations (~2 s of CPU) in the
first process that opens it.

Secrets never reach a param or a tag: ``log_params``/``set_tags`` mask them by value (``safe_params``,
``hermes_lab.core.redaction``), never by the param's name.

Nesting across processes: each stage notebook runs in its own kernel, so a stage run is tied to its
round's run with the ``mlflow.parentRunId`` tag (what ``nested=True`` sets in-process).

    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db      # browse rounds
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab.core import redaction
from hermes_lab.core.layout import RunsLayout

log = logging.getLogger(__name__)


def tracking_uri(runs_dir: str | os.PathLike[str] = "runs") -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    from hermes_lab.core.paths import resolve

    db = RunsLayout(resolve(runs_dir)).mlflow_db  # a relative runs_dir is the project's, whatever the cwd
    db.parent.mkdir(parents=True, exist_ok=True)
    if not db.exists():
        new_store(db)
    return f"sqlite:///{db}"


def new_store(db: Path) -> bool:
    """Create the SQLite store ``db`` as a copy of the machine's empty store for this MLflow version
    (``hermes_lab.core.paths.machine_cache("mlflow")``, migrated once per machine), with its Default experiment's
    artifacts under ``db``'s folder (``mlartifacts/0``, next to the project's own experiment) rather than under
    whatever directory the first process happened to run in. False (nothing written) where the cache is off or
    cannot be used, or ``db`` exists already: MLflow then creates or opens the store itself, as always."""
    import shutil
    import sqlite3
    from importlib.metadata import version

    from hermes_lab.core.paths import machine_cache

    cache = machine_cache("mlflow")
    if cache is None or db.exists():
        return False
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    try:
        template = cache / f"empty-{version('mlflow')}.db"
        if not template.is_file():
            _migrate_template(template)
        shutil.copyfile(template, tmp)
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(tmp)) as con, con:
            con.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                ((RunsLayout(db.parent).mlartifacts / "0").as_uri(), now, now),
            )
        os.link(tmp, db)  # never over a store that another process created meanwhile (FileExistsError)
        return True
    except Exception as e:  # a shortcut only: whatever fails here, MLflow creates the store as it always did
        log.debug("MLflow store %s not copied from the machine's template: %s", db, e)
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _migrate_template(template: Path) -> None:
    """The machine's empty store for this MLflow version: created and migrated by MLflow itself, once (a lock:
    two first rounds on a new machine migrate it once), and renamed into place complete."""
    import fcntl

    template.parent.mkdir(parents=True, exist_ok=True)
    with open(template.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if template.is_file():
            return
        tmp = template.with_name(f"{template.stem}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        _quiet_migrations()
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # as setup(): MLflow is imported here first
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{tmp}").search_experiments()  # creates and migrates the schema
        os.replace(tmp, template)


def _quiet_migrations() -> None:
    """alembic and MLflow print a page of migration INFO lines on a new SQLite store: shown with --debug only."""
    from hermes_lab.core import quiet

    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not quiet.debug_enabled():
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def setup(runs_dir: str | os.PathLike[str] = "runs", experiment: str = "hermes-lab") -> str:
    """Point MLflow at the store and select (or create) the experiment; returns its id."""
    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no phoning home from an offline workbench
    _quiet_migrations()  # a store that is not a copy (MLFLOW_TRACKING_URI, no machine cache) is migrated here
    # read before set_tracking_uri: MLflow 3 exports MLFLOW_TRACKING_URI itself
    user_uri = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    mlflow.set_tracking_uri(tracking_uri(runs_dir))
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        art = None
        if not user_uri:
            from hermes_lab.core.paths import resolve

            art = RunsLayout(resolve(runs_dir)).mlartifacts.as_uri()
        exp_id = mlflow.create_experiment(experiment, artifact_location=art)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def secret_values(extra_env_names: Any = ()) -> set[str]:
    """Every secret value known now (``hermes_lab.core.redaction``); never logged, never printed."""
    return redaction.secret_values(extra_env_names)


def redact(text: str) -> str:
    return redaction.redact(text)


def safe_params(params: dict[str, Any]) -> dict[str, str]:
    """Params fit for MLflow: secrets masked BY VALUE, stringified and truncated (MLflow caps values).

    No key is dropped for its name (``reward.base_url``, ``execute.max_new_tokens`` and ``model.api_key_env``
    are logged). In every value, the value of any secret variable (``hermes_lab.core.redaction``: secret-named,
    key-shaped, or named by a ``*api_key_env`` param of this batch) becomes ***, as do ``user:password@``
    in URLs and key-looking tokens."""
    named = [v for k, v in params.items() if str(k).endswith("api_key_env") and isinstance(v, str) and v]
    secrets = secret_values(named)
    out: dict[str, str] = {}
    for k, v in params.items():
        out[str(k)] = redaction.redact(str(v), *secrets, env=False)[:6000]
    return out


def safe_tags(tags: dict[str, Any]) -> dict[str, str]:
    """Tags fit for MLflow, filtered like ``safe_params``."""
    return safe_params(tags)


@contextlib.contextmanager
def stage_run(
    name: str,
    parent_run_id: str | None = None,
    runs_dir: str | os.PathLike[str] = "runs",
    experiment: str = "hermes-lab",
    tags: dict[str, str] | None = None,
) -> Iterator[Any]:
    """An MLflow run for one stage, nested under ``parent_run_id`` when given (also across processes)."""
    import mlflow

    setup(runs_dir, experiment)
    all_tags = dict(tags or {})
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    with mlflow.start_run(run_name=name, tags=all_tags, nested=mlflow.active_run() is not None) as run:
        yield run


def active_run() -> Any:
    """The active MLflow run, or None; never imports mlflow just to find out there is none."""
    if "mlflow" not in sys.modules:
        return None
    import mlflow

    return mlflow.active_run()


def active_run_id() -> str | None:
    run = active_run()
    return run.info.run_id if run is not None else None


def metric_name(stage: str, name: str) -> str:
    return f"{stage}/{name}"


def log_metrics(stage: str, metrics: dict[str, Any], step: int | None = None) -> None:
    """``<stage>/<name>`` metrics on the active run; None and non-finite values are left out."""
    if active_run() is None:
        return
    import mlflow

    clean = {}
    for k, v in metrics.items():
        if v is None or isinstance(v, str):
            continue
        f = float(v)
        if math.isfinite(f):
            clean[metric_name(stage, k)] = f
    if clean:
        mlflow.log_metrics(clean, step=step)


def log_params(params: dict[str, Any]) -> None:
    """Secret-free params on the active run (no-op without one)."""
    if active_run() is None:
        return
    import mlflow

    clean = safe_params(params)
    items = list(clean.items())
    for i in range(0, len(items), 90):  # MLflow accepts at most 100 params per batch
        mlflow.log_params(dict(items[i : i + 90]))


def set_tags(tags: dict[str, Any]) -> None:
    """``mlflow.set_tags`` with secrets masked by value (``safe_tags``); a no-op without an active run."""
    if active_run() is None:
        return
    import mlflow

    mlflow.set_tags(safe_tags(tags))


def log_artifact(path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    if active_run() is None or not Path(path).exists():
        return
    import mlflow

    mlflow.log_artifact(str(path), artifact_path=artifact_path)


def log_artifacts(path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
    if active_run() is None or not Path(path).is_dir():
        return
    import mlflow

    mlflow.log_artifacts(str(path), artifact_path=artifact_path)


def log_dict(data: dict[str, Any], artifact_file: str) -> None:
    if active_run() is None:
        return
    import mlflow

    mlflow.log_dict(data, artifact_file)


def log_figure(fig: Any, path: str | os.PathLike[str], laid_out: bool = False) -> Path:
    """Save a matplotlib figure as PNG and log it to the active run (when there is one). ``laid_out``: the figure
    went through tight_layout() already, so the tight bounding box (a second full draw) is skipped."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110, bbox_inches=None if laid_out else "tight")
    log_artifact(p, "plots")
    return p


# ------------------------------------------------------------------------------------ the round's run
def start_round_run(name: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
    """Create a round's parent run (setup() first), log its params, close it; returns its id. Stage runs
    nest under it from their own processes (stage_run's parent_run_id)."""
    import mlflow

    with mlflow.start_run(run_name=name, tags={"hermes.round": name.rsplit("-", 1)[-1], **(tags or {})}) as run:
        log_params(params)
    return run.info.run_id


@contextlib.contextmanager
def resume_run(run_id: str) -> Iterator[Any]:
    """Reopen a finished run (the round's parent) to log to it."""
    import mlflow

    with mlflow.start_run(run_id=run_id) as run:
        yield run


def log_failed_notebook(parent_run_id: str, path: str | os.PathLike[str]) -> None:
    """A failed stage's executed notebook on the round's run, which is tagged failed."""
    if not Path(path).exists():
        return
    with resume_run(parent_run_id):
        log_artifact(path, "notebooks")
        set_tags({"round.status": "failed"})


# ------------------------------------------------------------------------------- per-step metrics
class MetricBuffer:
    """Per-step ``<stage>/<name>`` metrics of a long loop (training), written to the active run in batches,
    off the loop's thread.

    Why: MLflow's SQL store costs ~16 ms of CPU a call plus ~0.14 ms a metric (measured on the embedded
    default), and each call commits, which waits for the disk. TRL's ~30 metrics written at every step
    would cost more than 10% of a 130 ms tiny-policy step. So the buffer hands batches of ``every_steps``
    steps (or ``every_s`` seconds, which keeps a slow, real model's curves live) to MLflow's own async
    logging (``log_batch(synchronous=False)``, a writer thread): the loop pays ~4 ms a step of CPU and
    never the disk wait. A writer process would not pay off: importing mlflow and opening the store costs
    it ~6 s of CPU, more than a whole embedded training. ``flush(wait=True)`` returns once all is written."""

    def __init__(self, stage: str, every_steps: int = 32, every_s: float = 10.0):
        self.stage, self.every_steps, self.every_s = stage, every_steps, every_s
        self._pending: list[Any] = []
        self._steps = 0
        self._flushed_at = time.monotonic()
        self._writes: list[Any] = []  # MLflow's futures (RunOperations) of the batches handed over

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if active_run() is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._pending += [
            Metric(metric_name(self.stage, k), float(v), ts, step) for k, v in metrics.items() if _finite_number(v)
        ]
        self._steps += 1
        if self._steps >= self.every_steps or time.monotonic() - self._flushed_at >= self.every_s:
            self.flush()

    def flush(self, wait: bool = False) -> None:
        """Hand what is buffered to MLflow's writer (at most 1000 metrics a call); ``wait``: until written."""
        pending, self._pending, self._steps = self._pending, [], 0
        self._flushed_at = time.monotonic()
        run = active_run()
        if pending and run is not None:
            import mlflow

            client = mlflow.MlflowClient()
            for i in range(0, len(pending), 1000):
                self._writes.append(client.log_batch(run.info.run_id, metrics=pending[i : i + 1000], synchronous=False))
        if wait:
            writes, self._writes = self._writes, []
            for w in writes:
                w.wait()  # raises what the writer met


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
