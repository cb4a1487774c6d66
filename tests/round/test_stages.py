"""The stage registry and the round runner it drives, on throwaway stages (tiny real notebooks run by real
papermill, a real SQLite MLflow store): a stage is added by its row, notebook and module alone; gate stops
come from the verdict file; every summary lists every gate; progress and flywheel state change in one
atomic step; champion registration is idempotent; the flywheel trains N times whatever ran before."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import yaml

from hermes_lab.cli import main as cli
from hermes_lab.core import verdict
from hermes_lab.core.inputs import ROUND_INPUTS, ROUND_PARAMS, Input, Inputs
from hermes_lab.core.state import FlywheelState, state_path
from hermes_lab.core.verdict import STOP_DATA
from hermes_lab.round import runner as R
from hermes_lab.round import stages
from hermes_lab.round.stages import Stage, all_gates

from repo_paths import REPO

T0 = "2026-01-01T00:00:00+00:00"

HEAD = (
    "from pathlib import Path\n"
    "from hermes_lab.config.schema import load_config\n"
    "from hermes_lab.core.verdict import gate, write_verdict\n"
)
GATE_NB = HEAD + (
    "from hermes_lab.prep.run import evaluate_gates\n"
    "from hermes_lab.core.verdict import STOP_DATA\n"
    "from hermes_lab.core.state import FlywheelState, parse_time\n"
    "cfg = load_config(config_path)\n"
    "state = FlywheelState.load(state_path)\n"
    "out = Path(round_dir) / 'gate'\n"
    "out.mkdir(parents=True, exist_ok=True)\n"
    "(out / 'negatives_seen.json').write_text(repr(state.negative_files))\n"
    "gates = evaluate_gates(samples, cfg, state, parse_time(simulated_now))\n"
    "ok = all(g['passed'] for g in gates)\n"
    "verdicts = [gate(g['name'], g['passed'], g['detail']) for g in gates]\n"
    "write_verdict(out, 'gate', verdicts, None if ok else STOP_DATA)\n"
    "assert ok, 'the data gates refused'\n"
)
FIT_NB = HEAD + (
    "from hermes_lab.core import tracking\n"
    "cfg = load_config(config_path)\n"
    "with tracking.stage_run('fit', parent_run_id or None, cfg.round.runs_dir, cfg.round.experiment) as run:\n"
    "    tracking.log_metrics('fit', {'loss': 0.5})\n"
    "out = Path(round_dir) / 'fit'\n"
    "ev = {'before': {'pass_rate': 0.4}, 'after': {'pass_rate': 0.6}}\n"
    "write_verdict(out, 'fit', [gate('fit_health', True, 'fine')], adapter=str(out / 'adapter'),\n"
    "              mlflow_run_id=run.info.run_id, eval=ev)\n"
)
DECIDE_NB = HEAD + (
    "promoted = decision == 'promote'\n"
    "cand = {'decision': decision, 'promoted': promoted, 'rolled_back': decision == 'roll back'}\n"
    "write_verdict(Path(round_dir) / 'decide', 'decide', [gate('decision', promoted, decision)], candidate=cand)\n"
)


def notebook(path: Path, params: dict, code: str) -> str:
    """A stage notebook the way the project writes them: a parameters cell with help comments, then code."""
    lines = [
        f"{k} = {v!r}  # help: {k}"
        for k, v in {"config_path": "", "round_dir": "", "parent_run_id": "", **params}.items()
    ]
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(code),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return str(path)


def declared(name: str, params: dict) -> Inputs:
    """A throwaway stage's inputs: the round's three, then ``params`` (name -> default), as its notebook has them."""
    return Inputs(name, (*ROUND_INPUTS.rows, *(Input(k, type(v), v, f"help: {k}") for k, v in params.items())))


def fake_stages(tmp: Path, decision: str = "promote", samples: int = 600) -> tuple[Stage, ...]:
    """gate (data gates, uses the negatives) -> fit (a 'training': starts the cooldown) -> decide (A/B outcome)."""
    gate_params = {"state_path": "", "simulated_now": "", "samples": 0}
    return (
        Stage(
            "gate",
            notebook(tmp / "gate.ipynb", gate_params, GATE_NB),
            "hermes_lab.prep.run",
            verdict="gate/verdict.json",
            gates=("min_samples", "cooldown"),
            stops=(STOP_DATA,),
            params=lambda ctx: {
                "state_path": str(state_path(ctx.runs_dir)),
                "simulated_now": ctx.state.simulated_now or "",
                "samples": samples,
            },
            inputs=declared("gate", gate_params),
            consumes_negatives=True,
        ),
        Stage(
            "fit",
            notebook(tmp / "fit.ipynb", {}, FIT_NB),
            "hermes_lab.train.grpo",
            verdict="fit/verdict.json",
            gates=("fit_health",),
            starts_cooldown=True,
        ),
        Stage(
            "decide",
            notebook(tmp / "decide.ipynb", {"decision": ""}, DECIDE_NB),
            "hermes_lab.ab.run",
            verdict="decide/verdict.json",
            gates=("decision",),
            params=lambda ctx: {"decision": decision},
            inputs=declared("decide", {"decision": ""}),
        ),
    )


@pytest.fixture
def params(tmp_path) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"round": {"runs_dir": str(tmp_path / "runs"), "simulated_clock": True}}))
    return p


def _state(tmp_path) -> FlywheelState:
    return FlywheelState.load(state_path(tmp_path / "runs"))


# ------------------------------------------------------------------------------------------ fast ones
def test_registry_rows_are_consistent():
    names = [s.name for s in stages.STAGES]
    assert len(set(names)) == len(names) and names[-1] == "compare"
    gates = [g for _, g in all_gates()]
    assert gates == [
        "min_samples",
        "cooldown",
        "learning_signal",
        "review_agreement",
        "reward_audit",
        "training_health",
        "regression",
        "ab_decision",
    ]
    for s in stages.STAGES:
        assert s.inputs.notebook_names()[:3] == ROUND_PARAMS, s.name
        assert bool(s.gates) == bool(s.verdict), s.name  # a stage with gates reports them in a verdict file
    assert [s.name for s in stages.STAGES if s.starts_cooldown] == ["train"]
    assert {c for s in stages.STAGES if (c := s.command)} <= set(cli.COMMANDS)


def test_the_flywheel_clock_advance_takes_the_lock(params, tmp_path):
    with R.RoundLock(tmp_path / "runs"), pytest.raises(R.RoundLocked):
        R.advance_clock(str(params), 25)


def test_a_stale_verdict_never_turns_a_crash_into_a_gate_stop(params, mlflow_store, tmp_path):
    crash = Stage(
        "crash",
        notebook(tmp_path / "crash.ipynb", {}, "raise ValueError('a real bug')"),
        "hermes_lab.prep.run",
        verdict="crash/verdict.json",
        gates=("g",),
        stops=(STOP_DATA,),
    )
    rd = tmp_path / "runs" / "round-01"
    verdict.write_verdict(rd / "crash", "crash", [verdict.gate("g", False, "old")], STOP_DATA)  # an earlier run's
    with pytest.raises(R.RoundError, match="a real bug"):
        R.run_round(str(params), quiet=True, stages=(crash,))
    assert _state(tmp_path).progress["status"] == "failed"


# ------------------------------------------------------------------------------------ rounds of fakes
@pytest.mark.slow
def test_a_throwaway_stage_is_a_row_a_notebook_and_a_module(params, mlflow_store, tmp_path, monkeypatch):
    """The runner, the summary, MLflow and the CLI pick a new stage up from its registry row alone."""
    mod = tmp_path / "hl_lint_stage.py"
    mod.write_text(
        '"""Throwaway stage: lints the round (writes lint/verdict.json)."""\n'
        "from pathlib import Path\n"
        "from hermes_lab.core.verdict import gate, write_verdict\n\n"
        "def lint(round_dir, strict):\n"
        "    ok = not strict\n"
        "    write_verdict(Path(round_dir) / 'lint', 'lint', [gate('lint_clean', ok, 'ok' if ok else 'dirty')],\n"
        "                  None if ok else 'stopped: lint')\n"
        "    return ok\n\n"
        "def add_arguments(p):\n"
        "    p.add_argument('--round-dir', required=True)\n\n"
        "def run_cli(args):\n"
        "    return 0 if lint(args.round_dir, False) else 4\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = "import hl_lint_stage\nassert hl_lint_stage.lint(round_dir, strict), 'lint stopped the round'\n"
    lint = Stage(
        "lint",
        notebook(tmp_path / "lint.ipynb", {"strict": False}, code),
        "hl_lint_stage",
        verdict="lint/verdict.json",
        gates=("lint_clean",),
        stops=("stopped: lint",),
        params=lambda ctx: {"strict": ctx.round_no == 2},
        inputs=declared("lint", {"strict": False}),
        command="lint",
        help="Lint a round.",
    )
    registry = (fake_stages(tmp_path)[1], lint)  # a training, then the new stage
    r1 = R.run_round(str(params), quiet=True, stages=registry)
    assert r1.status == "completed"
    assert [g["gate"] for g in r1.summary["gates"]] == [g for _, g in all_gates(registry)]
    assert r1.summary["gates"][-1] == {"gate": "lint_clean", "stage": "lint", "passed": True, "detail": "ok"}
    R.advance_clock(str(params), 25)
    r2 = R.run_round(str(params), quiet=True, stages=registry)  # round 2 is strict: the new gate stops it
    assert r2.status == "stopped: lint" and r2.summary["stopped_at"] == {"stage": "lint", "status": "stopped: lint"}
    parser = cli.build_parser(registry)
    args = parser.parse_args(["lint", "--round-dir", str(tmp_path / "x")])
    assert args._run(args) == 0 and (tmp_path / "x" / "lint" / "verdict.json").is_file()
    assert "lint" in cli.commands(registry) and "lint" not in cli.COMMANDS


@pytest.mark.slow
def test_every_summary_lists_every_gate_in_order_and_says_why_one_did_not_run(params, mlflow_store, tmp_path):
    registry = fake_stages(tmp_path, samples=10)  # too few samples: the data gate stops the round
    r = R.run_round(str(params), quiet=True, stages=registry)
    assert r.status == STOP_DATA
    gates = r.summary["gates"]
    assert [g["gate"] for g in gates] == ["min_samples", "cooldown", "fit_health", "decision"]
    assert gates[0]["passed"] is False and gates[1]["passed"] is True
    assert gates[2]["passed"] is None and gates[2]["detail"] == f"not run: the round stopped at gate ({STOP_DATA})"
    state = _state(tmp_path)
    assert state.last_round == 1 and state.last_train_time is None and state.progress is None


class Killed(BaseException):
    """A kill -9 at a write: the exception unwinds past every handler but the lock's release."""


def _kill_at_first_write_after(monkeypatch, happened) -> list[str]:
    """Replace os.replace: once ``happened()`` holds, the next rename of a runner file completes and the
    process 'dies' right after it. Returns the list of files renamed before the kill."""
    real, seen = os.replace, []

    def replace_then_die(src, dst, *a, **kw):
        real(src, dst, *a, **kw)
        if Path(dst).name in {"state.json", "progress.json", "summary.json"} and not seen and happened():
            seen.append(Path(dst).name)
            raise Killed(dst)

    monkeypatch.setattr(os, "replace", replace_then_die)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("event", ["after the training", "after the negatives were used", "after registering"])
def test_a_kill_at_any_write_leaves_progress_and_state_consistent(params, mlflow_store, tmp_path, monkeypatch, event):
    import mlflow

    rd = tmp_path / "runs" / "round-01"
    FlywheelState(negative_files=[str(tmp_path / "old-negatives.jsonl")], negative_rounds=[0]).save(
        state_path(tmp_path / "runs")
    )
    client = mlflow.MlflowClient()
    happened = {
        "after the training": lambda: (rd / "fit" / "verdict.json").exists(),
        "after the negatives were used": lambda: (rd / "gate" / "verdict.json").exists(),
        "after registering": lambda: (
            bool(client.search_registered_models()) and bool(client.search_model_versions("name = 'hermes-policy'"))
        ),
    }[event]
    registry = fake_stages(tmp_path)
    killed = _kill_at_first_write_after(monkeypatch, happened)
    with pytest.raises(Killed):
        R.run_round(str(params), quiet=True, stages=registry)
    assert killed  # the killer has fired once; from here on writes go through
    state = _state(tmp_path)
    done = state.progress["completed"]
    assert ("fit" in done) == (state.last_train_time is not None)  # trained <=> cooldown recorded
    assert ("gate" in done) == (state.negative_files == [])  # negatives used <=> no longer listed
    r = R.run_round(str(params), resume=True, quiet=True, stages=registry)
    assert r.status == "promoted"
    state = _state(tmp_path)
    assert state.last_train_time is not None and state.negative_files == [] and state.progress is None
    assert state.last_round == 1 and state.champion_adapter == str(rd / "fit" / "adapter")
    versions = client.search_model_versions("name = 'hermes-policy'")
    assert len(versions) == 1  # registered once, however often finish_round ran
    assert client.get_model_version_by_alias("hermes-policy", "champion").version == versions[0].version


@pytest.mark.slow
def test_the_flywheel_trains_n_times_whatever_ran_before(params, mlflow_store, tmp_path):
    # a round just trained (make round): the cooldown has 24 h to go on the simulated clock
    FlywheelState(last_round=1, last_train_time=T0, simulated_now=T0).save(state_path(tmp_path / "runs"))
    registry = fake_stages(tmp_path)[:2]  # the data gates (cooldown included), then a training
    results = R.flywheel(str(params), 2, stages=registry, quiet=True)
    assert [r.status for r in results] == ["completed", "completed"]
    for r in results:
        assert [g["gate"] for g in r.summary["gates"]] == ["min_samples", "cooldown", "fit_health"]
        assert all(g["passed"] is True for g in r.summary["gates"])
    state = _state(tmp_path)
    assert state.last_round == 3 and [h["round"] for h in state.history] == [2, 3]
    assert state.last_train_time == "2026-01-03T02:00:00+00:00"  # trained twice: T0 + 2 x (24 h cooldown + 1 h)
    # the clock did not move after the last round: a round right now is not due
    assert not R.status(str(params))["due"]


def test_flywheel_continues_an_unfinished_round(params, tmp_path, mlflow_store):
    with mlflow_store.start_run() as run:
        pass
    st = FlywheelState(progress={"round": 1, "parent_run_id": run.info.run_id, "completed": ["gate", "fit", "decide"]})
    st.progress |= {"timings": {}, "status": "failed"}
    st.save(state_path(tmp_path / "runs"))
    registry = tuple(replace(s, gates=()) for s in fake_stages(tmp_path))
    with pytest.raises(R.RoundError, match="--resume"):
        R.run_round(str(params), quiet=True, stages=registry)
    (r,) = R.flywheel(str(params), 1, stages=registry, quiet=True)
    assert r.round_no == 1 and r.status == "completed"  # no stage left to run, no candidate outcome read
    assert json.loads((tmp_path / "runs" / "round-01" / "progress.json").read_text())["status"] == "done"


def test_a_round_skipped_at_the_data_gate_hands_its_samples_to_the_next(tmp_path):
    """Samples pile up until they trigger a training: round 3 reads round 2's log (skipped at the data gate)
    and the A/B traffic of round 1 (which trained), not round 1's own log (trained on already)."""
    runs = tmp_path / "runs"
    for k, stop in ((1, None), (2, STOP_DATA)):
        rd = runs / f"round-{k:02d}"
        verdict.write_verdict(rd / "prep", "prep", [], stop=stop)
        (rd / "trajectories.jsonl").write_text("{}\n")
    (runs / "round-01" / "ab").mkdir()
    (runs / "round-01" / "ab" / "requests.jsonl").write_text("{}\n")
    got = [p.relative_to(runs).as_posix() for p in stages.fresh_data(runs, 3)]
    assert got == ["round-03/trajectories.jsonl", "round-02/trajectories.jsonl", "round-01/ab/requests.jsonl"]
    # once round 3 trained, round 4 starts afresh from round 3's log
    verdict.write_verdict(runs / "round-03" / "prep", "prep", [], stop=None)
    assert [p.name for p in stages.fresh_data(runs, 4)] == ["trajectories.jsonl"]


HELD_NB = HEAD + (
    "import json\n"
    "out = Path(round_dir) / 'decide'\n"
    "out.mkdir(parents=True, exist_ok=True)\n"
    "(out / 'continue_from.txt').write_text(continue_from)\n"
    "if continue_from:  # the continued experiment decides\n"
    "    cand = {'decision': 'promote', 'promoted': True, 'rolled_back': False}\n"
    "else:  # the first one reaches its hard end undecided\n"
    "    held = {'stage': 0, 'ratio': 0.1, 'cs': [-0.05, 0.2], 'units_baseline': 900, 'units_candidate': 100}\n"
    "    cand = {'decision': 'keep observing', 'promoted': False, 'rolled_back': False, 'held': held}\n"
    "line = 'ab: UNDERPOWERED plan: needs ~4200 requests in stage 0 (10% candidate) ..., the budget allows 2100'\n"
    "plan = None if continue_from else {'underpowered': True, 'line': line, 'power': 0.6, 'power_target': 0.95}\n"
    "write_verdict(out, 'decide', [gate('decision', cand['promoted'], cand['decision'])], candidate=cand, plan=plan)\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("on_held", ["continue", "new"])
def test_a_held_candidate_has_its_own_status_and_the_next_round_may_continue_its_experiment(
    params, mlflow_store, tmp_path, on_held, capsys
):
    from hermes_lab.round import compare

    """An A/B undecided at its hard end is 'candidate held: undecided' with the interval it reached; with
    round.on_held continue the next round runs only the continuing stages on that candidate (no data gate,
    no training), and its promotion moves the champion to the held round's adapter."""
    data = yaml.safe_load(params.read_text())
    data["round"]["on_held"] = on_held
    params.write_text(yaml.safe_dump(data))
    gate_, fit, _ = fake_stages(tmp_path)
    decide = Stage(
        "decide",
        notebook(tmp_path / "held.ipynb", {"continue_from": ""}, HELD_NB),
        "hermes_lab.ab.run",
        verdict="decide/verdict.json",
        gates=("decision",),
        params=lambda ctx: {"continue_from": (ctx.continues or {}).get("ab_dir", "")},
        inputs=declared("decide", {"continue_from": ""}),
        on_continue=True,
    )
    registry = (gate_, fit, decide)
    r1, r2 = R.flywheel(str(params), 2, stages=registry, quiet=True)
    for r in (r1, r2):  # what the round and the flywheel print (quiet: no embedded policy to report on)
        R.print_summary(r.summary)
    compare.print_flywheel([r1.summary, r2.summary])
    out = capsys.readouterr().out
    runs = tmp_path / "runs"
    assert r1.status == "candidate held: undecided" and r1.summary["held"]["cs"] == [-0.05, 0.2]
    assert "held: stage 0 (10%) reached its hard end undecided, delta in [-0.050, +0.200]" in out
    # the round's output names the underpowered plan (ab.plan_power could not be reached within the budget)
    assert r1.summary["ab_plan"].startswith("ab: UNDERPOWERED plan: needs ~4200 requests")
    assert "\n  ab: UNDERPOWERED plan: needs ~4200 requests" in out and "the budget allows 2100" in out
    if on_held == "new":  # a new candidate: round 2 trains again and its experiment starts afresh
        assert r1.summary["held"]["next"] == "new" and r2.summary["continues"] is None
        assert (runs / "round-02" / "fit").is_dir() and r2.status == "candidate held: undecided"
        assert "rejected 0" in out and "held 2" in out
        return
    assert r1.summary["held"]["next"] == "continue" and "the next round continues this experiment" in out
    assert r2.summary["continues"] == 1 and r2.status == "promoted"
    assert (runs / "round-02" / "decide" / "continue_from.txt").read_text() == str(runs / "round-01" / "decide")
    assert not (runs / "round-02" / "gate").exists() and not (runs / "round-02" / "fit").exists()
    assert list(r2.summary["timings_s"]) == ["decide"]
    for g in r2.summary["gates"][:3]:  # the data gates and the training did not run, and say why
        assert g["passed"] is None and "continues round 01's held A/B" in g["detail"]
    state = _state(tmp_path)
    assert state.champion_adapter == str(runs / "round-01" / "fit" / "adapter") and state.held is None
    assert r2.summary["pass_rate"] == 0.6  # the held round's candidate, now the champion
    assert "rose in 1 of 2 rounds; held 1" in out and "(continues round 01)" in out
    # a continued experiment is not continued twice, and the next round is a normal one again
    (r3,) = R.flywheel(str(params), 1, stages=registry, quiet=True)
    assert r3.summary["continues"] is None and (runs / "round-03" / "fit").is_dir()
