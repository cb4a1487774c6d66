"""The policy served exactly as it was trained (issue 41): `hermes-lab serve` with in-process arms (embedded:tiny on
both, an A/A) driven by the stand-in agent (hermes_lab.agents.standin: the openai SDK, Hermes's own tool schemas
sent, the round's agent family played (hermes: workspace tasks), its calls executed by the client on the task's
workspace, the results sent back, the verifier's score posted by conversation id).

- Served = offline: held-out agent episodes played through the gateway succeed as often as the same policy's offline
  episodes (hermes_lab.policy.episodes) on the same tasks and tool results, and most first answers are parsed tool
  calls (OpenAI tool_calls, streamed as tool-call deltas on every third request).
- Parity: for every logged conversation (string tasks and agent episodes) the prompt token ids of the gateway's log
  are those of the episode runner (its continuation replayed on the logged completions, and its own greedy episodes),
  of TRL's GRPOTrainer (its environment prompt and tool suffix, its string prompts) and of turn-level training on
  the log through prep (the trainer's tokens, logged and re-rendered).
"""

from __future__ import annotations

import difflib
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from gateway_process import Gateway

from hermes_lab.policy import turn
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import workspace as W

from repo_paths import FIXTURES, REPO
from test_gateway_conversations import HERMES_DRIVER
from test_turn import trl_self

pytestmark = pytest.mark.slow
N_EPISODES, N_SAMPLED, SEED = 48, 24, 7


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    args = ["--params", str(REPO / "params/embedded.yaml"), "--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny"]
    gw = Gateway(tmp, args).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def hermes_agent():
    """hermes-agent 0.19.0's python, in its own cached virtualenv (tests/fixtures/hermes/make_fixtures.py's)."""
    sys.path.insert(0, str(FIXTURES / "hermes"))
    import make_fixtures as mf

    try:
        return mf.hermes_python("0.19.0")
    except (SystemExit, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"hermes-agent 0.19.0 cannot be installed here: {e}")


def conversations(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["conversation_id"], []).append(r)
    return {c: sorted(rs, key=lambda r: r["turn"]) for c, rs in out.items()}


def test_served_episodes_match_offline_and_every_prompt_token_is_the_trainers(served, tmp_path):
    from trl import GRPOTrainer

    from hermes_lab.agents.standin import run_agent
    from hermes_lab.policy import episodes as E
    from hermes_lab.policy.model import build_tiny_policy, load_policy

    kw = dict(seed=SEED, split="heldout", agent_share=1.0, stream_every=3, progress=False)
    greedy = run_agent(served.url, N_EPISODES, 8, temperature=0, **kw)
    sampled = run_agent(served.url, N_SAMPLED, 8, **kw)  # at execute.temperature: slips, spliced continuations
    strings = run_agent(served.url, 8, 4, seed=5, stream_every=2, progress=False)
    for s in (greedy, sampled, strings):
        assert s["errors"] == 0 and s["feedback_accepted"] == s["requests"], s["first_errors"]
    tiny = build_tiny_policy(REPO / "runs", 0)  # what embedded:tiny names (built once per machine)
    policy = load_policy(str(tiny))
    tasks = H.generate_tasks(N_EPISODES, "heldout", seed=SEED)
    offline = E.run_episodes(policy, tasks, temperature=0, seed=SEED)  # the same tasks and tool results
    off = sum(e.success for e in offline) / len(offline)
    ag = greedy["agent"]
    calls = ag["first_call_rate"]
    print(f"greedy: served {ag['success']:.1%} vs offline {off:.1%}; first answers with tool calls {calls:.1%}")
    sa, build = sampled["agent"], json.loads((tiny / "build.json").read_text())["hermes"]
    print(
        f"sampled at 0.9: served {sa['success']:.1%} (n={N_SAMPLED}) vs offline {build['episode_success']:.1%} "
        f"(build.json, n={build['sampled']['n']}); first answers with tool calls {sa['first_call_rate']:.1%}"
    )
    assert abs(ag["success"] - off) <= 0.10 and ag["first_call_rate"] >= 0.6
    # sampled, the base policy's hermes episodes open with a tool call ~67% of the time offline (build.json, n=140): the
    # served ones stay far above a third (a text-only arm: 0%), and with the greedy ones well above 60%
    n = N_EPISODES + N_SAMPLED
    assert (
        sa["first_call_rate"] >= 0.35
        and (N_EPISODES * ag["first_call_rate"] + N_SAMPLED * sa["first_call_rate"]) / n >= 0.6
    )

    tok = policy.tokenizer
    convs = conversations(served.records())
    ran = {r["conversation_id"] for run in (greedy, sampled) for r in run["results"]}
    agent_convs = {c: rs for c, rs in convs.items() if c in ran and rs[0]["tools_hash"]}
    string_convs = {c: rs for c, rs in convs.items() if c in {r["conversation_id"] for r in strings["results"]}}
    assert len(agent_convs) == N_EPISODES + N_SAMPLED and len(string_convs) == 8
    # the log: every answer's tokens, and its tool calls in OpenAI's form (streamed ones assembled from deltas)
    streamed_calls = 0
    for rs in convs.values():
        for r in rs:
            t = r["tokens"]
            assert len(t["logprobs"]) == len(t["completion_ids"]) and all(x <= 0 for x in t["logprobs"])
            assert r["usage"]["prompt_tokens"] == len(t["prompt_ids"])
            if r["tool_calls"]:
                assert r["finish_reason"] == "tool_calls" and all(c["id"].startswith("call_") for c in r["tool_calls"])
                json.loads(r["tool_calls"][0]["function"]["arguments"])
                streamed_calls += r["stream"]
    assert streamed_calls >= 5

    # 1. the episode runner: its continuation (turn.prompt_ids, then turn.continue_ids on the logged completion and
    # the tool results), replayed on every logged agent conversation, and TRL's own (GRPOTrainer's)
    env = H.WorkspaceEnv()
    me = trl_self(tok, W.env_tools(env))
    schema = W.tool_schema()
    for rs in agent_convs.values():
        msgs = [turn.chat_message(m) for m in rs[0]["messages"]]
        ids = turn.prompt_ids(tok, msgs, schema)
        (trl_ids,), _, _ = GRPOTrainer._tokenize_prompts(me, [msgs])
        for k, r in enumerate(rs):
            assert r["tokens"]["prompt_ids"] == ids == list(trl_ids), (k, r["request_id"])
            if k + 1 < len(rs):
                results = [turn.chat_message(m) for m in rs[k + 1]["messages"]]
                assert [m["role"] for m in results] == ["tool"] * len(results)
                done = r["tokens"]["completion_ids"]
                ids = turn.continue_ids(tok, ids, done, results)
                trl_ids = list(trl_ids) + done + GRPOTrainer._get_tool_suffix_ids(me, results)
    # ... and the runner's own greedy episodes, where the served conversation is the same one (same completions)
    greedy_convs = {r["task_id"]: agent_convs[r["conversation_id"]] for r in greedy["results"]}
    same = 0
    for ep in offline:
        rs = greedy_convs[ep.task.task_id]
        if [x["tokens"]["completion_ids"] for x in rs] == [c for _, c in ep.turn_ids]:
            assert [x["tokens"]["prompt_ids"] for x in rs] == [p for p, _ in ep.turn_ids]
            same += 1
    assert same >= 0.8 * N_EPISODES

    # 2. string tasks: the completion form, as Policy.generate tokenizes it and TRL tokenizes a string prompt
    plain = SimpleNamespace(processing_class=tok)
    for rs in string_convs.values():
        (r,) = rs
        prompt = r["messages"][0]["content"]
        (trl_ids,), _, _ = GRPOTrainer._tokenize_prompts(plain, [prompt])
        assert r["tokens"]["prompt_ids"] == tok(prompt, add_special_tokens=False)["input_ids"] == list(trl_ids)

    # 3. the trainer: the log through prep, turn-level rows on the logged tokens, the trainer's prompt tokens
    from datasets import Dataset, load_from_disk

    from hermes_lab.config.schema import load_config
    from hermes_lab.prep.run import run_prep
    from hermes_lab.train.turns import trainer_class, turn_prompts

    over = {"data.min_samples": 1, "data.max_bad_fraction": 1.0, "round.runs_dir": str(tmp_path / "runs")}
    cfg = load_config(REPO / "params/embedded.yaml", {**over, "data.review_fraction": 1.0})
    res = run_prep([served.log_dir], tmp_path / "prep", cfg, make_plots=False)
    # the simulated reviewer labels an agent conversation as its environment scored it (the posted feedback)
    queue = [json.loads(x) for x in (res.output_dir / "review_queue.jsonl").read_text().splitlines()]
    items = [q for q in queue if q.get("conversation_id") in agent_convs]
    assert items and all(q["simulated_label"] == q["reward"] for q in items)
    table = [r for r in load_from_disk(str(res.output_dir / "conversations")) if r["conversation_id"] in agent_convs]
    assert len(table) >= N_EPISODES  # prep keeps one of a task's identical conversations
    rows, rendered_same, rendered = [], 0, 0
    for rec in table:
        got = turn_prompts(rec, "all", tok, budget=cfg.data.max_seq_len)
        logged = [r["tokens"]["prompt_ids"] for r in agent_convs[rec["conversation_id"]]]
        assert [r["prompt_ids"] for r in got] == logged and {r["prompt_source"] for r in got} == {"logged"}
        rows += got
        # the same conversation from another upstream (no tokens logged): rendered, the same ids where the policy's
        # answers were canonical (greedy: all of them), never longer than what it saw
        bare = turn_prompts({**rec, "meta": "{}"}, "all", tok, budget=cfg.data.max_seq_len)
        for a, b in zip(bare, got):
            rendered += 1
            rendered_same += a["prompt_ids"] == b["prompt_ids"]
    assert rendered_same >= 0.8 * rendered
    ds = Dataset.from_list(
        rows + [{"prompt": r["messages"][0]["content"], "prompt_ids": None} for rs in string_convs.values() for r in rs]
    )
    trainer = SimpleNamespace(processing_class=tok)
    got, _, _ = trainer_class(ds)._tokenize_prompts(trainer, list(ds["prompt"]))
    want = [r["prompt_ids"] for r in rows] + [rs[0]["tokens"]["prompt_ids"] for rs in string_convs.values()]
    assert got == want and len(want) >= 20


@pytest.mark.slow
def test_real_hermes_agent_receives_the_in_process_policys_tool_calls_as_tool_calls(served, hermes_agent, tmp_path):
    """Hermes Agent against in-process arms (the tiny policy on both, rendered with its chat template: Hermes's long
    system prompt and tool schemas are not rendered, the task and the calls so far are): asked held-out tasks of the
    agent family that only read (read a line, find a file), with Hermes's file tools and the tasks' files in its
    working directory, the policy answers with calls of Hermes's own tools. The agent receives them as tool calls
    (its history holds each call, parsed, and the result its own tool made of it: the file's lines), never as text;
    the gateway logged every call, its tokens, and continued the next turn from them."""
    gw, before = served, {r["request_id"] for r in served.records()}
    home, ws = tmp_path / "home", tmp_path / "ws"
    home.mkdir()
    ws.mkdir()
    # only reading kinds: the file toolset writes nowhere on these tasks, and no terminal is offered
    tasks = [t for t in H.generate_tasks(28, "heldout", seed=SEED) if t.kind in ("read", "find")][:6]
    files: dict[str, str] = {}
    for t in tasks:
        assert not set(files) & set(t.files)  # made-up names: no two tasks share a file
        files.update(t.files)
    W.lay_files(ws, files)
    env = {k: v for k, v in gw.env.items() if k != "PYTHONPATH"}
    env.update(HERMES_HOME=str(home), NO_COLOR="1", OPENAI_API_KEY="sk-unused", TERMINAL_CWD=str(ws))
    queries = [t.question for t in tasks]
    p = subprocess.run(
        [
            str(hermes_agent),
            "-c",
            HERMES_DRIVER,
            gw.url + "/v1",
            "hermes-agent-model",
            "sk-unused",
            json.dumps(queries),
            "file",  # Hermes's file toolset only, 4 iterations
            "4",
        ],
        cwd=ws,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    agent_convs = json.loads(p.stdout.split("MESSAGES ", 1)[1].splitlines()[0])
    calls, results = [], []
    for msgs in agent_convs:
        for i, m in enumerate(msgs):
            if m.get("role") == "assistant":
                for c in m.get("tool_calls") or []:
                    calls.append(c)
                    res = next(x for x in msgs[i + 1 :] if x.get("role") == "tool" and x.get("tool_call_id") == c["id"])
                    results.append(res["content"])
    assert calls, agent_convs
    names = {c["function"]["name"] for c in calls}
    assert names <= {"read_file", "search_files"} and names & {"read_file", "search_files"}  # Hermes's own tools
    reads = 0
    for c, res in zip(calls, results):  # the result is what Hermes's own tool made of the call, on the workspace
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] == "read_file" and args.get("path") in files:
            first = files[args["path"]].splitlines()[0]
            assert f"1|{first}" in res, (c, res)
            reads += 1
    assert reads, list(zip(calls, results))
    assert {p.name: p.read_text() for p in ws.iterdir()} == files  # nothing written: reading tasks, file tools
    recs = [r for r in gw.records() if r["request_id"] not in before]
    logged = {c["id"]: c for r in recs for c in r["tool_calls"] or []}
    assert logged and set(logged) == {c["id"] for c in calls}  # every call the policy made reached the agent as one
    # the same call: name and arguments (Hermes keeps a call's arguments re-serialised, keys sorted and compact)
    offered = [t["function"]["name"] for t in W.tool_schema()]  # Hermes's own tools, as it names them
    for c in calls:
        got = logged[c["id"]]["function"]
        if got["name"] != c["function"]["name"]:  # Hermes repairs a name no tool has to its closest one (difflib, 0.7)
            assert got["name"] not in offered, (got, c)
            assert difflib.get_close_matches(got["name"].lower(), offered, n=1, cutoff=0.7) == [c["function"]["name"]]
        assert json.loads(got["arguments"]) == json.loads(c["function"]["arguments"]), (got, c)
    assert all(r["finish_reason"] == "tool_calls" for r in recs if r["tool_calls"]) and all(r["stream"] for r in recs)
    # the opening fits the policy's window whole (no system prompt or schemas rendered); the next turn continued
    # from its tokens
    assert not any(r["tokens"]["truncated"] for r in recs if r["turn"] == 0)
    assert all(r["tokens"]["spliced"] for r in recs if r["turn"] > 0)
