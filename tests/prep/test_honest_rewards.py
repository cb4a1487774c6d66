"""Honest rewards for agent logs (issue 56): "the run ended" is not success.

What the real Hermes Agent 0.19.0 wrote (tests/fixtures/hermes/sessions, tests/fixtures/hermes_exports), where every
conversation "completed", goes through the real prep (CLI and ``run_prep``) and a real round (the prep stage's
notebook through papermill): a named ``no_learning_signal`` verdict that names the outcome rules, prep exits 3 and
the round stops at prep; with a verifier's feedback the same files pass the gate and the round reaches training.
A log that pays every conversation the same through another source (its own reward, feedback, the judge) is
caught and named as well. A real gateway (``python -m hermes_lab.live.serve``, its upstream answering 500s) leaves
its own failures out of the training data, counted apart with their reason, and prep does not exit 2 for them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import yaml
from gateway_process import Gateway

from hermes_lab.config.schema import load_config
from hermes_lab.core.verdict import STOP_NO_SIGNAL, read_verdict
from hermes_lab.prep.run import GateRefused, run_prep
from hermes_lab.rewards.audit import AuditResult, data_signal, format_result

from fake_openai import FakeOpenAI
from repo_paths import FIXTURES, REPO
from test_audit import _notebook as _standin_train  # a stand-in training stage that leaves a marker

FIX = FIXTURES / "hermes"
EXPORTS = FIXTURES / "hermes_exports"
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def prep_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "hermes_lab.cli.main", "prep", *args, "--set", "data.min_samples=1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip


def verifier_feedback(accepted: Path, out: Path) -> Path:
    """A verifier's verdicts on the sessions, by conversation id: the session whose tool call errored failed it
    (0), the others passed (5)."""
    rows = [
        {"conversation_id": r["conversation_id"], "reward": 0.0 if r["outcome"]["tool_errors"] else 5.0,
         "source": "verifier"}
        for r in lines(accepted)
    ]  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


# ------------------------------------------------------------------ the done-when: real session files
@pytest.mark.parametrize("inp, n", [(FIX / "sessions", 6), (EXPORTS / "sessions.jsonl", 7)], ids=["sessions", "export"])
def test_all_completed_hermes_sessions_give_a_named_no_learning_signal_verdict(tmp_path, inp, n):
    out = tmp_path / "out"
    p = prep_cli(tmp_path, "--input", str(inp), "--output", str(out))
    assert p.returncode == 3, p.stdout + p.stderr  # a gate refused, as min_samples and the cooldown do
    # the first line says what the outcome rules pay: 'completed' is not paid as a success
    assert p.stdout.startswith("prep: rewards: ") and "'completed' 2.5/5 (below the success threshold 3" in p.stdout
    verdict = read_verdict(out / "verdict.json")
    assert verdict["stop"] == STOP_NO_SIGNAL == "stopped: no learning signal"
    gates = {g["gate"]: g for g in verdict["gates"]}
    assert gates["min_samples"]["passed"] and gates["cooldown"]["passed"]
    sig = gates["learning_signal"]
    assert sig["passed"] is False
    assert sig["detail"].startswith(
        f"no_learning_signal: outcome: {n} of {n} conversations are rewarded only by how the run ended ({n} 'completed'"
    )
    assert "no verifier, feedback, tests or judge scored any" in sig["detail"] and f"0 of {n} carry" in sig["detail"]
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "no_learning_signal" and not s["gates_passed"]
    ls = s["learning_signal"]
    assert (ls["verdict"], ls["source"], ls["with_signal"], ls["verified"]) == ("no_learning_signal", "outcome", 0, 0)
    assert ls["by_source"]["outcome"]["completed"] == n
    assert {r["reward_source"] for r in lines(out / "accepted.jsonl")} == {"outcome"}
    assert all(r["reward"] < 3 for r in lines(out / "accepted.jsonl"))  # no unverified completion is a success
    # the reward audit names the same reward for the round's data
    res = AuditResult("block", 5.0, 3.0)
    data_signal(res, load_config(None), tmp_path)  # <round_dir>/prep: the layout's, made below
    assert res.signal is None  # no prep there yet
    (tmp_path / "rd").mkdir()
    (out).rename(tmp_path / "rd" / "prep")
    data_signal(res, load_config(None), tmp_path / "rd")
    assert res.blocked and [(f.reward, f.case, f.klass) for f in res.findings] == [
        ("outcome", "no_learning_signal", "no learning signal")
    ]
    assert "outcome paid 2.5/5 to no_learning_signal" in res.detail() and "BLOCK" in format_result(res)


def test_completion_paid_as_full_marks_is_said_first_and_still_no_signal(tmp_path):
    out = tmp_path / "out"
    p = prep_cli(tmp_path, "--input", str(FIX / "sessions"), "--output", str(out),
                 "--set", "conversations.completed_reward=1.0")  # fmt: skip
    assert p.returncode == 3
    assert p.stdout.splitlines()[0].startswith("prep: rewards: ") and "'completed' 5/5 (PAID AS A SUCCESS" in p.stdout
    assert "no_learning_signal: outcome: 6 of 6" in p.stdout  # whatever they pay, the outcome rules check nothing


def test_the_same_sessions_with_a_verifiers_feedback_train(tmp_path):
    cfg = load_config(None, {"data.min_samples": 1})
    with pytest.raises(GateRefused, match="no_learning_signal: outcome"):
        run_prep([FIX / "sessions"], tmp_path / "first", cfg, make_plots=False)
    fb = verifier_feedback(tmp_path / "first" / "accepted.jsonl", tmp_path / "verdicts.jsonl")
    assert {r["reward"] for r in lines(fb)} == {0.0, 5.0}
    res = run_prep([FIX / "sessions"], tmp_path / "out", cfg, make_plots=False, feedback=[fb])
    assert res.gates_passed and res.summary["status"] == "ok"
    ls = res.summary["learning_signal"]
    assert (ls["verdict"], ls["with_signal"], ls["conversations"]) == ("ok", 6, 6)
    assert set(ls["by_source"]) == {"feedback:verifier"}
    verdict = read_verdict(tmp_path / "out" / "verdict.json")
    assert verdict["stop"] is None and all(g["passed"] for g in verdict["gates"])
    # the CLI too, with the feedback in the config: exit 0, the gate's line
    out = tmp_path / "cli"
    p = prep_cli(tmp_path, "--input", str(FIX / "sessions"), "--output", str(out), "--set",
                 f"conversations.feedback=[{fb}]")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "prep: learning_signal: PASS: 6 of 6 conversations (100%) carry a learning signal" in p.stdout
    res2 = AuditResult("block", 5.0, 3.0)
    (tmp_path / "rd").mkdir()
    out.rename(tmp_path / "rd" / "prep")
    data_signal(res2, load_config(None), tmp_path / "rd")
    assert res2.signal["passed"] and not res2.findings


def test_warn_lets_prep_go_on_and_says_so(tmp_path):
    cfg = load_config(None, {"data.min_samples": 1, "conversations.no_signal": "warn"})
    res = run_prep([FIX / "sessions"], tmp_path / "out", cfg, make_plots=False)
    g = next(g for g in res.gates if g["name"] == "learning_signal")
    assert g["passed"] and g["detail"].startswith("WARN: no_learning_signal: outcome")
    assert read_verdict(tmp_path / "out" / "verdict.json")["stop"] is None
    audit = AuditResult("block", 5.0, 3.0)
    (tmp_path / "rd").mkdir()
    (tmp_path / "out").rename(tmp_path / "rd" / "prep")
    data_signal(audit, cfg, tmp_path / "rd")
    assert not audit.findings and "WARN  data: learning_signal" in format_result(audit)


# ------------------------------------------------------------ adversarial: the same reward, another source
def chat(cid: str, task: str, answer: str, **kw) -> str:
    msgs = [{"role": "user", "content": task}, {"role": "assistant", "content": answer}]
    return json.dumps({"id": cid, "task_id": task[:12], "messages": msgs, "completed": True, **kw}) + "\n"


TASKS = [f"Task {k}: sum {k} and {k + 1}." for k in range(6)]


def test_a_log_paying_every_conversation_the_same_is_caught_and_named(tmp_path):
    cfg = load_config(None, {"data.min_samples": 1})
    f = tmp_path / "log.jsonl"  # three conversations a task, every one carrying 5.0 in its own log
    f.write_text("".join(chat(f"c{k}-{i}", t, f"{2 * k + 1 + i}", reward=5.0) for k, t in enumerate(TASKS)
                         for i in range(3)))  # fmt: skip
    with pytest.raises(GateRefused) as e:
        run_prep([f], tmp_path / "log", cfg, make_plots=False)
    ls = e.value.result.summary["learning_signal"]
    assert ls["source"] == "log" and ls["verified"] == 18 and ls["with_signal"] == 0
    assert "no_learning_signal: log: 18 of 18 conversations, every task's paid the same (5/5 x18" in str(e.value)
    # the same conversations, no reward in the log, a feedback file paying each of them 5: named too
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(chat(f"c{k}-{i}", t, f"{2 * k + 1 + i}") for k, t in enumerate(TASKS) for i in range(3)))
    fb = tmp_path / "fb.jsonl"
    fb.write_text("".join(json.dumps({"conversation_id": f"c{k}-{i}", "reward": 5}) + "\n" for k in range(6)
                          for i in range(3)))  # fmt: skip
    with pytest.raises(GateRefused, match=r"no_learning_signal: feedback:system: 18 of 18 conversations"):
        run_prep([plain], tmp_path / "fb", cfg, make_plots=False, feedback=[fb])
    # the judge scoring identical answers the same (a task's copies are one conversation): named
    same = tmp_path / "same.jsonl"
    same.write_text("".join(chat(f"s{k}-{i}", t, "42") for k, t in enumerate(TASKS) for i in range(3)))
    judge = load_config(None, {"data.min_samples": 1, "conversations.reward": "judge", "reward.model": "local"})
    with pytest.raises(GateRefused) as e:
        run_prep([same], tmp_path / "judge", judge, make_plots=False)
    ls = e.value.result.summary["learning_signal"]
    assert ls["source"] == "judge" and ls["with_signal"] == 0 and ls["by_source"]["judge"]["paid"] == "5/5 x6"
    assert ls["detail"].startswith("no_learning_signal: judge: 6 of 6 conversations, every task's paid the same")
    # feedback on too few conversations: the outcome rules pay the rest, and they are named
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"conversation_id": "c0-0", "reward": 0}) + "\n"
                   + json.dumps({"conversation_id": "c1-0", "reward": 5}) + "\n")  # fmt: skip
    strict = load_config(None, {"data.min_samples": 1, "conversations.min_signal_share": 0.25})
    assert run_prep([plain], tmp_path / "few1", cfg, make_plots=False, feedback=[few]).gates_passed  # 2/18 >= 10%
    with pytest.raises(GateRefused) as e:  # 2 of 18 < 25%
        run_prep([plain], tmp_path / "few", strict, make_plots=False, feedback=[few])
    ls = e.value.result.summary["learning_signal"]
    assert (ls["source"], ls["with_signal"], ls["min_signal_share"]) == ("outcome", 2, 0.25)
    assert "outcome: 16 of 18 conversations are rewarded only by how the run ended" in ls["detail"]
    # a verifier that tells them apart: passes (every task's three conversations paid 5, 0, 0)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"conversation_id": f"c{k}-{i}", "reward": 5 if i == 0 else 0}) + "\n"
                            for k in range(6) for i in range(3)))  # fmt: skip
    res = run_prep([plain], tmp_path / "good", cfg, make_plots=False, feedback=[good])
    assert res.gates_passed and res.summary["learning_signal"]["with_signal"] == 18


# ------------------------------------------------------------------------ the gateway's own failures
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "terminal",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def _agent(client: openai.OpenAI, task: str, stub: FakeOpenAI, fail_at: int | None) -> str | None:
    """An agent loop on the SDK (its own retries: 2); the upstream answers 500 to every attempt of turn
    ``fail_at``. The conversation id, or None when the gateway failed it."""
    msgs: list = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": task}]
    cid = None
    for turn in range(4):
        stub.fail_500 = 3 if turn == fail_at else 0
        try:
            raw = client.chat.completions.with_raw_response.create(model="m", messages=msgs, tools=TOOLS)
        except openai.InternalServerError:
            return None
        cid = raw.headers["x-hermes-conversation"]
        m = raw.parse().choices[0].message
        results = [
            {"role": "tool", "tool_call_id": c.id, "content": f"ran {json.loads(c.function.arguments)['command']}"}
            for c in m.tool_calls or []
        ]
        msgs += [m.model_dump(exclude_none=True), *results]
        if not results:
            return cid
    return cid


def test_the_gateways_own_failures_are_left_out_counted_apart_and_prep_goes_on(tmp_path):
    stub = FakeOpenAI(models=("m",))
    stub.agent = True
    stub.start()
    args = ["--ratio", "0.0", "--set", "serve.rollout=false", "--baseline", stub.url, "--baseline-model", "m"]
    args += ["--candidate", stub.url, "--candidate-model", "m"]
    gw = Gateway(tmp_path, args).start()
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=2)
        ok = [_agent(client, f"task {i}: list the files", stub, None) for i in range(4)]
        first = [_agent(client, f"task {i}: show the disk", stub, 0) for i in range(2)]  # no turn answered
        cut = _agent(client, "task 9: count the files", stub, 1)  # its second turn failed: cut by the gateway
        assert all(ok) and first == [None, None] and cut is None
        import httpx

        http = httpx.Client(base_url=gw.url, trust_env=False, timeout=30)
        for k, cid in enumerate(ok):  # a verifier's verdicts
            assert http.post(
                "/v1/feedback", json={"conversation_id": cid, "reward": [5.0, 0.0, 5.0, 2.0][k]}
            ).is_success
    finally:
        gw.stop()
        stub.stop()
    recs = gw.records()
    assert sum(r["status"] != "ok" for r in recs) == 9 and {r.get("http_status") for r in recs} >= {500}
    out = tmp_path / "prep"
    p = prep_cli(tmp_path, "--input", str(gw.log_dir), "--output", str(out))  # default data.max_bad_fraction
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["counts"]["rejected"] == 0 and s["counts"]["accepted"] == 4  # the policy's conversations only
    assert {r["conversation_id"] for r in lines(out / "accepted.jsonl")} == set(ok)
    g = s["gateway"][str(gw.log_dir)]
    assert (g["conversations"], g["gateway_failed"], g["with_feedback"]) == (4, 3, 4)
    assert s["gateway_failures"]["conversations"] == 3
    failed = lines(Path(g["gateway_failures_file"]))
    assert len(failed) == 3 and all(f["reason"].startswith("gateway error") for f in failed)
    reasons = sorted(f["reason"] for f in failed)
    assert reasons[0].startswith("gateway error on its last turn (turn 1, HTTP 500 x3)")
    assert reasons[1:] == ["gateway error: no turn answered (HTTP 500 x3)"] * 2
    assert "the gateway's own failures left out of training (0 failed requests, 3 conversations" in p.stdout
    assert s["learning_signal"]["passed"] and s["learning_signal"]["with_signal"] == 4


# ------------------------------------------------------------------------------------------ a round
@pytest.mark.slow
def test_a_round_on_real_sessions_stops_at_prep_and_trains_with_feedback(tmp_path, mlflow_store):
    from hermes_lab.round import runner as R
    from hermes_lab.round.stages import STAGES, Stage

    prep = next(s for s in STAGES if s.name == "prep")
    trained = tmp_path / "trained"
    train = Stage("train", str(_standin_train(tmp_path / "train.ipynb", trained)), "hermes_lab.train.grpo")

    def round_with(name: str, extra: dict) -> R.RoundResult:
        runs = tmp_path / name
        (runs / "round-01").mkdir(parents=True)  # the round's execution log: the real Hermes export
        (runs / "round-01" / "trajectories.jsonl").write_bytes((EXPORTS / "sessions.jsonl").read_bytes())
        params = tmp_path / f"{name}.yaml"
        conf = {"round": {"runs_dir": str(runs), "simulated_clock": True}}  # quiet: the tiny policy is not built
        params.write_text(yaml.safe_dump(conf | {"data": {"min_samples": 1}} | extra))
        return R.run_round(str(params), stages=(prep, train), quiet=True)

    r = round_with("plain", {})
    assert r.status == STOP_NO_SIGNAL and not trained.exists()
    g = next(g for g in r.summary["gates"] if g["gate"] == "learning_signal")
    assert g["passed"] is False and g["detail"].startswith("no_learning_signal: outcome: 7 of 7 conversations")
    assert R.OK_STATUSES and not r.status.startswith(R.OK_STATUSES)  # hermes-lab round exits 4
    fb = verifier_feedback(r.round_dir / "prep" / "accepted.jsonl", tmp_path / "verdicts.jsonl")
    r2 = round_with("fed", {"conversations": {"feedback": [str(fb)]}})
    assert r2.status != STOP_NO_SIGNAL and trained.exists()  # the same files train
    g2 = next(g for g in r2.summary["gates"] if g["gate"] == "learning_signal")
    assert g2["passed"] is True
