"""The MLflow store (hermes_lab.core.tracking): a project's new store is a copy of the machine's migrated one."""

from __future__ import annotations

import time

from mlflow.tracking import MlflowClient

from hermes_lab.core import tracking


def test_a_new_project_store_is_the_machines_migrated_store_made_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HERMES_LAB_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "runs", tmp_path / "b" / "runs"
    uri_a = tracking.tracking_uri(a)  # the first store on this "machine": MLflow migrates the template once
    (template,) = (tmp_path / "cache" / "mlflow").glob("empty-*.db")
    migrated = template.stat().st_mtime_ns
    uri_b = tracking.tracking_uri(b)
    assert uri_b == f"sqlite:///{b / 'mlflow.db'}" and (b / "mlflow.db").is_file()
    assert template.stat().st_mtime_ns == migrated  # the second is a copy, not migrated again
    assert not list(b.glob(".*tmp")) and not list(template.parent.glob("*.tmp"))

    # a store of its own, that MLflow reads and writes as one it created
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri_b)
    with tracking.stage_run("probe", runs_dir=b) as run:
        tracking.log_metrics("probe", {"x": 1.5})
    client = MlflowClient(tracking_uri=uri_b)
    assert client.get_run(run.info.run_id).data.metrics == {"probe/x": 1.5}
    assert {e.name for e in client.search_experiments()} == {"hermes-lab", "Default"}
    default = client.get_experiment("0")
    assert default.artifact_location == (b / "mlartifacts" / "0").as_uri()  # this project's, not the template's
    assert abs(default.creation_time / 1000 - time.time()) < 120
    assert [e.name for e in MlflowClient(tracking_uri=uri_a).search_experiments()] == ["Default"]  # a's is apart

    # an existing store is never replaced
    assert not tracking.new_store(b / "mlflow.db")
    assert client.get_run(run.info.run_id).data.metrics == {"probe/x": 1.5}
