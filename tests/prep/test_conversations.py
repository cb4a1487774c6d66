"""Agent conversations in (issue 27): what the real Hermes Agent 0.19.0 wrote (tests/fixtures/hermes/, remade by
its make_fixtures.py) and OpenAI chat logs become canonical conversation records, rewarded, deduped, split by
task and written for the trainer (prep's conversations/ dataset) and the reviewer (the review queue).

Every input goes through the real prep (``hermes-lab prep`` / ``run_prep``): trajectory_samples.jsonl +
failed_trajectories.jsonl, the batch runner's trajectories.jsonl (plain, .jsonl.gz, compressed), the sessions
folder, state.db (read-only; a compression chain and a sub-agent), an OpenAI-messages file, and the hostile
variants, each rejected by line with its reason.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.logs import readers
from hermes_lab.logs import record as C
from hermes_lab.prep import outcomes
from hermes_lab.prep.run import run_prep

from repo_paths import FIXTURES, REPO

FIX = FIXTURES / "hermes"
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
SCALE = 5.0


def cfg(**over):
    # these tests read logs the outcome rules reward: the learning_signal gate warns (tests/prep/test_honest_rewards.py
    # holds it to blocking by default)
    return load_config(None, overrides={"data.min_samples": 1, "conversations.no_signal": "warn", **over})


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def prep(tmp_path: Path, inputs: list[Path], name: str = "out", **kw) -> tuple[dict, Path]:
    over = kw.pop("over", {})
    res = run_prep(inputs, tmp_path / name, cfg(**over), make_plots=kw.pop("plots", False), **kw)
    return res.summary, tmp_path / name


# ------------------------------------------------------------------------------- the Done-when inputs
def test_hermes_trajectory_pair_through_the_cli_every_conversation_accepted_with_outcome_rewards(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [PY, "-m", "hermes_lab.cli.main", "prep", "--input", str(FIX / "trajectory_samples.jsonl"),
         str(FIX / "failed_trajectories.jsonl"), "--output", str(out), "--set", "data.min_samples=1",
         "--set", "conversations.no_signal=warn"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "3 accepted, 0 rejected" in p.stdout and "3 conversations" in p.stdout and "outcome 3" in p.stdout
    recs = lines(out / "accepted.jsonl")
    assert [r["source"]["format"] for r in recs] == ["hermes_trajectory"] * 3
    ok, failed = recs[0], recs[2]  # trajectory_samples.jsonl line 1; failed_trajectories.jsonl line 1
    assert (Path(failed["source"]["file"]).name, failed["source"]["line"]) == ("failed_trajectories.jsonl", 1)
    # the logged signals: completed from the line, the failed file's run ran out of turns
    # "completed" is not success: nothing verified it, so the outcome rules pay half marks (below the threshold 3)
    assert ok["outcome"]["completed"] is True and ok["outcome"]["inferred"] is False and ok["reward"] == SCALE / 2
    assert failed["outcome"] == failed["outcome"] | {"completed": False, "partial": False, "inferred": False}
    assert failed["reward"] == 0.0 and {r["reward_source"] for r in recs} == {"outcome"}
    # what the agent did: a terminal call with JSON arguments, its result, reasoning, the tools it was offered
    msgs = ok["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    call = msgs[2]["tool_calls"][0]
    assert call["function"] == {"name": "terminal", "arguments": '{"command": "echo hello"}'}
    assert msgs[3]["tool_call_id"] == call["id"] and msgs[3]["name"] == "terminal" and "hello" in msgs[3]["content"]
    assert msgs[2]["reasoning"].startswith("The user asks") and "<think>" not in json.dumps(msgs)
    assert {t["function"]["name"] for t in ok["tools"]} == {"terminal", "process"}
    assert "<tools>\n[" not in msgs[0]["content"]  # the schemas are in tools, not twice
    s = json.loads((out / "summary.json").read_text())
    assert s["conversations"]["reward_sources"] == {"outcome": {"conversations": 3, "mean_reward": round(5 / 3, 4)}}
    assert "'completed' 2.5/5 (below the success threshold 3" in p.stdout.splitlines()[0]  # said first
    assert s["counts"]["read"] == s["counts"]["accepted"] + s["counts"]["rejected"] + s["counts"]["duplicates"]


def test_the_other_shapes_through_the_cli_batch_file_sessions_folder_state_db_openai_file(tmp_path):
    inputs = ["batch_trajectories.jsonl", "sessions", "state.db", "openai_messages.jsonl"]
    out = tmp_path / "out"
    p = subprocess.run(
        [PY, "-m", "hermes_lab.cli.main", "prep", "--input", *(str(FIX / i) for i in inputs), "--output", str(out),
         "--set", "data.min_samples=1", "--set", "conversations.no_signal=warn"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    per = [(Path(f["file"]).name, f["format"], f["read"], f["rejected"]) for f in s["per_file"]]
    assert per == [
        ("batch_trajectories.jsonl", "hermes_trajectory", 3, 0),
        ("sessions", "hermes_session", 6, 0),
        ("state.db", "hermes_state", 3, 0),
        ("openai_messages.jsonl", "openai", 6, 0),
    ]
    # each session snapshot or OpenAI line repeats a run read before it (a batch run, its own session): duplicates
    assert s["counts"]["accepted"] + s["counts"]["duplicates"] == 18 and s["counts"]["accepted"] >= 7
    assert f"{s['counts']['accepted']} conversations" in p.stdout


def test_two_calls_in_one_turn_are_answered_in_order(tmp_path):
    rec = readers.parse_line(lines(FIX / "trajectory_samples.jsonl")[1], "hermes_trajectory", "f", 2, SCALE, 10**6)
    a = rec["messages"][2]
    assert [c["function"]["arguments"] for c in a["tool_calls"]] == [
        '{"command": "date -u +%Y"}',
        '{"command": "uname -s"}',
    ]
    results = [m for m in rec["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [c["id"] for c in a["tool_calls"]]
    assert rec["outcome"]["tool_calls"] == 2 and rec["outcome"]["unanswered_calls"] == 0


def test_batch_runner_file_plain_gzip_and_compressed(tmp_path):
    s, out = prep(tmp_path, [FIX / "batch_trajectories.jsonl", FIX / "batch_trajectories.jsonl.gz"])
    per = {Path(f["file"]).name: f for f in s["per_file"]}
    assert per["batch_trajectories.jsonl"]["accepted"] == 3
    assert per["batch_trajectories.jsonl.gz"]["duplicates"] == 3  # the same lines, gzip members concatenated
    batch = lines(out / "accepted.jsonl")
    assert all(r["meta"]["prompt_index"] in (0, 1, 2) and r["outcome"]["api_calls"] == 2 for r in batch)
    # the process tool answered {"error": ...}: the runner's tool_error_counts say 1, the penalty applies
    bad = next(r for r in batch if r["outcome"]["tool_errors"])
    assert bad["meta"]["tool_stats"]["process"]["failure"] == 1
    assert bad["reward"] == SCALE * 0.4  # completed 0.5 less 0.1, never below partial 0.4
    _, out2 = prep(tmp_path, [FIX / "compressed_trajectories.jsonl"], name="compressed")
    comp = lines(out2 / "accepted.jsonl")
    assert len(comp) == 3 and all(r["outcome"]["compressed"] for r in comp)
    assert all(r["meta"]["compression_metrics"]["was_compressed"] for r in comp)
    # the summary turn is not the task, and a compressed run is the same run: same task (split side), same id
    assert [(r["task_id"], r["conversation_id"]) for r in comp] == [(r["task_id"], r["conversation_id"]) for r in batch]


def test_sessions_folder_and_state_db_read_only(tmp_path):
    db = FIX / "state.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    s, out = prep(tmp_path, [FIX / "sessions", db])
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert not (FIX / "state.db-wal").exists() and not (FIX / "state.db-shm").exists()  # nothing created beside it
    per = {Path(f["file"]).name: f for f in s["per_file"]}
    assert per["sessions"]["format"] == "hermes_session" and per["sessions"]["accepted"] == 6
    assert per["state.db"]["format"] == "hermes_state" and per["state.db"]["read"] == 3  # 4 sessions, 3 conversations
    recs = {r["conversation_id"]: r for r in lines(out / "accepted.jsonl")}
    dups = lines(out / "duplicates.jsonl")
    state = {r["conversation_id"]: r for r in recs.values() if r["source"]["format"] == "hermes_state"}
    state |= {d["conversation_id"]: json.loads(d["raw"]) for d in dups if d["file"].endswith("state.db")}
    chain = next(r for r in state.values() if len(r["meta"]["sessions"]) == 2)
    users = [m["content"] for m in chain["messages"] if m["role"] == "user"]
    assert users[0] == "What is the disk usage of /tmp?" and users[1].startswith("[CONTEXT COMPACTION")
    assert users[2] == "And the kernel release?" and chain["outcome"]["compressed"]
    answers = [m["content"] for m in chain["messages"] if m["role"] == "assistant" and m["content"]]
    assert len(answers) == len(set(answers))  # the hand-off's replayed answer is not there twice
    sub = next(r for r in state.values() if r["parent_conversation_id"])
    assert sub["parent_conversation_id"] in state and sub["meta"]["source_platform"] == "subagent"
    sess = next(r for r in recs.values() if r["source"]["format"] == "hermes_session")
    assert (
        sess["messages"][0]["role"] == "system"
        and sess["tools"]
        and sess["source"]["session"] in sess["source"]["file"]
    )


def test_openai_messages_file_and_trl_prompt_completion(tmp_path):
    f = tmp_path / "chat.jsonl"
    rows = lines(FIX / "openai_messages.jsonl")[:2]
    rows[0]["reward"] = 3.5  # a log that carries its reward keeps it
    rows.append(
        {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    )
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s, out = prep(tmp_path, [f])
    recs = lines(out / "accepted.jsonl")
    assert s["per_file"][0]["format"] == "openai" and len(recs) == 3
    assert (recs[0]["reward"], recs[0]["reward_source"]) == (3.5, "log")
    assert recs[2]["messages"][-1] == {"role": "assistant", "content": "4"} and recs[2]["family"] == "chat"
    assert recs[0]["conversation_id"] == rows[0]["id"]


def test_hostile_variants_are_rejected_by_line_with_reasons(tmp_path):
    s, out = prep(
        tmp_path, [FIX / "trajectory_samples.jsonl", FIX / "hostile.jsonl.gz"], over={"data.max_bad_fraction": 1}
    )
    rej = lines(out / "rejects.jsonl")
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in rej] == [
        ("hostile.jsonl.gz", 1, "malformed JSON"),  # truncated line
        ("hostile.jsonl.gz", 2, "broken tag"),
        ("hostile.jsonl.gz", 3, "tool call arguments not JSON"),
        ("hostile.jsonl.gz", 4, "tool result without a call"),
        ("hostile.jsonl.gz", 5, "message too long"),  # a 5 MB tool result
    ]
    assert "<tool_call> at character" in rej[1]["detail"] and "turn 2 (gpt)" in rej[1]["detail"]
    assert "'ls -la /'" in rej[2]["detail"] and "5242976 characters" in rej[4]["detail"]
    assert rej[4]["raw_truncated"] and len(rej[4]["raw"]) <= 4096  # the 5 MB line is not copied whole
    assert s["counts"] | {"accepted": 2, "rejected": 5, "read": 7} == s["counts"]


def test_outcome_fields_of_the_wrong_type_are_rejected_by_line_not_at_the_dataset_build(tmp_path):
    """A log's completed / partial / end_reason / api_calls become typed columns of the conversations dataset: a
    string "yes" or a count as text is a reject with its reason (it crashed prep's dataset build), on the line and
    in its outcome object alike; the valid lines beside them are accepted."""
    convo = lambda i: [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]  # noqa: E731
    bad = [("completed", "yes"), ("api_calls", "3"), ("end_reason", 5), ("partial", 1), ("api_calls", True)]
    bad += [("api_calls", -2)]
    rows = [{"messages": convo(i)} for i in range(6)]
    rows += [{"messages": convo(10 + i), k: v} for i, (k, v) in enumerate(bad)]
    rows += [{"messages": convo(20 + i), "outcome": {k: v}} for i, (k, v) in enumerate(bad)]
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s, out = prep(tmp_path, [f], over={"data.max_bad_fraction": 1})
    rej = lines(out / "rejects.jsonl")
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in rej] == [
        ("chat.jsonl", n, "bad outcome field") for n in range(7, 19)
    ]
    assert "completed must be true or false, got a JSON str" in rej[0]["detail"]
    assert "api_calls must be an integer, got a JSON bool" in rej[4]["detail"] and ">= 0" in rej[5]["detail"]
    assert s["counts"]["accepted"] == 6 and s["counts"]["conversations"] == 6


def test_a_damaged_state_db_is_one_reject_and_a_session_file_that_is_not_json_another(tmp_path):
    db = tmp_path / "state.db"
    db.write_bytes((FIX / "state.db").read_bytes()[:4096])  # the header page only: SQLite calls it malformed
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "session_1.json").write_text('{"session_id": "1", "messages": [')
    s, out = prep(tmp_path, [FIX / "trajectory_samples.jsonl", db, sessions], over={"data.max_bad_fraction": 1})
    rej = lines(out / "rejects.jsonl")
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in rej] == [
        ("state.db", None, "unreadable SQLite store"),
        ("session_1.json", None, "malformed JSON"),
    ]
    assert "DatabaseError" in rej[0]["detail"] and s["counts"]["accepted"] == 2


def test_a_session_file_with_a_lone_surrogate_escape_is_rejected_not_a_crash(tmp_path):
    """json reads "\\ud800" in a session file as a lone surrogate, which Arrow's conversations/ rows refuse: the
    session is rejected (invalid Unicode, naming the field) as a JSONL line would be; the others go through."""
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}]
    tool = {"type": "function", "function": {"name": "t", "description": "bad \ud800", "parameters": {}}}
    bad = [msgs[0], {"role": "assistant", "content": "\udfff"}]
    for sid, extra in (("1", {"tools": [tool]}), ("2", {"messages": bad}), ("3", {})):
        (sessions / f"session_{sid}.json").write_text(json.dumps({"session_id": sid, "messages": msgs, **extra}))
    s, out = prep(tmp_path, [sessions], over={"data.max_bad_fraction": 1})
    rej = lines(out / "rejects.jsonl")
    assert [(r["session"], r["reason"], r["detail"]) for r in rej] == [
        ("1", "invalid Unicode", "lone surrogate escape in tools"),
        ("2", "invalid Unicode", "lone surrogate escape in messages"),
    ]
    assert s["counts"]["accepted"] == 1 and lines(out / "accepted.jsonl")[0]["conversation_id"] == "3"


def test_too_many_hostile_lines_stop_prep_naming_the_file(tmp_path):
    from hermes_lab.prep.run import PrepError

    with pytest.raises(PrepError, match=r"hostile.jsonl.gz: 5 of 5 non-blank lines rejected.*line 2: broken tag"):
        prep(tmp_path, [FIX / "hostile.jsonl.gz"])


# ------------------------------------------------------------------------------------- schema drift
def call(cid: str, name: str, arguments) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_hermes_schema_drift_is_normalised():
    calls = [call("a", "terminal", {"command": "ls"}), call("b", "mystery", "{}")]
    raw = [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None, "reasoning_content": "thinking", "tool_calls": json.dumps(calls)},
        {"role": "tool", "tool_call_id": "a", "tool_name": "terminal", "content": "Error: no such file"},
        {"role": "tool", "content": '{"output": "x", "error": null}'},  # no id: answers the next open call
        {"role": "assistant", "content": "done"},
    ]
    msgs = C.check_messages(raw, 10**6)
    assert msgs[0]["content"] == "look\n[image]"
    assert (
        msgs[1]["reasoning"] == "thinking" and msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"}'
    )
    assert [m.get("tool_call_id") for m in msgs[2:4]] == ["a", "b"] and msgs[2]["name"] == "terminal"
    tools = [C.tool_schema({"name": "terminal", "parameters": {}, "required": None}, "t")]
    out = C.outcome_of(msgs, tools)
    assert out | {"tool_calls": 2, "tool_errors": 1, "unknown_tools": ["mystery"], "completed": True} == out


HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ([HI, {"role": "tool", "tool_call_id": "x", "content": "r"}], "tool result without a call"),
        ([HI], "no assistant turn"),
        ([{"role": "robot", "content": "hi"}], "bad role"),
        ([HI, {"role": "assistant", "tool_calls": [call("c", "t", "{")]}], "tool call arguments not JSON"),
        ([HI, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}], "bad tool calls"),
    ],
)
def test_malformed_messages_name_the_message(raw, reason):
    with pytest.raises(C.Invalid) as e:
        C.check_messages(raw, 10**6)
    assert e.value.reason == reason and e.value.detail


def test_outcome_rules_order_and_penalty():
    assert outcomes.outcome_reward({"tool_errors": 0, "completed": True}, cfg().conversations, SCALE) == 2.5
    rules = cfg(**{"conversations.completed_reward": 1.0}).conversations  # completion paid as full marks
    r = lambda **o: outcomes.outcome_reward({"tool_errors": 0, **o}, rules, SCALE)  # noqa: E731
    assert (
        r(completed=True) == 5.0 and r(completed=True, tool_errors=3) == 3.5 and r(completed=True, tool_errors=9) == 2.0
    )
    assert r(completed=False, partial=True) == 2.0 and r(completed=False, partial=True, tool_errors=9) == 0.0
    assert r(completed=False, partial=False) == 0.0
    with pytest.raises(Exception, match="failed_reward <= partial_reward <= completed_reward"):
        cfg(**{"conversations.partial_reward": 0.9, "conversations.completed_reward": 0.5})


# ---------------------------------------------------------------------------------- rewards, dedupe, split
def chat_line(task: str, answer: str, completed: bool, **kw) -> str:
    msgs = [{"role": "user", "content": task}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": msgs, "completed": completed, **kw}) + "\n"


def test_feedback_joined_by_conversation_id_and_judge_for_the_rest(tmp_path):
    chat = tmp_path / "chat.jsonl"
    rows = [chat_line("Sum 2 and 3.", a, a == "5", id=f"s{i}") for i, a in enumerate(["5", "5.", "six", "4"])]
    rows += [chat_line("Name the capital of France.", "Paris", True, id="p0")]  # alone: nothing to compare with
    chat.write_text("".join(rows))
    fb = tmp_path / "feedback.jsonl"
    fb.write_text(
        json.dumps({"conversation_id": "s3", "reward": 1.5, "source": "tests"})
        + "\nnot json\n"
        + json.dumps({"conversation_id": "nobody", "reward": 9})
        + "\n"
    )
    s, out = prep(tmp_path, [chat], feedback=[fb], over={"conversations.reward": "judge"}, plots=True)
    got = {r["conversation_id"]: r for r in lines(out / "accepted.jsonl")}
    assert (got["s3"]["reward"], got["s3"]["reward_source"]) == (1.5, "feedback:tests")
    assert (got["p0"]["reward"], got["p0"]["reward_source"]) == (SCALE / 2, "outcome")
    # the local judge: each answer against the best other conversation of its task ("5", completed: outcome 2.5,
    # unverified, so compared as a reference answer, not as a failure)
    assert [got[c]["reward_source"] for c in ("s0", "s1", "s2")] == ["judge"] * 3
    # "5." against "5": similarity 2/3; "six": none; "5" itself against the next best, "4" (1.5, a fail)
    assert [got[c]["reward"] for c in ("s0", "s1", "s2")] == [2.5, round(SCALE * 2 / 3, 4), 0.0]
    srcs = s["conversations"]["reward_sources"]
    assert {k: v["conversations"] for k, v in srcs.items()} == {"feedback": 1, "outcome": 1, "judge": 3}
    fbi = s["conversations"]["feedback"]
    assert (fbi["lines"], fbi["bad_lines"], fbi["matched"]) == (3, 2, 1)
    assert "feedback.jsonl:2: not JSON" in fbi["first_errors"][0]
    assert (out / "plots" / "conversations.png").stat().st_size > 10_000


def test_exact_near_and_id_duplicates(tmp_path):
    # a file read twice: exact; a run's trajectory line and its session snapshot: near (what was said, the
    # system prompt and schemas aside); a batch run and its compressed copy: the same conversation id
    s, out = prep(tmp_path, [FIX / "trajectory_samples.jsonl", FIX / "sessions", FIX / "trajectory_samples.jsonl"])
    dups = lines(out / "duplicates.jsonl")
    kinds = [(Path(d["file"]).name, d["kind"]) for d in dups]
    assert kinds.count(("trajectory_samples.jsonl", "exact")) == 2
    assert ("sessions", "near") in kinds and all(d["duplicate_of"] for d in dups)
    assert s["counts"]["duplicates"] == len(dups)
    s, out = prep(tmp_path, [FIX / "batch_trajectories.jsonl", FIX / "compressed_trajectories.jsonl"], name="ids")
    dups = lines(out / "duplicates.jsonl")
    assert [(Path(d["file"]).name, d["kind"]) for d in dups] == [("compressed_trajectories.jsonl", "id")] * 3


def test_split_by_task_keeps_every_conversation_of_a_task_on_one_side(tmp_path):
    import datasets

    f = tmp_path / "chat.jsonl"
    rows = []
    for t in range(40):
        for k in range(3):
            msgs = [{"role": "user", "content": f"task {t}: do it"}, {"role": "assistant", "content": f"answer {k}"}]
            rows.append({"messages": msgs, "task_id": f"t{t}", "completed": k > 0})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s, out = prep(tmp_path, [f], over={"data.holdout_fraction": 0.3})
    ds = datasets.load_from_disk(str(out / "conversations"))
    sides: dict[str, set] = {}
    for tid, split in zip(ds["task_id"], ds["split"]):
        sides.setdefault(tid, set()).add(split)
    assert all(len(v) == 1 for v in sides.values()) and {"train", "heldout"} == set().union(*sides.values())
    held = {t for t, v in sides.items() if v == {"heldout"}}
    assert set(datasets.load_from_disk(str(out / "heldout_dataset"))["task_id"]) == held
    assert s["conversations"]["split"] == {"train": ds["split"].count("train"), "heldout": len(held) * 3}
    assert ds["reward"][:3] == [0.0, 2.5, 2.5]  # completed false without partial: failed; completed: half marks


def test_a_conversation_whose_prompt_is_held_out_elsewhere_moves_to_heldout_in_the_dataset(tmp_path):
    """conversations/ is written during the ingest with each record's own split; a prompt also seen under a
    held-out task_id moves its train-side conversations to heldout (the prompt sets' rule), rewritten at distill."""
    import datasets

    from hermes_lab.logs.lines import split_of

    held = next(f"h{i}" for i in range(100) if split_of(f"h{i}", 0.3, {}))
    train = next(f"t{i}" for i in range(100) if not split_of(f"t{i}", 0.3, {}))
    rows = [(f"ask {k}", tid, f"answer {k} {tid}") for k in range(3) for tid in (train, held)]
    rows += [("alone", train, "fine")]
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}],
                                     "task_id": t}) + "\n" for p, t, a in rows))  # fmt: skip
    s, out = prep(tmp_path, [f], over={"data.holdout_fraction": 0.3})
    ds = datasets.load_from_disk(str(out / "conversations"))
    assert ds["split"] == ["heldout"] * 6 + ["train"]
    assert s["split"]["records_moved_to_heldout"] == 3 and s["conversations"]["split"] == {"train": 1, "heldout": 6}


def test_review_queue_carries_the_conversation_and_the_widget_escapes_it(tmp_path):
    from hermes_lab.review.app import ReviewApp, conversation_html
    from hermes_lab.review.gate import LabelStore

    f = tmp_path / "chat.jsonl"
    evil = "<script>alert(1)</script>"
    terminal = call("c1", "terminal", json.dumps({"command": evil}))
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"run {evil}"},
        {"role": "assistant", "content": None, "reasoning": f"plan {evil}", "tool_calls": [terminal]},
        {"role": "tool", "tool_call_id": "c1", "name": "terminal", "content": "line\n" * 400 + evil},
        {"role": "assistant", "content": f"done {evil}"},
    ]
    f.write_text(json.dumps({"messages": msgs, "id": "conv-evil"}) + "\n")
    _, out = prep(tmp_path, [f], over={"data.review_fraction": 1.0})
    item = lines(out / "review_queue.jsonl")[0]
    assert item["conversation_id"] == "conv-evil" and item["messages"][3]["tool_call_id"] == "c1"
    page = conversation_html(item["messages"], item["tools"])
    assert "<script>" not in page and page.count("&lt;script&gt;") >= 5
    assert page.count("<details") == 3  # system prompt, reasoning, the long tool result
    assert "&#8594; call <code>terminal({&quot;command&quot;: &quot;&lt;script&gt;" in page
    app = ReviewApp(out / "review_queue.jsonl", tmp_path / "labels.jsonl", reviewer="ada")
    assert "Conversation" in app.prompt_label.value and "conv-evil" in app.prompt_label.value
    assert "<script>" not in app.prompt_html.value and "5.0" not in app.header.value  # the reward stays hidden
    app.label(2)
    assert LabelStore(tmp_path / "labels.jsonl").labelled_ids("ada") == {item["review_id"]}


def test_conversation_numbers_and_plot_go_to_mlflow(tmp_path, mlflow_store):
    from hermes_lab.core import tracking

    with tracking.stage_run("prep", runs_dir=tmp_path) as run:
        s, _ = prep(tmp_path, [FIX / "batch_trajectories.jsonl", FIX / "state.db"], plots=True)
    r = mlflow_store.MlflowClient().get_run(run.info.run_id)
    m = r.data.metrics
    # 3 batch runs, 3 state.db conversations of which the sub-agent's repeats a batch run's exchange (near)
    assert m["prep/conversations"] == m["prep/conv_count"] == 5 and m["prep/conv_tool_errors_total"] == 1
    assert m["prep/conv_turns_mean"] == s["conversations"]["turns"]["mean"]
    assert m["prep/conv_reward_source_outcome"] == 5 and m["prep/conv_reward_mean_outcome"] > 0
    arts = {a.path for a in mlflow_store.MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert "plots/conversations.png" in arts


def test_conversations_in_partitions_give_the_same_outputs(tmp_path, monkeypatch):
    """Prep's partitions (memory-bounded distill): the conversations dataset, review queue and sinks do not change."""
    import datasets

    from hermes_lab.prep import run as prep_module

    inputs = [FIX / "trajectory_samples.jsonl", FIX / "failed_trajectories.jsonl", FIX / "batch_trajectories.jsonl"]
    over = {"data.review_fraction": 0.5, "data.holdout_fraction": 0.3}
    prep(tmp_path, [*inputs, FIX / "state.db"], name="one", over=over)
    monkeypatch.setattr(prep_module, "_partitions", lambda files, budget: 3)
    s3, _ = prep(tmp_path, [*inputs, FIX / "state.db"], name="three", over=over)
    assert s3["memory"]["partitions"] == 3
    for name in ("accepted", "duplicates", "review_queue"):
        assert (tmp_path / "one" / f"{name}.jsonl").read_bytes() == (tmp_path / "three" / f"{name}.jsonl").read_bytes()
    a, b = (datasets.load_from_disk(str(tmp_path / x / "conversations")) for x in ("one", "three"))
    assert a.to_list() == b.to_list() and a.features == b.features and len(a) == 8


def test_seed_and_conversation_lines_carry_their_tests_into_the_prompt_sets(tmp_path):
    """The tests reward's column (issue #32) on both of ingest's paths: a seed line's tests and a JSONL
    conversation's ride into the prompt sets, normalised; a conversation without any gets null; tests that
    do not parse reject the line on either path."""
    from datasets import load_from_disk

    from hermes_lab.sandbox.shapes import parse_tests

    asserts = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    seed = tmp_path / "seed.jsonl"
    seed.write_text(
        json.dumps({"prompt": "Write add(a, b).", "response": "def add(a, b): return a + b", "reward": 5,
                    "task_id": "s-1", "test_list": asserts}) + "\n"
        + json.dumps({"prompt": "Say hi.", "response": "hi", "reward": 4, "task_id": "s-2"}) + "\n"
        + json.dumps({"prompt": "Write sub.", "response": "x", "reward": 1, "task_id": "s-3", "tests": 7}) + "\n"
    )  # fmt: skip
    chat = tmp_path / "chat.jsonl"

    def conv(user, answer, **extra):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], **extra}

    chat.write_text(
        json.dumps(conv("Write mul(a, b).", "def mul(a, b): return a * b", reward=5, tests=["assert mul(2, 3) == 6"]))
        + "\n" + json.dumps(conv("What is 2+2?", "4", reward=5)) + "\n"
        + json.dumps(conv("Write div.", "x", reward=1, tests={"kind": "nope"})) + "\n"
    )  # fmt: skip
    s, out = prep(tmp_path, [seed, chat], over={"data.max_bad_fraction": 1})
    rej = lines(out / "rejects.jsonl")
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in rej] == [
        ("seed.jsonl", 3, "bad tests"),
        ("chat.jsonl", 3, "bad tests"),
    ]
    rows = {}
    for name in ("grpo_dataset", "heldout_dataset"):
        if any((out / name).glob("*.arrow")):  # datasets saves an empty set without a shard it can load back
            rows |= {r["prompt"]: r["tests"] for r in load_from_disk(str(out / name)).to_list()}
    assert rows["Write add(a, b)."] == parse_tests({"test_list": asserts}).to_json()
    assert rows["Write mul(a, b)."] == parse_tests({"tests": ["assert mul(2, 3) == 6"]}).to_json()
    assert rows["Say hi."] is None and rows["What is 2+2?"] is None
    recs = [r for r in lines(out / "accepted.jsonl") if "messages" in r]
    assert [r.get("tests") for r in recs] == [rows["Write mul(a, b)."], None]  # the record keeps them
    assert s["counts"]["accepted"] == 4


def test_the_config_and_prep_name_the_same_formats():
    """conversations.format's choices (config layer: a Literal of its own) are the formats prep reads, plus auto."""
    import typing

    from hermes_lab.config.round_data import ConversationsSection
    from hermes_lab.logs.record import FORMATS

    hint = typing.get_type_hints(ConversationsSection)["format"]
    assert typing.get_args(hint) == ("auto", *FORMATS)


def test_tool_results_and_arguments_are_written_as_the_standard_encoder_writes_them():
    """A tool result or call's arguments that is JSON becomes text exactly as json.dumps(ensure_ascii=False) writes
    it (conversation._json_text builds it from orjson's strings): every character, floats, nesting, and what only
    the standard encoder writes (NaN, a lone surrogate, keys that are no strings) or refuses (too deep, a huge int)."""
    import random

    rng = random.Random(45)
    atoms = [None, True, False, 0, -1, 2**63, -(2**64), 10**30, 1.5e308, 5e-324, 0.1, -0.0, 1e16, 1e-7,
             float("nan"), float("-inf"), "", "é\u2028", "\x00\x1f\x7f", "日本😀", "\ud800", 'a"b\\c\n\t\r\b\f',
             10**5000]  # fmt: skip
    keys = ["k", "", "a:b", "\ud801", 1, None, 2.5, True]

    def value(depth: int):
        r = rng.random()
        if depth > 4 or r < 0.4:
            return rng.choice(atoms)
        if r < 0.7:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(4))}

    def written(fn, v):
        try:
            return "text", fn(v)
        except (TypeError, ValueError, RecursionError) as e:
            return "refused", type(e).__name__

    deep: list = []
    x = deep
    for _ in range(5000):
        x.append([])
        x = x[0]
    values = [value(0) for _ in range(3000)] + [deep, "".join(map(chr, range(0xD800)))]
    for v in values:
        assert written(C._json_text, v) == written(lambda v: json.dumps(v, ensure_ascii=False), v), v
    assert 1500 < sum(written(C._json_text, v)[0] == "text" for v in values) < len(values) - 200
