"""Every agent log a user already holds, as round data (issue 44): what hermes-agent 0.19.0's own exports wrote
(``hermes sessions export`` in its default format and ``--format trace``, Claude Code / Agent Trace JSONL: made by
tests/fixtures/hermes/make_exports.py, HERMES_HOME's state.db and session snapshots beside them), what
atroposlib 0.4.0's process mode wrote (tests/fixtures/atropos/make_fixtures.py), the hostile variants of each, and
a folder holding every format prep reads, through the real prep (``run_prep`` / ``hermes-lab prep``).

The slow test runs the real ``hermes sessions export`` (both formats) on the fixture's HERMES_HOME again.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.logs import readers
from hermes_lab.prep.run import GateRefused, PrepError, run_prep

from repo_paths import FIXTURES, REPO

EXPORTS, ATROPOS, HERMES = FIXTURES / "hermes_exports", FIXTURES / "atropos", FIXTURES / "hermes"
VARIANTS = EXPORTS / "variants"
MANIFEST = json.loads((EXPORTS / "MANIFEST.json").read_text())
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
SCALE = 5.0


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def prep(tmp_path: Path, inputs: list[Path], name: str = "out", **over) -> tuple[dict, Path]:
    """run_prep with the data gate at 1 and every bad line tolerated (the counts are what is checked)."""
    over = {"conversations.no_signal": "warn", **over}  # outcome-rewarded logs: the learning_signal gate warns
    cfg = load_config(None, overrides={"data.min_samples": 1, "data.max_bad_fraction": 1.0, **over})
    try:
        summary = run_prep(inputs, tmp_path / name, cfg, make_plots=False).summary
    except GateRefused as e:  # nothing accepted (a file of hostile lines): the summary is still written
        summary = e.result.summary
    for f in [*summary["per_file"], summary["counts"]]:  # the accounting, per input and in total
        assert f["read"] == f["accepted"] + f["rejected"] + f["duplicates"], f
    return summary, tmp_path / name


def rejects(out: Path) -> list[tuple]:
    return [(Path(r["file"]).name, r["line"], r.get("session"), r["reason"]) for r in lines(out / "rejects.jsonl")]


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The fixture's HERMES_HOME: state.db and the session snapshots beside it."""
    dest = tmp_path_factory.mktemp("hermes-home")
    with tarfile.open(EXPORTS / "home.tar.gz") as tar:
        tar.extractall(dest, filter="data")
    return dest / "home"


# --------------------------------------------------------------------------------- Hermes's exports
def test_hermes_jsonl_export_keeps_system_prompt_ids_model_times_and_chains(tmp_path, home):
    s, out = prep(tmp_path, [EXPORTS / "sessions.jsonl"])
    (f,) = s["per_file"]
    # 9 sessions: a compression chain (2 lines) is one conversation; the sub-agent repeats a chat's exchange (near)
    assert (f["format"], f["read"], f["accepted"], f["duplicates"], f["rejected"]) == ("hermes_export", 8, 7, 1, 0)
    recs = {r["conversation_id"]: r for r in lines(out / "accepted.jsonl")}
    with sqlite3.connect(home / "state.db") as db:
        rows = {r[0]: r[1:] for r in db.execute("SELECT id, system_prompt, model FROM sessions")}
    for cid, r in recs.items():
        system_prompt, model = rows[cid]
        assert r["messages"][0] == {"role": "system", "content": system_prompt}  # the issue: it was lost
        assert r["model"] == model == "hermes-fixture-model" and r["started_at"].startswith("2026-")
        assert r["source"] | {"format": "hermes_export", "session": cid} == r["source"]
        calls = [c for m in r["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
        results = [m for m in r["messages"] if m["role"] == "tool"]
        assert calls and [m["tool_call_id"] for m in results] == [c["id"] for c in calls]
        assert r["outcome"]["unanswered_calls"] == 0 and json.loads(calls[0]["function"]["arguments"])
        assert r["meta"]["tools_from"] == "none"  # an export holds no schemas: said, not guessed
    chain = recs[MANIFEST["compression"][0]]
    assert chain["meta"]["sessions"] == MANIFEST["compression"] and chain["outcome"]["compressed"]
    users = [m["content"] for m in chain["messages"] if m["role"] == "user"]
    assert users[0] == "What is the disk usage of /tmp?" and users[-1] == "And the kernel release?"
    dup = lines(out / "duplicates.jsonl")[0]
    assert (
        dup["conversation_id"] == MANIFEST["subagent"]
        and json.loads(dup["raw"])["parent_conversation_id"] == (MANIFEST["subagent_parent"])
    )
    assert s["conversations"]["tools_from"] == {"none": 8}


def test_hermes_trace_export_is_the_same_conversations_as_claude_code_jsonl(tmp_path):
    """The trace folder (one file a session, as `--format trace --session-id` wrote them) is one input; each
    session one conversation, the same exchange as the jsonl export's (near duplicates of it, the system prompt
    aside: hermes-agent drops it from a trace)."""
    s, out = prep(tmp_path, [EXPORTS / "traces"])
    (f,) = s["per_file"]
    assert (f["format"], f["read"], f["accepted"], f["duplicates"], f["rejected"]) == ("claude_code", 9, 8, 1, 0)
    recs = lines(out / "accepted.jsonl")
    assert {r["conversation_id"] for r in recs} == set(MANIFEST["sessions"]) - {MANIFEST["subagent"]}
    for r in recs:
        roles = [m["role"] for m in r["messages"]]
        assert roles[0] == "user" and "assistant" in roles and "tool" in roles and r["model"] == "hermes-fixture-model"
        tool = next(m for m in r["messages"] if m["role"] == "tool")
        call = next(c for m in r["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", []))
        assert tool["tool_call_id"] == call["id"] and call["function"]["name"] in ("terminal", "process")
    errors = {r["conversation_id"]: r["outcome"]["tool_errors"] for r in recs}
    assert sorted(errors.values()) == [0] * 7 + [1]  # the process tool's error result, by Hermes's rule
    s2, _ = prep(tmp_path, [EXPORTS / "sessions.jsonl", EXPORTS / "traces"], name="both")
    traces = s2["per_file"][1]
    # every trace a conversation already read, but a compression's continuation: a trace has no parent link
    assert (traces["accepted"], traces["duplicates"]) == (1, 8)
    (cont,) = [r for r in lines(tmp_path / "both" / "accepted.jsonl") if r["source"]["format"] == "claude_code"]
    assert cont["conversation_id"] == MANIFEST["compression"][1] and cont["outcome"]["compressed"]


def test_trace_shapes_out_of_order_split_sidechain_and_claude_code_own(tmp_path):
    s, out = prep(tmp_path, [EXPORTS / "traces" / f"{MANIFEST['shuffled']}.jsonl"], name="ordered")
    ordered = lines(out / "accepted.jsonl")[0]
    _, out = prep(tmp_path, [VARIANTS / "shuffled.jsonl"], name="shuffled")
    assert lines(out / "accepted.jsonl")[0]["messages"] == ordered["messages"]  # the chain orders the lines
    # a session split across two files: one conversation read as their folder, a broken chain as two inputs
    s, out = prep(tmp_path, [VARIANTS / "split"], name="split")
    (whole,) = lines(out / "accepted.jsonl")
    assert whole["conversation_id"] == MANIFEST["split"] and whole["meta"]["files"] == ["part-1.jsonl", "part-2.jsonl"]
    s, out = prep(tmp_path, [VARIANTS / "split" / "part-1.jsonl", VARIANTS / "split" / "part-2.jsonl"], name="apart")
    assert rejects(out) == [("part-2.jsonl", None, MANIFEST["split"], "broken parentUuid chain")]
    assert "give their folder" in lines(out / "rejects.jsonl")[0]["detail"]
    # a Task sub-agent's sidechain woven into its parent's file: a conversation of its own, linked
    s, out = prep(tmp_path, [VARIANTS / "sidechain.jsonl"], name="side")
    main, side = lines(out / "accepted.jsonl")
    assert main["conversation_id"] == MANIFEST["subagent_parent"] and main["outcome"]["turns"] == 2
    assert side["conversation_id"].startswith(main["conversation_id"] + "/a") and side["meta"]["agent_id"]
    assert side["parent_conversation_id"] == main["conversation_id"]
    assert side["messages"][0]["content"] == "List the files in the root directory."
    # Claude Code's own shape: meta lines, a caveat, thinking, one API message over several lines, is_error
    s, out = prep(tmp_path, [VARIANTS / "claude_code.jsonl"], name="claude")
    (r,) = lines(out / "accepted.jsonl")
    assert s["per_file"][0]["skipped_lines"] == 2 and r["meta"]["left_out"] == {"meta": 1}
    assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert r["messages"][0]["content"].endswith("\n[image]")
    ask = r["messages"][1]
    assert ask["reasoning"].startswith("Step 1") and ask["tool_calls"][0]["function"]["name"] == "process"
    assert r["messages"][2]["is_error"] is True and r["outcome"]["tool_errors"] == 1
    assert r["messages"][3]["reasoning"] and r["messages"][3]["content"].startswith("Done.")
    assert r["reward"] == SCALE * 0.4  # the outcome rules: completed (0.5, unverified), one tool error: partial's


def test_hostile_traces_and_exports_are_rejected_by_line_or_session_with_reasons(tmp_path):
    s, out = prep(tmp_path, [VARIANTS / "hostile.jsonl.gz", VARIANTS / "sessions_hostile.jsonl"])
    got = rejects(out)
    hid = [f"hostile-{n}-{MANIFEST['sessions'][n - 1]}" for n in range(1, 6)]
    assert got == [
        ("hostile.jsonl.gz", 3, None, "malformed JSON"),  # the torn line, by its line
        ("hostile.jsonl.gz", None, hid[0], "broken parentUuid chain"),  # ... and the session it breaks
        ("hostile.jsonl.gz", None, hid[1], "unknown content block"),
        ("hostile.jsonl.gz", None, hid[2], "message too long"),  # a 5 MB tool result
        ("hostile.jsonl.gz", None, hid[3], "broken parentUuid chain"),  # a cycle
        ("hostile.jsonl.gz", None, hid[4], "broken parentUuid chain"),  # a parent no line holds
        ("sessions_hostile.jsonl", 1, None, "malformed JSON"),
        ("sessions_hostile.jsonl", None, "orphan-" + MANIFEST["compression"][0], "tool result without a call"),
    ]
    details = [r["detail"] for r in lines(out / "rejects.jsonl")]
    assert "'server_tool_use'" in details[2] and "hostile.jsonl.gz line" in details[2]
    assert "5242880 characters" in details[3] and "a cycle" in details[4] and "'0000-no-such-line'" in details[5]
    assert all(len(r["raw"]) < 20_000 for r in lines(out / "rejects.jsonl"))  # the 5 MB line is not copied
    assert s["counts"]["accepted"] == 0 and s["counts"]["read"] == 8


# ------------------------------------------------------------------------------------------- state.db
def test_state_db_tools_from_its_snapshots_or_its_system_prompt_or_said_none(tmp_path, home):
    s, out = prep(tmp_path, [home / "state.db"])
    recs = lines(out / "accepted.jsonl")
    assert len(recs) == 7 and all(r["tools"] and r["meta"]["tools_from"] == "snapshot" for r in recs)
    assert {"terminal", "process"} <= {t["function"]["name"] for t in recs[0]["tools"]}
    assert s["conversations"]["tools_from"] == {"snapshot": 8}
    # no snapshots beside it: a <tools> block in the system prompt, else none (the older fixture's store)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(home / "state.db", bare / "state.db")
    schema = [{"name": "terminal", "description": "run a command", "parameters": {"type": "object"}}]
    with sqlite3.connect(bare / "state.db") as db:
        db.execute("UPDATE sessions SET system_prompt = system_prompt || ? WHERE source = 'subagent'",
                   (f"\n<tools>\n{json.dumps(schema)}\n</tools>",))  # fmt: skip
    s, out = prep(tmp_path, [bare / "state.db", HERMES / "state.db"], name="bare")
    assert s["conversations"]["tools_from"] == {"none": 10, "system_prompt": 1}
    sub = next(r for r in lines(out / "duplicates.jsonl") if r["conversation_id"] == MANIFEST["subagent"])
    assert json.loads(sub["raw"])["tools"][0]["function"]["name"] == "terminal"


def test_state_db_rows_with_bad_unicode_reject_their_conversation_only(tmp_path, home):
    """A lone surrogate escape in a message's JSON content, or a row whose text is not UTF-8: that conversation is
    rejected naming its message, the store's others kept (the escape crashed prep in Arrow; the bad bytes made
    SQLite's decode reject the whole store)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copyfile(home / "state.db", bad / "state.db")
    with sqlite3.connect(bad / "state.db") as db:
        users = db.execute("SELECT id, session_id FROM messages WHERE role = 'user' ORDER BY id").fetchall()
        (m1, s1), (m2, s2) = users[0], next(u for u in users if u[1] != users[0][1])
        db.execute(
            "UPDATE messages SET content = ? WHERE id = ?", ('\x00json:[{"type": "text", "text": "a \\ud800"}]', m1)
        )
        db.execute("UPDATE messages SET content = CAST(? AS TEXT) WHERE id = ?", (b"b \xff\xfe", m2))
    s, out = prep(tmp_path, [bad / "state.db"])
    (f,) = s["per_file"]
    assert (f["read"], f["accepted"], f["rejected"], f["duplicates"]) == (8, 5, 2, 1), f
    rej = {r["session"]: r for r in lines(out / "rejects.jsonl")}
    assert set(rej) == {s1, s2} and {r["reason"] for r in rej.values()} == {"invalid Unicode"}
    assert all("messages[1].content" in r["detail"] for r in rej.values())  # [0]: the system prompt


# -------------------------------------------------------------------------------------------- Atropos
def test_atropos_groups_become_rewarded_conversations_and_grpo_groups(tmp_path):
    from datasets import load_from_disk

    groups = lines(ATROPOS / "groups.jsonl")
    s, out = prep(tmp_path, [ATROPOS / "groups.jsonl"])
    (f,) = s["per_file"]
    assert (f["format"], f["read"], f["rejected"], f["accepted"] + f["duplicates"]) == ("atropos", 20, 0, 20)
    assert s["conversations"]["atropos"] == {"groups": 5, "completions": 20, "no_signal": 2, "rejected_groups": 0}
    recs = lines(out / "accepted.jsonl") + [json.loads(d["raw"]) for d in lines(out / "duplicates.jsonl")]
    by_group: dict[str, list] = {}
    for r in recs:
        by_group.setdefault(r["meta"]["atropos"]["group"], []).append(r)
    assert len(by_group) == 5
    for g, rs in zip(groups, by_group.values()):
        rs.sort(key=lambda r: r["meta"]["atropos"]["index"])
        assert [r["reward"] for r in rs] == [SCALE * (x + 1) / 2 for x in g["scores"]]  # -1..1 onto 0..5
        assert {r["reward_source"] for r in rs} == {"atropos"} and len({r["task_id"] for r in rs}) == 1
        assert all(r["meta"]["atropos"]["no_signal"] == (len(set(g["scores"])) == 1) for r in rs)
        assert all(r["messages"][0]["role"] == "system" and r["messages"][-1]["role"] == "assistant" for r in rs)
    plain = next(rs for rs in by_group.values() if rs[0]["messages"][1]["content"] == "add 9+7=")
    assert [m["role"] for m in plain[0]["messages"]] == ["system", "user", "assistant"]  # decoded ChatML, split
    assert plain[0]["messages"][2] == {"role": "assistant", "content": "16", "reasoning": "The task: add 9+7="}
    tool = next(rs for rs in by_group.values() if len(rs[0]["messages"]) == 5)[0]
    assert tool["tools"][0]["function"]["name"] == "terminal" and tool["outcome"]["tool_calls"] == 1
    assert tool["messages"][3]["tool_call_id"] == tool["messages"][2]["tool_calls"][0]["id"]
    # the GRPO prompt set: one row a group's prompt, its four samples (duplicates counted), its outcome
    rows = {}
    for name in ("grpo_dataset", "heldout_dataset"):
        if any((out / name).glob("*.arrow")):
            rows |= {r["prompt"]: r for r in load_from_disk(str(out / name)).to_list()}
    for rs in by_group.values():
        row = rows[next(m["content"] for m in rs[0]["messages"] if m["role"] == "user")]
        assert row["n_samples"] == 4 and row["zero_std"] == rs[0]["meta"]["atropos"]["no_signal"]


def test_hostile_atropos_groups_are_rejected_whole_by_line(tmp_path):
    s, out = prep(tmp_path, [ATROPOS / "hostile.jsonl"])
    assert [(r[1], r[3]) for r in rejects(out)] == [
        (1, "malformed JSON"),
        (2, "score out of range"),
        (3, "score not a number"),
        (4, "group size mismatch"),
        (5, "no messages"),
        (6, "tool result without a call"),
    ]
    assert "completion 2" in lines(out / "rejects.jsonl")[5]["detail"]
    assert s["conversations"]["atropos"]["rejected_groups"] == 6 and s["counts"]["read"] == 6
    with pytest.raises(Exception, match="atropos_scores must be"):
        load_config(None, overrides={"conversations.atropos_scores": [1.0, -1.0]})


# ------------------------------------------------------------------------------ every format, one folder
def test_a_folder_holding_every_format_is_round_data(tmp_path):
    """`hermes-lab prep --input DIR`: each JSONL file and store under it detected on its own, the traces one
    input; nothing valid rejected; the prompt set and the conversations load as the train stage loads them."""
    from hermes_lab.train.grpo import load_prompt_set

    d = tmp_path / "logs"
    (d / "hermes").mkdir(parents=True)
    for name in ("trajectory_samples.jsonl", "batch_trajectories.jsonl.gz", "state.db", "openai_messages.jsonl"):
        shutil.copyfile(HERMES / name, d / "hermes" / name)
    shutil.copytree(HERMES / "sessions", d / "hermes" / "sessions")
    shutil.copyfile(EXPORTS / "sessions.jsonl", d / "export.jsonl")
    shutil.copytree(EXPORTS / "traces", d / "claude" / "traces")
    shutil.copytree(VARIANTS / "split", d / "claude" / "split")
    shutil.copyfile(VARIANTS / "sidechain.jsonl", d / "claude" / "sidechain.jsonl")
    shutil.copyfile(ATROPOS / "groups.jsonl", d / "atropos.jsonl")
    seed = [{"prompt": "add 2+2=", "response": "4", "reward": 5.0, "task_id": f"s{i}"} for i in range(3)]
    (d / "seed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in seed))
    (d / "notes.txt").write_text("not an input")
    out = tmp_path / "prep"
    p = subprocess.run(
        [PY, "-m", "hermes_lab.cli.main", "prep", "--input", str(d), "--output", str(out), "--set",
         "data.min_samples=1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    s = json.loads((out / "summary.json").read_text())
    formats = {Path(f["file"]).name: f["format"] for f in s["per_file"]}
    assert formats == {
        "atropos.jsonl": "atropos",
        "export.jsonl": "hermes_export",
        "batch_trajectories.jsonl.gz": "hermes_trajectory",
        "openai_messages.jsonl": "openai",
        "sessions": "hermes_session",
        "state.db": "hermes_state",
        "trajectory_samples.jsonl": "hermes_trajectory",
        "seed.jsonl": "seed",
        "logs": "claude_code",  # the folder itself: its trace files, wherever they sit under it
    }
    reads = {Path(f["file"]).name: f["read"] for f in s["per_file"]}
    assert reads["logs"] == 10 and reads["atropos.jsonl"] == 20 and reads["export.jsonl"] == 8  # 9 + a sidechain
    k = s["counts"]
    # the older fixture's runs asked the scripted upstream the export's questions: the same exchanges (near)
    assert k["rejected"] == 0 and (k["read"], k["accepted"]) == (61, 22)
    assert "atropos 9" in p.stdout and "0 rejected" in p.stdout and "5 groups, 2 with every score equal" in p.stdout
    assert "11 without tool schemas" in p.stdout  # the export and the older state.db: no snapshot beside them
    cfg = load_config(None, overrides={"data.min_samples": 1})
    from datasets import load_from_disk

    tables = [
        load_from_disk(str(out / n)) for n in ("grpo_dataset", "heldout_dataset") if any((out / n).glob("*.arrow"))
    ]
    every = {p for t in tables for p in t["prompt"]}
    assert {"add 5+8=", "add 2+2=", "What does echo hello print? Use the terminal."} <= every  # one row per prompt
    prompts = load_prompt_set(out, cfg, tmp_path / "work")  # what train reads: the train split, capped
    assert len(prompts) and set(prompts["prompt"]) <= every
    cfg.grpo.turns = True  # turn-level GRPO reads the conversations dataset
    convs = load_prompt_set(out, cfg, tmp_path / "work")
    assert len(convs) == k["conversations"] and {"messages", "tools", "reward", "split"} <= set(convs.column_names)


def test_detection_of_each_format_by_its_first_line(tmp_path):
    first = {
        "seed": {"prompt": "p", "response": "r", "reward": 1, "task_id": "t"},
        "atropos": lines(ATROPOS / "groups.jsonl")[0],
        "hermes_export": lines(EXPORTS / "sessions.jsonl")[0],
        "claude_code": lines(VARIANTS / "claude_code.jsonl")[0],  # a summary line: Claude Code files start so
        "openai": lines(HERMES / "openai_messages.jsonl")[0],
    }
    for fmt, obj in first.items():
        assert readers.detect(REPO / "README.md", obj) == fmt
    assert (
        readers.detect(EXPORTS / "traces") == "claude_code" and readers.detect(HERMES / "sessions") == "hermes_session"
    )
    (tmp_path / "notes.txt").write_text("not an input")
    with pytest.raises(PrepError, match="holds nothing prep reads"):
        run_prep([tmp_path], tmp_path / "out", load_config(None))


# ------------------------------------------------------------------------- the real producer, again
@pytest.mark.slow
def test_real_hermes_sessions_export_in_both_formats(tmp_path, home):
    """hermes-agent 0.19.0's own CLI on the fixture's HERMES_HOME: the jsonl export is the committed one, line for
    line; the trace (fresh uuids and times each run) the same messages; prep reads both whole."""
    sys.path.insert(0, str(HERMES))
    import make_fixtures as mf

    try:
        py = mf.hermes_python("0.19.0")
    except (SystemExit, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"hermes-agent 0.19.0 cannot be installed here: {e}")
    hermes_home = tmp_path / "home"
    shutil.copytree(home, hermes_home)
    env = {"HERMES_HOME": str(hermes_home), "NO_COLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    sid = MANIFEST["sessions"][2]
    for args in (["sessions.jsonl"], ["trace.jsonl", "--format", "trace", "--session-id", sid]):
        p = subprocess.run([str(py.parent / "hermes"), "sessions", "export", *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0 and "Exported" in p.stdout, p.stdout + p.stderr
    fields = ("id", "parent_session_id", "system_prompt", "model", "started_at", "end_reason", "messages")
    assert [[x[k] for k in fields] for x in lines(tmp_path / "sessions.jsonl")] == [
        [x[k] for k in fields] for x in lines(EXPORTS / "sessions.jsonl")
    ]
    fresh, kept = lines(tmp_path / "trace.jsonl"), lines(EXPORTS / "traces" / f"{sid}.jsonl")
    assert [(x["type"], x["message"]) for x in fresh] == [(x["type"], x["message"]) for x in kept]
    s, _ = prep(tmp_path, [tmp_path / "sessions.jsonl", tmp_path / "trace.jsonl"])
    assert [(f["format"], f["rejected"]) for f in s["per_file"]] == [("hermes_export", 0), ("claude_code", 0)]
    assert s["per_file"][1]["duplicates"] == 1  # the trace: a conversation the export already holds
