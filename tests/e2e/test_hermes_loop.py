"""The real Hermes Agent's own loop (run_agent.AIAgent) on many tasks in one sandboxed process (hermes_lab.agents).

The pinned hermes-agent 0.19.0 in its cached virtualenv, driven by hermes_lab.agents.hermes_loop.HermesLoop:
- against a scripted model (FakeOpenAI's agent plans), Hermes's own tools try every way out of a task's workspace:
  a write and a read of host files beside the workspaces and outside /tmp (sentinels checked on the host), another
  task's workspace, a TCP connection to a host listener on 127.0.0.1; a control task does the same inside its own
  workspace and succeeds, so the tools do run;
- against `hermes-lab serve` on the embedded policy: held-out `hermes` tasks, each run filed by the gateway under
  the conversation id the runner gave it, the verifier's reward posted as its feedback.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from hermes_lab.agents.hermes_loop import HermesLoop, local_url
from hermes_lab.tasks import hermes as H

from fake_openai import FakeOpenAI
from repo_paths import REPO
from test_hermes_real import gateway, hermes_bin  # noqa: F401 - fixtures: an A/A gateway, the pinned Hermes
from test_validate import adapters, store, tiny_base  # noqa: F401 - the tiny policy, adapters, a params file

pytestmark = pytest.mark.slow
SECRET = "SECRET-7Q2X"


class Listener:
    """A host TCP listener on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.srv.getsockname()[1], 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def text_of(messages: list[dict]) -> str:
    return json.dumps(messages)


def test_a_base_url_off_this_machine_is_refused():
    assert local_url("http://localhost:8700/v1") == ("http://127.0.0.1:8700/v1", 8700)
    with pytest.raises(ValueError, match="only reaches a model server on 127.0.0.1"):
        local_url("http://10.0.0.7:8000/v1")


def test_tools_never_touch_anything_outside_their_workspace(hermes_bin, tmp_path):  # noqa: F811
    host = tmp_path / "host"
    host.mkdir()
    secret, beside = host / "secret.txt", host / "sentinel.txt"
    secret.write_text(SECRET + "\n")
    beside.write_text("untouched\n")
    far = Path.home() / ".cache" / "hermes-lab" / f"sentinel-{uuid.uuid4().hex}.txt"  # outside /tmp
    far.parent.mkdir(parents=True, exist_ok=True)
    far.write_text("untouched\n")
    listener = Listener()
    stub = FakeOpenAI(models=("m",))
    stub.agent = True
    connect = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {listener.port}), 3)\""
    stub.plans = {
        "inside": [
            ("write_file", {"path": "ok.txt", "content": "fine"}),
            ("terminal", {"command": "cat ok.txt && echo more >> ok.txt && cat ok.txt"}),
        ],
    }
    stub.start()
    root = tmp_path / "runs"
    try:
        with HermesLoop(f"{stub.url}/v1", "m", workspace_root=root, timeout=90) as loop:
            control = loop.run([{"id": "t-inside", "prompt": "inside: write ok.txt", "files": {}, "expect": {}}])[0]
            other = control.workspace / "ok.txt"
            left = other.read_text() if other.exists() else None
            stub.plans["escape"] = [
                ("write_file", {"path": str(beside), "content": "overwritten"}),
                ("write_file", {"path": str(far), "content": "overwritten"}),
                ("write_file", {"path": str(other), "content": "overwritten"}),
                ("read_file", {"path": str(secret)}),
                ("read_file", {"path": str(other)}),
                ("terminal", {"command": f"cat {secret} {other}; echo x > {beside}; echo x > {far}; echo >> {other}"}),
                ("terminal", {"command": f"cp {secret} leak.txt; ln -s {secret} link.txt; cat link.txt"}),
                ("terminal", {"command": connect + " && echo CONNECTED"}),
            ]
            escape = loop.run([{"id": "t-escape", "prompt": "escape: look around", "files": {}, "expect": {}}])[0]
    finally:
        stub.stop()
        listener.srv.close()
    try:
        # the control: Hermes's tools ran, in its own workspace
        assert control.exit_code == 0 and control.tool_calls == ("write_file", "terminal"), control.stderr_tail
        assert left == "finemore\n" and "finemore" in text_of(control.messages), left
        # the escape: every tool ran and got an error or nothing; nothing outside its workspace changed or leaked
        assert escape.exit_code == 0 and len(escape.tool_calls) == 8, escape.stderr_tail
        assert beside.read_text() == "untouched\n" and far.read_text() == "untouched\n"
        assert other.read_text() == left, "another task's workspace was written"
        assert SECRET not in text_of(escape.messages), "a host file was read"
        assert not (escape.workspace / "leak.txt").exists() or SECRET not in (escape.workspace / "leak.txt").read_text()
        results = [str(m.get("content")) for m in escape.messages if m.get("role") == "tool"]
        assert len(results) == 8 and all("error" in x.lower() or "denied" in x.lower() for x in results[:5]), results
        assert listener.accepted == 0 and not any("CONNECTED" in x for x in results), results[-1]
    finally:
        far.unlink(missing_ok=True)


def test_hermes_own_loop_on_heldout_tasks_filed_and_paid_by_the_verifier(hermes_bin, gateway, tmp_path):  # noqa: F811
    tasks = H.generate_tasks(14, split="heldout", seed=7)  # two of each kind
    with HermesLoop(f"{gateway.url}/v1", "hermes", workspace_root=tmp_path / "runs", feedback=True) as loop:
        assert loop.parallel == 2 and loop.context_length == 65536  # as /v1/models states it, asked once
        t0 = time.monotonic()
        runs = loop.run(tasks)
        wall = time.monotonic() - t0
    assert [r.task_id for r in runs] == [t.task_id for t in tasks]  # in the tasks' order, whatever ended first
    assert sum(r.seconds for r in runs) > 1.3 * wall, (wall, [r.seconds for r in runs])  # two at a time
    assert all(r.exit_code == 0 and not r.timed_out for r in runs), [r.stderr_tail for r in runs if r.exit_code]
    recs = gateway.records()
    assert recs and all(int(r.get("http_status") or 200) < 500 for r in recs)
    by_conv: dict[str, list] = {}
    for r in recs:
        by_conv.setdefault(r["conversation_id"], []).append(r)
    ours = {r.session_id for r in runs}
    assert ours <= set(by_conv), ours - set(by_conv)  # each run filed under the id it was given

    def nudge(q: dict) -> bool:  # Hermes's recovery from an empty answer after a tool call: a synthetic
        # assistant "(empty)" and a user nudge, sent once and dropped from the messages it keeps
        return any(m.get("role") == "assistant" and m.get("content") == "(empty)" for m in q.get("messages") or [])

    for r in runs:  # a run's requests all in that one conversation: one per assistant turn, Hermes's resends and nudges
        turns = sum(1 for m in r.messages if m.get("role") == "assistant")
        firsts = [q for q in by_conv[r.session_id] if not q.get("retry") and not nudge(q)]
        assert len(firsts) == turns, (r.task_id, len(firsts), turns, [q.get("messages") for q in by_conv[r.session_id]])
        assert r.feedback_status == 202
        assert r.reward == H.verify(H.parse_question(r.prompt), r.workspace, r.answer)
    fb = [json.loads(x) for p in Path(gateway.log_dir).glob("feedback*.jsonl") for x in p.read_text().splitlines()]
    paid = {f["conversation_id"]: f["reward"] for f in fb}
    assert {r.session_id: r.reward for r in runs} == {c: paid[c] for c in ours}
    done = sum(r.success for r in runs)
    print(f"Hermes's own loop on the embedded policy: {done}/{len(runs)} held-out tasks done on disk")
    assert done >= 2  # the embedded policy does some of them (measured: 40% of 20 through the CLI)


def test_hermes_lab_agent_plays_its_episodes_with_the_real_hermes(hermes_bin, gateway, capsys):  # noqa: F811
    """`hermes-lab agent --runner hermes`: the live traffic's agent episodes are Hermes's own loop, two sandboxed
    processes for two conversations in flight, each episode's verifier score posted as its conversation's feedback."""
    from hermes_lab.agents import standin as LA

    before = len(gateway.records("feedback.jsonl"))
    args = ["--url", gateway.url, "--requests", "6", "--concurrency", "2", "--agent-share", "1", "--split", "heldout"]
    assert LA.main([*args, "--runner", "hermes"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "agent: 6/6 answered, 0 errors, 6 feedback accepted" in out and "agent episodes: 6" in out, out
    fb = gateway.records("feedback.jsonl")[before:]
    convs = {
        r["conversation_id"] for r in gateway.records() if r["conversation_id"] in {f["conversation_id"] for f in fb}
    }
    assert len(fb) == 6 and len(convs) == 6 and all(c.startswith("hermes-hermes-") for c in convs)


def test_hermes_in_flight_bounds_the_hermes_processes_not_the_string_traffic(hermes_bin, gateway):  # noqa: F811
    """live-demo's mixed traffic with the real Hermes runner: 4 conversations in flight, at most 1 of them a Hermes
    process (each ~150 MB and its own requests); the string tasks keep the other workers, nothing fails."""
    from hermes_lab.agents import standin as LA

    s = LA.run_agent(
        gateway.url,
        8,
        4,
        seed=3,
        split="heldout",
        agent_share=0.5,
        progress=False,
        runner="hermes",
        hermes_in_flight=1,
    )
    kinds = [r.get("kind") for r in s["results"]]
    assert s["errors"] == 0 and s["answered"] == 8, s["first_errors"]
    assert "agent" in kinds and "string" in kinds, kinds
    assert s["hermes_processes"] == 1


@pytest.mark.filterwarnings("ignore:regression gate")  # 4 tasks a string family: the gate says they are few
def test_validate_plays_the_agent_family_with_the_real_hermes(hermes_bin, tiny_base, adapters, store, tmp_path):  # noqa: F811
    """agent.runner hermes: the real Hermes Agent plays the family's held-out tasks, each arm served in turn by
    `hermes-lab serve` and the same tasks played against each, paired by task: a broken adapter, which answers Hermes
    with noise, is stopped by the real agent's harm test (its gain's upper bound below 0) beside the built-in loop's
    non-inferiority on the same tasks; the report and each arm's server log say what was played."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.core.layout import ValidateLayout
    from hermes_lab.evaluate import validate as V
    from hermes_lab.evaluate.played import played_tasks

    over = {"grpo.environment": H.ENVIRONMENT, "agent.runner": "hermes", "agent.heldout_tasks": 10}
    cfg = load_config(store, {**over, "validate.eval_tasks_per_family": 4, "validate.samples_per_task": 1})
    rd = tmp_path / "round-01"
    rep = V.regression_gate(cfg, str(tiny_base), str(adapters["broken"]), str(adapters["identity"]), round_dir=rd)
    played, ids = rep["agent_played"], [t.task_id for t in played_tasks(cfg)]
    assert played["runner"] == "hermes" and rep["sampling"]["tasks"]["agent_runner"] == "hermes"
    assert played["before"]["task_ids"] == played["after"]["task_ids"] == ids and len(ids) == 10
    assert played["before"]["pass_rate"] > 0.2 and played["after"]["pass_rate"] < played["before"]["pass_rate"]
    assert played["harm"] in rep["reasons"] and played["harm"].startswith("the real Hermes Agent: held-out success")
    assert played["gain"]["gain_hi"] < 0 and not rep["passed"]
    row = rep["per_family"]["hermes"]  # the built-in loop's episodes on the same held-out tasks: non-inferiority
    assert row["n_pairs"] == 4 and rep["sampling"]["tasks"]["agent_played"] == 10
    assert {"add", "hermes"} <= set(rep["per_family"])  # the string families as before, beside it
    for arm, adapter in (("candidate", adapters["broken"]), ("baseline", adapters["identity"])):
        log = ValidateLayout(rd / "validate").hermes(arm).log.requests
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        assert {r["model"] for r in recs} == {str(adapter.resolve())}  # this arm's policy answered Hermes
        assert len({r["conversation_id"] for r in recs}) == 10 and all(r["http_status"] == 200 for r in recs)


def test_execute_logs_the_real_hermes_agent_s_conversations(hermes_bin, tiny_base, tmp_path):  # noqa: F811
    """agent.runner hermes: execute's agent episodes are the real Hermes Agent's runs against the policy served on
    127.0.0.1, logged as the conversations the server answered (the messages Hermes sent, its tools as its requests
    carried them, the verifier's reward) under the conversation ids the server filed them by, each answer with the
    exact tokens the policy saw and sampled: prep reads them as OpenAI lines, and turn-level training takes every
    turn's prompt token for token (prompt_source logged), as a live round does."""
    from hermes_lab.agents.execute import execute
    from hermes_lab.config.schema import load_config
    from hermes_lab.core.layout import RoundLayout
    from hermes_lab.logs import readers

    over = {"round.runs_dir": str(tmp_path / "runs"), "agent.runner": "hermes", "execute.agent_tasks": 6}
    cfg = load_config(REPO / "params" / "embedded.yaml", {**over, "execute.num_tasks": 8})
    rd = RoundLayout(tmp_path / "runs" / "round-01")
    res = execute(cfg, rd.trajectories, seed=3)
    assert res["agent_runner"] == "hermes" and res["agent_episodes"] == 6
    lines = [json.loads(x) for x in rd.agent_episodes.read_text().splitlines()]
    tasks = H.generate_tasks(6, split="train", seed=3)
    assert [x["task_id"] for x in lines] == [t.task_id for t in tasks]
    served = [json.loads(x) for x in rd.hermes.log.requests.read_text().splitlines()]
    for line, t in zip(lines, tasks, strict=True):
        roles = [m["role"] for m in line["messages"]]
        # as the server was sent them: Hermes's system prompt first, then the task, the calls, their results
        assert roles[:2] == ["system", "user"] and line["messages"][1]["content"] == t.question
        assert roles[-1] == "assistant" and "Hermes Agent" in line["messages"][0]["content"]
        # each answer kept (a turn Hermes sent again replaces what followed it) with the exact tokens of its turn
        turns = [x for x in line["meta"]["turns"] if "message" in x]
        assert [x["message"] for x in turns] == [i for i, r in enumerate(roles) if r == "assistant"]
        assert all(x["tokens"]["prompt_ids"] and x["tokens"]["completion_ids"] for x in turns)
        assert {"read_file", "write_file", "patch", "search_files", "terminal"} <= {
            x["function"]["name"] for x in line["tools"]
        }
        assert any(r["conversation_id"] == line["id"] for r in served)  # filed under the id it is logged by
        assert 0 <= line["reward"] <= 5 and line["runner"] == "hermes"
    assert sum(x["reward"] >= 3 for x in lines) == round(res["agent_success"] * 6)
    path = rd.agent_episodes
    fmt = readers.detect(path, lines[0])
    parsed = [readers.parse_line(x, fmt, str(path), i, cfg.reward.scale, 200_000) for i, x in enumerate(lines, 1)]
    assert fmt == "openai" and all(p["messages"] for p in parsed)
    from transformers import AutoTokenizer

    from hermes_lab.train.turns import turn_prompts

    tok = AutoTokenizer.from_pretrained(tiny_base)
    rows = [
        r for x in lines for r in turn_prompts(x, "all", tok, cfg.data.max_seq_len - cfg.grpo.turn_completion_length)
    ]
    assert len(rows) == sum(m["role"] == "assistant" for x in lines for m in x["messages"])
    assert {r["prompt_source"] for r in rows} == {"logged"}  # the tokens the policy saw, none re-rendered
    first = lines[0]["meta"]["turns"][0]["tokens"]["prompt_ids"]
    assert rows[0]["prompt_ids"] == first
