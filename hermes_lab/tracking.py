"""MLflow plumbing shared by every stage: the store, nested runs, secret-free params, figures.

Writes to the MLflow store: by default the SQLite file ``runs/mlflow.db`` with artifacts under
``runs/mlartifacts/`` (MLflow 3 refuses a plain ``./mlruns`` folder store). ``MLFLOW_TRACKING_URI``
overrides it, e.g. an ``mlflow server`` for a team.

Secrets never reach a param or a tag: ``log_params``/``set_tags`` mask them by value (``safe_params``,
``hermes_lab.redaction``), never by the param's name.

Nesting across processes: each stage notebook runs in its own kernel, so a stage run is tied to its
round's run with the ``mlflow.parentRunId`` tag (what ``nested=True`` sets in-process).

    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db      # browse rounds
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hermes_lab import redaction


def tracking_uri(runs_dir: str | os.PathLike[str] = "runs") -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    from hermes_lab.paths import resolve

    db = resolve(runs_dir) / "mlflow.db"  # a relative runs_dir is the project's, whatever the cwd
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def setup(runs_dir: str | os.PathLike[str] = "runs", experiment: str = "hermes-lab") -> str:
    """Point MLflow at the store and select (or create) the experiment; returns its id."""
    import logging

    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no phoning home from an offline workbench
    from hermes_lab import quiet

    # alembic/mlflow print a page of migration INFO lines on a fresh SQLite store
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if not quiet.debug_enabled():
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # read before set_tracking_uri: MLflow 3 exports MLFLOW_TRACKING_URI itself
    user_uri = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    mlflow.set_tracking_uri(tracking_uri(runs_dir))
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        art = None
        if not user_uri:
            from hermes_lab.paths import resolve

            art = (resolve(runs_dir) / "mlartifacts").as_uri()
        exp_id = mlflow.create_experiment(experiment, artifact_location=art)
    else:
        exp_id = exp.experiment_id
    mlflow.set_experiment(experiment_id=exp_id)
    return exp_id


def secret_values(extra_env_names: Any = ()) -> set[str]:
    """Every secret value known now (``hermes_lab.redaction``); never logged, never printed."""
    return redaction.secret_values(extra_env_names)


def redact(text: str) -> str:
    return redaction.redact(text)


def safe_params(params: dict[str, Any]) -> dict[str, str]:
    """Params fit for MLflow: secrets masked BY VALUE, stringified and truncated (MLflow caps values).

    No key is dropped for its name (``reward.base_url``, ``execute.max_new_tokens`` and ``model.api_key_env``
    are logged). In every value, the value of any secret variable (``hermes_lab.redaction``: secret-named,
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


def log_params(params: dict[str, Any]) -> None:
    import mlflow

    clean = safe_params(params)
    items = list(clean.items())
    for i in range(0, len(items), 90):  # MLflow accepts at most 100 params per batch
        mlflow.log_params(dict(items[i : i + 90]))


def set_tags(tags: dict[str, Any]) -> None:
    """``mlflow.set_tags`` with secrets masked by value (``safe_tags``)."""
    import mlflow

    mlflow.set_tags(safe_tags(tags))


def log_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Save a matplotlib figure as PNG and log it to the active run (when there is one)."""
    import mlflow

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110, bbox_inches="tight")
    if mlflow.active_run() is not None:
        mlflow.log_artifact(str(p), artifact_path="plots")
    return p
