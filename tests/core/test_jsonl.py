"""hermes_lab.core.jsonl: THE atomic JSON writer (concurrent writers and readers, failures, file mode) and the names
made safe for MLflow metric names, file names and matplotlib labels."""

from __future__ import annotations

import json
import os
import threading

import pytest

from hermes_lab.core.jsonl import plot_label, safe_name, write_json_atomic


def test_concurrent_writers_never_leave_half_a_file_or_a_temp_file(tmp_path):
    """The old helper wrote every writer into the same '<name>.tmp': two writers clobbered each other's file."""
    path = tmp_path / "state.json"
    write_json_atomic(path, {"writer": -1, "pad": ""})
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(i: int) -> None:
        try:
            for j in range(60):
                write_json_atomic(path, {"writer": i, "n": j, "pad": "x" * (1000 * (i + 1))})
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        while not stop.is_set():
            try:
                data = json.loads(path.read_text())
                assert len(data["pad"]) == 1000 * (data["writer"] + 1) or data["writer"] == -1
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert errors == []
    assert json.loads(path.read_text())["n"] == 59
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left behind


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"ok": 1})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular"):
        write_json_atomic(path, loop)
    assert json.loads(path.read_text()) == {"ok": 1} and len(list(tmp_path.iterdir())) == 1
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600: others may read it as before


def test_safe_name_is_a_valid_mlflow_metric_name_and_file_name(tmp_path):
    from mlflow.utils.validation import _validate_metric_name

    hostile = ["c++", "c**", "$x^2$", "a/b", "..", ".", "", "_x", "x" * 300, "日本", "a\x00b", "\ud800", "a b:c"]
    names = [safe_name(f) for f in hostile]
    assert len(set(names)) == len(hostile)  # distinct families stay distinct
    for n in names:
        _validate_metric_name(f"review_agreement_{n}")
        _validate_metric_name(f"family/{n}/delta")
        assert not n.startswith(".") and "/" not in n and len(n) <= 71
        (tmp_path / f"{n}.png").write_bytes(b"")  # a file name on this platform, in this directory
    assert {p.name for p in tmp_path.iterdir()} == {f"{n}.png" for n in names}
    assert safe_name("upper") == "upper" and safe_name("tool-v2.1") == "tool-v2.1"  # safe names are kept as is


def test_plot_label_escapes_mathtext_and_renders():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.subplots()
    for i, f in enumerate([r"$\notacommand$", "$x^{2$", "_hidden", "a\nb\u2028c", "\ud800", "y" * 100]):
        ax.plot([0, 1], [i, i], label=plot_label(f))
    ax.legend()
    fig.canvas.draw()  # would raise a mathtext ParseError on the raw text
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(labels) == 6 and labels[0] == r"\$\notacommand\$" and labels[2] == " _hidden"
    assert "\n" not in labels[3] and len(labels[5]) == 40
