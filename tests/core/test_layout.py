"""core.layout names every file of runs/ once; core.verdict / core.reports read and write their JSON unchanged.

The grep test reads every module of hermes_lab/ but the layout: a literal round file name there (a string that
is, or ends a path in, one of ``layout.FILE_NAMES``) or a folder of ``layout.DIR_NAMES`` joined as a path
(``/ "train"``, ``"adapter" /``) fails it, naming the file and line. ~1 s, no round run.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

from hermes_lab.core import layout
from hermes_lab.core.jsonl import write_json_atomic
from hermes_lab.core.layout import ExperimentLayout, RoundLayout, RunsLayout, TrainLayout
from hermes_lab.core.reports import EvalReport, RoundSummary
from hermes_lab.core.verdict import Verdict, gate, read_verdict, write_verdict

PACKAGE = Path(layout.__file__).resolve().parents[1]
# policy/model.py's source is hashed into the tiny policy's build recipe (an edit rebuilds it on every machine):
# it keeps its own build.json and policies/ (core.layout's docstring says so)
HASHED = {"policy/model.py": {"build.json", "policies"}}
# names that are not round files there: the Hermes Agent's own $HERMES_HOME/config.yaml
OTHERS = {"agents/hermes_chat.py": {"config.yaml"}, "agents/hermes_loop.py": {"config.yaml"}}  # Hermes's own file


SKIP = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)


def _string_tokens(source: str) -> list[tuple[int, str, str, str]]:
    """(line, the string's text, the operator before it, the one after) of every string token of a module."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in SKIP]
    out = []
    for i, t in enumerate(toks):
        if t.type != tokenize.STRING:
            continue
        m = re.match(r"""(?is)^([a-z]*)('{3}|"{3}|'|")(.*)\2$""", t.string)
        text = m.group(3) if m else t.string
        before = toks[i - 1].string if i and toks[i - 1].type == tokenize.OP else ""
        after = toks[i + 1].string if i + 1 < len(toks) and toks[i + 1].type == tokenize.OP else ""
        out.append((t.start[0], text, before, after))
    return out


def _scan(rel: str, source: str, allowed: set[str] = frozenset()) -> list[str]:
    """``rel:line: name`` of each round file or folder a module's strings name (``find_round_names``)."""
    alt = "|".join(re.escape(n) for n in sorted(layout.FILE_NAMES, key=len, reverse=True))
    file_re = re.compile(rf"^(?:[\w.{{}}-]+/)*({alt})$")
    dir_re = re.compile(rf"^({'|'.join(map(re.escape, layout.DIR_NAMES))})(?:/\{{.*)?$")
    hits = []
    for line, text, before, after in _string_tokens(source):
        names = [m.group(1)] if (m := file_re.match(text)) else []
        if (m := dir_re.match(text)) and ("/" in (before, after) or "/{" in text):
            names.append(m.group(1))
        if "round-{" in text:
            names.append("round-NN")
        hits += [f"{rel}:{line}: {n}" for n in names if n not in allowed]
    return hits


def find_round_names(root: Path = PACKAGE) -> list[str]:
    """``path:line: name`` of every literal round file name and joined folder name outside core/layout.py: a string
    that is a name of ``layout.FILE_NAMES`` (or a path ending in one), a folder of ``layout.DIR_NAMES`` with a
    ``/`` operator beside it or starting an f-string's path, an f-string naming ``round-{...}``."""
    hits = []
    for py in sorted(root.rglob("*.py")):
        rel = py.relative_to(root).as_posix()
        if rel != "core/layout.py":
            hits += _scan(rel, py.read_text(encoding="utf-8"), HASHED.get(rel, set()) | OTHERS.get(rel, set()))
    return hits


def find_in_notebooks(root: Path = PACKAGE.parent / "notebooks") -> list[str]:
    """The same in the stage notebooks' code cells (their parameters cells hold defaults: the declarations')."""
    import nbformat

    hits = []
    for nb_path in sorted(root.glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []):
                hits += _scan(f"{nb_path.name} cell {i}", cell.source)
    return hits


def test_no_round_file_named_outside_the_layout() -> None:
    hits = find_round_names() + find_in_notebooks()
    assert not hits, "round files named outside hermes_lab/core/layout.py (use its objects):\n" + "\n".join(hits)


def test_the_grep_finds_a_name_put_back(tmp_path: Path) -> None:
    """The check would fail on a literal added back: each way of naming a round file is found."""
    mod = tmp_path / "stage.py"
    mod.write_text(
        "from pathlib import Path\n"
        'a = Path(rd) / "train" / "eval.json"\n'
        'b = rd / "ab/requests.jsonl"\n'
        'c = runs / f"round-{n:02d}"\n'
        'd = "adapter" / x\n'
        'ok = "train/reward"  # an MLflow metric, not a path\n',
        encoding="utf-8",
    )
    hits = find_round_names(tmp_path)
    assert hits == [
        "stage.py:2: train",
        "stage.py:2: eval.json",
        "stage.py:3: requests.jsonl",
        "stage.py:4: round-NN",
        "stage.py:5: adapter",
    ]


def test_the_layout_places_every_file(tmp_path: Path) -> None:
    runs = RunsLayout(tmp_path)
    rd = runs.round(3)
    assert rd.root == tmp_path / "round-03" and rd.number == 3 and RoundLayout(str(rd.root)) == rd
    assert rd.train.adapter == tmp_path / "round-03/train/adapter"
    assert rd.train.episodes.samples == tmp_path / "round-03/train/episodes/samples.jsonl"
    assert rd.train.resume == tmp_path / "round-03/train/trl/hermes_resume.json"
    assert rd.prep.sink("rejects") == tmp_path / "round-03/prep/rejects.jsonl"
    assert rd.ab.requests == tmp_path / "round-03/ab/requests.jsonl" and rd.ab.verdict.name == "verdict.json"
    assert runs.experiment("round-02") == ExperimentLayout(tmp_path / "live/round-02")
    assert runs.flywheel.round_log(12) == tmp_path / "live/flywheel/round-12.log"
    assert runs.state == tmp_path / "state.json" and runs.labels == tmp_path / "review/labels.jsonl"
    assert rd.notebook("notebooks/20_grpo_train.ipynb") == tmp_path / "round-03/20_grpo_train.ipynb"
    for d in ("round-10", "round-2", "round-x", "round-01-old"):
        (tmp_path / d).mkdir()
    assert [r.number for r in runs.rounds()] == [2, 10]  # by number, not by name; other folders left out
    # every name the layout lists is a file some property gives
    given = {p.name for p in _paths(rd)} | {p.name for p in _paths(runs.flywheel)} | {runs.state.name}
    given |= {p.name for p in _paths(runs)} | {runs.policy("p").build.name, runs.judge_cache.name}
    assert set(layout.FILE_NAMES) <= given, set(layout.FILE_NAMES) - given


def _paths(obj: object, depth: int = 0) -> list[Path]:
    out: list[Path] = []
    for name in dir(type(obj)):
        if name.startswith("_") or not isinstance(getattr(type(obj), name), property):
            continue
        v = getattr(obj, name)
        if isinstance(v, Path):
            out.append(v)
        elif hasattr(v, "root") and depth < 3:
            out += _paths(v, depth + 1)
    return out


def test_verdict_round_trips_to_the_same_bytes(tmp_path: Path) -> None:
    p = write_verdict(
        tmp_path, "train", [gate("training_health", True, "ok")], adapter="/x/adapter", eval={"before": {}}
    )
    raw = p.read_bytes()
    v = Verdict.read(p)
    assert (
        v is not None
        and v.stage == "train"
        and v.stop is None
        and v.extra == {"adapter": "/x/adapter", "eval": {"before": {}}}
    )
    v.write(tmp_path / "again")
    assert (tmp_path / "again" / layout.VERDICT).read_bytes() == raw
    assert read_verdict(p) == json.loads(raw) and list(read_verdict(p)) == list(json.loads(raw))
    (tmp_path / "old.json").write_text('{"stop": "skipped: data gate", "gates": []}', encoding="utf-8")
    assert read_verdict(tmp_path / "old.json") == {"stop": "skipped: data gate", "gates": []}  # no key added
    (tmp_path / "torn.json").write_text('{"stage": "tr', encoding="utf-8")
    assert Verdict.read(tmp_path / "torn.json") is None and read_verdict(tmp_path / "none.json") is None


EVAL = {
    "before": {"pass_rate": 0.25, "mean_reward": 1.5, "per_level": {"math:1": {"n": 4, "pass_rate": 0.25}}},
    "after": {"pass_rate": 0.5, "mean_reward": 2.5},
    "gain_points": 25.0,
    "gain": {"gain": 0.25, "gain_lo": 0.1, "gain_hi": 0.4, "gain_tasks": 4},
}


@pytest.mark.parametrize(
    "data",
    [EVAL, {**EVAL, "agent": {"before": {"episode_success": 0.1}}}, {"before": {"pass_rate": 0.1}, "newer": 1}],
)
def test_eval_report_round_trips(tmp_path: Path, data: dict) -> None:
    """eval.json as train writes it (with and without the agent family) and one of another version: the same
    keys in the same order, the same bytes written back."""
    path = write_json_atomic(TrainLayout(tmp_path).eval, data)
    ev = EvalReport.read(path)
    assert ev is not None and ev.before == data["before"] and ev.to_json() == data
    assert list(ev.to_json()) == list(data)
    out = ev.write(tmp_path / "copy.json")
    assert out.read_bytes() == path.read_bytes()


def test_round_summary_round_trips(tmp_path: Path) -> None:
    full = RoundSummary(round=2, status="promoted", decision="ship", promoted=True, gates=[], timings_s={"train": 1.0})
    data = full.to_json()
    assert list(data)[:4] == ["round", "status", "decision", "promoted"] and data["held"] is None
    assert RoundSummary.from_json(data) == full
    old = {"round": 1, "status": "skipped: data gate", "gates": [], "unknown_key": [1]}  # an older run's summary
    p = write_json_atomic(RoundLayout(tmp_path / "round-01").summary, old)
    got = RoundSummary.read(p)
    assert got is not None and got.round == 1 and got.continues is None and got.extra == {"unknown_key": [1]}
    assert got.to_json() == old
    assert got.write(tmp_path / "s.json").read_bytes() == p.read_bytes()
    with pytest.raises(ValueError, match="RoundSummary"):
        RoundSummary.from_json([1])  # type: ignore[arg-type]
