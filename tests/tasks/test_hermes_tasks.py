"""The ``hermes`` task family (hermes_lab/tasks/hermes.py) and its workspace (hermes_lab/tasks/workspace.py).

Parity with the real Hermes Agent 0.19.0 (tests/fixtures/hermes/workspace.json), confinement to the workspace
(adversarial: the policy is paid to find a way out), the tasks (deterministic, split by prompt, a prompt is the
whole task), the verifier against answers and end states that must not be paid, ``replay_score`` of logged
conversations, and ``hermes-lab tasks export`` through the real entry point. Fast: no policy, no network.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W

try:
    import jsonschema
except ImportError:  # pragma: no cover - jsonschema is in the virtualenv
    jsonschema = None

from repo_paths import REPO

FIXTURE = json.loads((REPO / "tests/fixtures/hermes/workspace.json").read_text(encoding="utf-8"))
MTIME0 = 1_700_000_000  # the header's "mtimes": files_before in order, 1700000000 + index (s)
OUTSIDE_CASES = {"05", "06"}  # Hermes reads outside its workspace there; ours refuses on purpose
ANSWER_KINDS = ("read", "find", "count")
FILE_KINDS = ("create", "append", "edit", "copy")
SECRET = "SECRET-9c1e outside content"


def case_id(case: dict) -> str:
    return case["query"].split(":", 1)[0].removeprefix("case ")


@pytest.fixture
def tmpdir_ws(tmp_path, monkeypatch):
    """Workspaces made under tmp_path/t (the temp dir), so a sibling of the workspace is a known sentinel."""
    d = tmp_path / "t"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def snapshot(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for n in sorted(names):
            f = Path(dirpath) / n
            out[str(f.relative_to(root))] = f.read_text(encoding="utf-8")
    return dict(sorted(out.items()))


def opened(files: dict[str, str], mtimes: bool = False) -> W.Workspace:
    ws = W.Workspace()
    ws._open(files)
    if mtimes:
        for k, rel in enumerate(files):
            os.utime(ws.workspace / rel, (MTIME0 + k, MTIME0 + k))
    return ws


def call(ws: W.Workspace, name: str, args: dict) -> str:
    return getattr(ws, name)(**args)


# ------------------------------------------------------------------------------------------------ 1. parity
PARITY = [c for c in FIXTURE["cases"] if case_id(c) not in OUTSIDE_CASES]


def test_fixture_holds_the_cases_this_file_assumes():
    ids = [case_id(c) for c in FIXTURE["cases"]]
    assert ids == [f"{i:02d}" for i in range(1, 22)]
    assert FIXTURE["hermes_agent"] == "0.19.0"
    assert {c["calls"][0]["name"] for c in FIXTURE["cases"]} == set(W.TOOLS)


@pytest.mark.parametrize("case", PARITY, ids=case_id)
def test_workspace_returns_hermes_results_and_leaves_hermes_files(case, tmpdir_ws):
    ws = opened(case["files_before"], mtimes=True)
    try:
        root = str(ws.workspace.resolve())
        got = [call(ws, c["name"], c["arguments"]) for c in case["calls"]]
        want = [r.replace(FIXTURE["workspace"], root) for r in case["results"]]
        if case_id(case) == "14":  # rg's walk is threaded: the two matches come in either order
            g, w = json.loads(got[0]), json.loads(want[0])
            assert g["total_count"] == w["total_count"] == 2
            key = lambda m: (m["path"], m["line"], m["content"])  # noqa: E731
            assert sorted(map(key, g["matches"])) == sorted(map(key, w["matches"]))
            assert set(g) == set(w)
        else:
            assert got == want
        assert snapshot(ws.workspace) == case["files_after"]
    finally:
        ws._close()


@pytest.mark.parametrize("case", [c for c in FIXTURE["cases"] if case_id(c) in OUTSIDE_CASES], ids=case_id)
def test_outside_reads_of_the_fixture_are_refused_here(case, tmpdir_ws):
    """Hermes answers cases 05 and 06 with the outside file's lines; this workspace refuses (on purpose)."""
    sentinel = tmpdir_ws / "outside.txt"  # what "../outside.txt" names from the workspace
    sentinel.write_text("outside\n", encoding="utf-8")
    os.utime(sentinel, (MTIME0, MTIME0))
    ws = opened(case["files_before"], mtimes=True)
    try:
        (res,) = [call(ws, c["name"], c["arguments"]) for c in case["calls"]]
        out = json.loads(res)
        assert "outside the workspace" in out["error"] and "content" not in out
        assert res != case["results"][0]
        assert snapshot(ws.workspace) == case["files_after"]
        assert ws.errors == 1
    finally:
        ws._close()
    assert sentinel.read_text(encoding="utf-8") == "outside\n" and sentinel.stat().st_mtime == MTIME0


# ------------------------------------------------------------------------------------------ 2. confinement
@pytest.fixture
def jail(tmpdir_ws, tmp_path, monkeypatch):
    """A workspace beside a sentinel file and folder, with a symlink to each inside it, and a HOME with a secret."""
    sentinel = tmpdir_ws / "sentinel-7f3a.txt"
    sentinel.write_text(SECRET + "\n", encoding="utf-8")
    outdir = tmpdir_ws / "outdir-7f3a"
    outdir.mkdir()
    (outdir / "x.txt").write_text(SECRET + " in a dir\n", encoding="utf-8")
    home = tmp_path / "home"
    home.mkdir()
    (home / "secret.txt").write_text(SECRET + " at home\n", encoding="utf-8")
    monkeypatch.setenv("HOME", str(home))
    for p in (sentinel, outdir / "x.txt", home / "secret.txt"):
        os.utime(p, (MTIME0, MTIME0))
    ws = opened({"a.txt": "kelo\n", "sub/b.txt": "mor\n"})
    os.symlink(sentinel, ws.workspace / "link.txt")
    os.symlink(outdir, ws.workspace / "ld")
    before_out = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (sentinel, outdir / "x.txt", home / "secret.txt")}
    listing = {tmpdir_ws: sorted(os.listdir(tmpdir_ws)), outdir: ["x.txt"], home: ["secret.txt"]}
    yield ws, sentinel, before_out, listing
    ws._close()


def assert_untouched(before_out, listing):
    for p, (data, mtime) in before_out.items():
        assert p.read_bytes() == data, f"{p} was written"
        assert p.stat().st_mtime_ns == mtime, f"{p}'s mtime changed"
    for d, names in listing.items():
        assert sorted(os.listdir(d)) == names, f"something was created in {d}"


LEAKS = (SECRET, "sentinel-7f3a", "outdir-7f3a", "root:x:0", "/bin/")


def escape_attempts(sentinel: Path) -> list[tuple[str, dict]]:
    ab = str(sentinel)
    paths = ["../sentinel-7f3a.txt", ab, "/etc/passwd", "~/secret.txt", "link.txt", "ld/x.txt", "ld/new.txt"]
    paths += ["sub/../../sentinel-7f3a.txt", "./../sentinel-7f3a.txt", "~", "/", "..", "ld", "ld/"]
    out: list[tuple[str, dict]] = []
    for p in paths:
        out.append(("read_file", {"path": p}))
        out.append(("write_file", {"path": p, "content": "pwned\n"}))
        out.append(("patch", {"path": p, "old_string": "SECRET", "new_string": "pwned", "mode": "replace"}))
        out.append(("search_files", {"pattern": "SECRET", "path": p}))
        out.append(("search_files", {"pattern": "*", "target": "files", "path": p}))
    for c in (
        "echo x >> ../sentinel-7f3a.txt",
        f"echo x >> {ab}",
        "echo x >> link.txt",
        "echo x >> ld/x.txt",
        "echo x >> ld/new.txt",
        "echo x >> ~/secret.txt",
        "echo x >> ../pwned.txt",
        "ls /",
        "ls ..",
        "ls .. | wc -l",
        "ls ~",
        "ls ld",
        "ls ld | wc -l",
        f"ls {sentinel.parent}",
        "cat /etc/passwd",
        "cat ../sentinel-7f3a.txt",
        f"cat {ab}",
        "cat link.txt",
        "cat ld/x.txt",
        "cat ~/secret.txt",
        "wc -l < ../sentinel-7f3a.txt",
        "wc -l < link.txt",
    ):
        out.append(("terminal", {"command": c}))
    return out


def test_no_tool_reads_or_writes_outside_the_workspace(jail):
    ws, sentinel, before_out, listing = jail
    inside = snapshot_no_links(ws.workspace)
    for name, args in escape_attempts(sentinel):
        res = call(ws, name, args)
        out = json.loads(res)
        said = json.dumps(args)
        leaked = [s for s in LEAKS if s in res and s not in said]
        assert not leaked, f"{name}({args}) leaked {leaked}: {res}"
        refused = out.get("error") or out.get("exit_code", 0) != 0 or out.get("success") is False
        assert refused, f"{name}({args}) was not refused: {res}"
    assert_untouched(before_out, listing)
    assert snapshot_no_links(ws.workspace) == inside  # every attempt was refused, nothing written inside either
    assert os.readlink(ws.workspace / "link.txt") == str(sentinel)


def snapshot_no_links(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            f = Path(dirpath) / n
            out[str(f.relative_to(root))] = "<link>" if f.is_symlink() else f.read_text(encoding="utf-8")
    return out


def test_search_does_not_read_through_a_symlink_inside_the_workspace(jail):
    ws, _, before_out, listing = jail
    for target, pattern in (("content", "SECRET"), ("content", "."), ("files", "*")):
        res = ws.search_files(pattern, target=target)
        assert SECRET not in res, res
        assert "link.txt" not in res or target == "files", res
    assert_untouched(before_out, listing)


def test_read_file_of_the_workspace_itself_lists_nothing_outside(jail):
    ws, _, before_out, listing = jail
    for path in (".", "", "./"):
        res = ws.read_file(path)
        assert "sentinel-7f3a" not in res, res
    assert_untouched(before_out, listing)


UNKNOWN = (
    "rm -rf /",
    "rm -rf ..",
    'python -c \'open("MARK", "w")\'',
    "python3 -c 'import os; os.system(\"touch MARK\")'",
    "echo a; touch ../pwned",
    "echo a; touch MARK",
    "echo a && touch MARK",
    "echo a > MARK",
    "touch MARK",
    "`touch MARK`",
    "$(touch MARK)",
    "ls `touch MARK`",
    "ls $(touch MARK)",
    "ls; touch MARK",
    "ls && touch MARK",
    "ls d | wc -l; touch MARK",
    "ls | sh",
    "cat a.txt | sh",
    "cat a.txt; touch MARK",
    "echo x >> a.txt; touch MARK",
    "ls -la /",
    "sh -c 'touch MARK'",
    "bash -c 'touch ../pwned'",
    "env touch MARK",
    "MARK=1 ls",
)


@pytest.mark.parametrize("command", UNKNOWN)
def test_unknown_commands_get_127_and_run_nothing(command, jail):
    ws, _, before_out, listing = jail
    inside = snapshot_no_links(ws.workspace)
    out = json.loads(ws.terminal(command))
    assert out["exit_code"] == 127, out
    assert out["output"].endswith("command not found") and out["error"] is None
    assert snapshot_no_links(ws.workspace) == inside
    assert not (Path.cwd() / "MARK").exists()
    assert_untouched(before_out, listing)


@pytest.mark.parametrize("payload", ["`touch MARK`", "$(touch MARK)", "a; touch MARK", "a && touch ../pwned"])
def test_echo_writes_a_payload_as_text_and_runs_none_of_it(payload, jail):
    ws, _, before_out, listing = jail
    out = json.loads(ws.terminal(f"echo {payload} >> a.txt"))
    assert out == {"output": "", "exit_code": 0, "error": None}
    assert (ws.workspace / "a.txt").read_text(encoding="utf-8") == f"kelo\n{payload}\n"
    assert not list(ws.workspace.rglob("MARK")) and not (Path.cwd() / "MARK").exists()
    assert_untouched(before_out, listing)


def test_tools_refuse_before_reset():
    ws = W.Workspace()
    out = json.loads(ws.read_file("a.txt"))
    assert "reset() first" in out["error"] and ws.errors == 1


# ------------------------------------------------------------------------------------------------ 3. tasks
def test_generate_tasks_is_deterministic_round_robin_and_split_by_prompt():
    train = H.generate_tasks(70, "train", seed=3)
    assert [t.to_dict() for t in train] == [t.to_dict() for t in H.generate_tasks(70, "train", seed=3)]
    assert train == H.generate_tasks(70, "train", seed=3)
    assert [t.question for t in train] != [t.question for t in H.generate_tasks(70, "train", seed=4)]
    held = H.generate_tasks(70, "heldout", seed=3)
    assert [t.kind for t in train] == [H.KINDS[i % 7] for i in range(70)] == [t.kind for t in held]
    assert all(T.split_of(t.question) == "train" for t in train)
    assert all(T.split_of(t.question) == "heldout" for t in held)
    assert not {t.question for t in train} & {t.question for t in held}
    assert all(t.task_id == f"hermes-{T.prompt_hash(t.question)[:8]}" for t in train + held)
    # a held-out prompt never turns up in any training draw, nor in the teacher's or the env's training rows
    many_train = {t.question for s in range(5) for t in H.generate_tasks(140, "train", seed=s)}
    assert all(T.split_of(q) == "train" for q in many_train)
    rows = H.WorkspaceEnv._hermes_rows(21, seed=1)
    assert all(T.split_of(r["prompt"][0]["content"]) == "train" for r in rows)
    rng = random.Random(0)
    assert all(T.split_of(H.teacher_conversation(rng, 0.5)[0]["content"]) == "train" for _ in range(60))
    assert len({t.question for t in H.generate_tasks(100, "any", seed=0)}) > 90
    with pytest.raises(ValueError, match="split"):
        H.generate_tasks(1, "test")


def test_parse_question_gives_back_the_task_for_every_kind():
    tasks = H.generate_tasks(42, "train", seed=0) + H.generate_tasks(42, "heldout", seed=0)
    assert {t.kind for t in tasks} == set(H.KINDS)
    for t in tasks:
        again = H.parse_question(t.question)
        assert again == t
        assert (again.files, again.expect_files, again.decoys) == (t.files, t.expect_files, t.decoys)
        assert again.calls == t.calls and again.answer_contains == t.answer_contains
        assert H.parse_question(f"  {t.question}\n") == t


@pytest.mark.parametrize(
    "text",
    [
        "",
        None,
        "first line of kelo.txt",  # no question mark
        "First line of kelo.txt?",
        "first line of kelomor.txt?",  # 7 letters
        "first line of ke.txt?",
        "first line of ../kelo.txt?",
        "write mor to kelo.py",
        "copy line 1 of kelo.txt to kelo.txt",  # two names alike: not a task make_task draws
        "in kelo.txt replace mor with mor",
        "how many files in kelo? please",
        "what is 2+2?",
    ],
)
def test_parse_question_refuses_what_is_not_a_task(text):
    assert H.parse_question(text) is None


def test_the_prompt_alone_determines_files_and_expectations():
    names = {"f": "kelo.txt", "g": "zip.txt", "d": "dirr", "w": "mor", "a": "red"}
    need = {"read": "f", "create": "wf", "append": "wf", "edit": "faw", "find": "w", "count": "d", "copy": "fg"}
    for kind in H.KINDS:
        sub = {k: names[k] for k in need[kind]}
        random.seed(1)
        one = H.make_task(kind, sub)
        random.seed(2)
        random.random()
        two = H.make_task(kind, sub)
        assert one == two and one.to_dict() == two.to_dict() and one.calls == two.calls
        assert H.parse_question(one.question) == one
        assert one.kind == kind and one.question == H._PROMPTS[kind].format(**sub)
    # different prompts draw different files
    a, b = H.make_task("read", {"f": "kelo.txt"}), H.make_task("read", {"f": "kela.txt"})
    assert list(a.files.values()) != list(b.files.values())


def test_make_task_names_the_kinds_for_an_unknown_kind():
    with pytest.raises(ValueError, match="kinds: read, create"):
        H.make_task("delete", {"f": "kelo.txt"})


def test_every_kind_has_an_expectation_and_sound_decoys():
    for t in H.generate_tasks(140, "any", seed=7):
        assert t.expect(), t
        assert t.answer_contains not in t.decoys
        if t.kind == "count":
            assert t.answer_contains == str(len(t.files)) and 2 <= len(t.files) <= 5
        if t.kind == "find":
            (hit,) = [f for f, text in t.files.items() if text == f"the {t.question.split()[-1][:-1]}\n"]
            assert t.answer_contains == hit and t.decoys == tuple(f for f in t.files if f != hit)


def tools_by_name() -> dict[str, dict]:
    return {s["function"]["name"]: s["function"] for s in W.tool_schemas()}


def test_hermes_schemas_hold_the_teachers_tools_and_calls():
    schemas = tools_by_name()
    assert set(W.TOOLS) <= set(schemas)
    assert W.tool_schema() == json.loads((REPO / "hermes_lab/tasks/hermes_tools.json").read_text(encoding="utf-8"))
    # every tool method's parameters are Hermes's, and it takes every argument Hermes requires
    ws = W.Workspace()
    for f in W.env_tools(ws):
        props = schemas[f.__name__]["parameters"]
        params = set(inspect.signature(f).parameters)
        assert params <= set(props["properties"]), f.__name__
        assert set(props.get("required", [])) <= params, f.__name__
    seen = set()
    for t in H.generate_tasks(70, "any", seed=2):
        for name, args in t.calls:
            seen.add(name)
            params = schemas[name]["parameters"]
            a = dict(args)
            if jsonschema is not None:
                jsonschema.validate(a, params)
            assert set(params.get("required", [])) <= set(a) and set(a) <= set(params["properties"])
            assert all(isinstance(v, str) for v in a.values())
    assert seen == set(W.TOOLS)


# ------------------------------------------------------------------------------------------------ 4. verifier
def by_kind(n_each: int = 3, split: str = "any", seed: int = 11) -> dict[str, list[H.HermesTask]]:
    out: dict[str, list[H.HermesTask]] = {k: [] for k in H.KINDS}
    for t in H.generate_tasks(7 * n_each, split, seed):
        out[t.kind].append(t)
    return out


ALL_TASKS = [t for ts in by_kind().values() for t in ts]


def clean_env(t: H.HermesTask) -> H.WorkspaceEnv:
    env = H.WorkspaceEnv()
    env.reset(prompt=t.prompt())
    for name, args in t.calls:
        res = json.loads(getattr(env, name)(**dict(args)))
        assert not res.get("error") and res.get("exit_code", 0) == 0 and res.get("success", True), res
    return env


def right_answer(t: H.HermesTask) -> str:
    return t.answer_contains or H.DONE


@pytest.mark.parametrize("t", ALL_TASKS, ids=lambda t: f"{t.kind}-{t.task_id}")
def test_the_teachers_clean_episode_scores_full(t):
    env = clean_env(t)
    try:
        assert env.task == t and env.errors == 0
        assert env._hermes_score(right_answer(t)) == 5.0
        if t.expect_files:
            for rel, want in t.expect_files.items():
                assert (env.workspace / rel).read_text(encoding="utf-8") == want
    finally:
        env._close()


def fresh(t: H.HermesTask) -> H.WorkspaceEnv:
    env = H.WorkspaceEnv()
    env.reset(question=t.question)
    return env


def solved_files(root: Path, t: H.HermesTask) -> None:
    for rel, text in (t.expect_files or {}).items():
        (root / rel).write_text(text, encoding="utf-8")


def candidates_answer(t: H.HermesTask) -> str:
    if t.kind == "read":
        return " ".join(t.files[next(iter(t.files))].split())
    if t.kind == "find":
        return " or ".join(t.files)
    if t.kind == "count":
        return " ".join(str(k) for k in range(10))
    raise AssertionError(t.kind)


@pytest.mark.parametrize("t", [t for t in ALL_TASKS if t.kind in ANSWER_KINDS], ids=lambda t: t.kind)
def test_answers_that_must_not_be_paid(t):
    env = clean_env(t)
    try:
        assert env._hermes_score(right_answer(t)) == 5.0
        others = [c for c in candidates_answer(t).split(" or " if t.kind == "find" else " ") if c != right_answer(t)]
        if others:  # read: the two lines may happen to be alike; then there is nothing to list
            assert env._hermes_score(candidates_answer(t)) < 3
            assert env._hermes_score(f"{right_answer(t)}, or maybe {others[-1]}") < 3
            assert env._hermes_score(f"{others[0]} {right_answer(t)}") < 3
        if t.kind == "read" and others:  # the file as read_file shows it
            content = json.loads(env.read_file(next(iter(t.files))))["content"]
            assert env._hermes_score(content) < 3
        long = f"The answer you are looking for is {right_answer(t)} " + "and that is certain " * 2
        assert len(long) > H.MAX_ANSWER and env._hermes_score(long) < 3
        assert env._hermes_score(right_answer(t) + " " + "x" * H.MAX_ANSWER) < 3
        for empty in ("", "   ", None):
            assert env._hermes_score(empty) == 0.0
        assert env._hermes_score("done, I wrote the file") < 3
        near = right_answer(t) + "q"  # a near miss: partial credit only
        assert 0 < env._hermes_score(near) < 3
    finally:
        env._close()


def near_miss_content(t: H.HermesTask) -> dict[str, str]:
    rel, want = next(iter((t.expect_files or {}).items())) if t.kind != "copy" else list(t.expect_files.items())[1]
    return {rel: want[:-1] + ("z" if want[-1] != "z" else "y")}


@pytest.mark.parametrize("t", [t for t in ALL_TASKS if t.kind in FILE_KINDS], ids=lambda t: t.kind)
def test_end_states_that_must_not_be_paid(t, tmp_path):
    expect = t.expect_files or {}
    assert expect

    def score(mutate, answer: str | None = H.DONE) -> float:
        env = fresh(t)
        try:
            mutate(env.workspace)
            return env._hermes_score(answer)
        finally:
            env._close()

    assert score(lambda root: solved_files(root, t)) == 5.0
    # no change on disk, whatever the answer claims
    for claim in ("done, I wrote the file", H.DONE, "", None, "\n".join(expect.values())):
        assert score(lambda root: None, claim) < 3
    # the expected files with a trailing newline added, or taken away
    for rel, want in expect.items():
        variants = [want + "\n"] + ([want[:-1]] if want.endswith("\n") else [])
        for v in variants:

            def write(root, rel=rel, v=v):
                solved_files(root, t)
                (root / rel).write_text(v, encoding="utf-8")

            assert score(write) < 3, (rel, v)

    # the right content in another file
    def elsewhere(root):
        for k, text in enumerate(expect.values()):
            (root / f"other{k}.txt").write_text(text, encoding="utf-8")

    assert score(elsewhere) < 3

    # a symlink where the expected file should be, to the right content outside the workspace
    def symlinked(root):
        for rel, text in expect.items():
            target = root.parent / f"{root.name}-{rel}"
            target.write_text(text, encoding="utf-8")
            (root / rel).unlink(missing_ok=True)
            os.symlink(target, root / rel)

    assert score(symlinked) < 3

    # a directory named like the expected file
    def dirs(root):
        solved_files(root, t)
        rel = next(r for r in expect if t.kind != "copy" or r not in t.files)
        (root / rel).unlink()
        (root / rel).mkdir()
        (root / rel / "x.txt").write_text(expect[rel], encoding="utf-8")

    assert score(dirs) < 3

    # listing every candidate: both lines copied, both values kept, the word written twice
    def every(root):
        solved_files(root, t)
        rel = list(expect)[-1]
        if t.kind == "copy":
            (root / rel).write_text(next(iter(t.files.values())), encoding="utf-8")
        elif t.kind == "create":
            (root / rel).write_text(f"{expect[rel]}\n{expect[rel]}", encoding="utf-8")
        else:
            (root / rel).write_text(t.files[rel] + expect[rel], encoding="utf-8")

    assert score(every) < 3

    # a near miss: partial credit, below the success threshold
    def near(root):
        solved_files(root, t)
        for rel, text in near_miss_content(t).items():
            (root / rel).write_text(text, encoding="utf-8")

    s = score(near)
    assert 0 < s < 3
    # no workspace at all
    assert H.verify(t, None, H.DONE) == 0.0


def test_partial_credit_never_reaches_success():
    rng = random.Random(5)
    for t in H.generate_tasks(70, "any", seed=5):
        env = fresh(t)
        try:
            for _ in range(6):  # a random mutation of the right end state and answer
                solved_files(env.workspace, t)
                for rel, want in (t.expect_files or {}).items():
                    i = rng.randrange(len(want) + 1)
                    (env.workspace / rel).write_text(want[:i] + rng.choice("ab\n ") + want[i:], encoding="utf-8")
                ans = right_answer(t)
                i = rng.randrange(len(ans) + 1)
                bad = ans[:i] + rng.choice("abz".replace(ans[i : i + 1], "")) + ans[i + 1 :]
                s = env._hermes_score(bad if t.answer_contains else H.DONE)
                assert 0 <= s <= 2.5, (t.question, s)
        finally:
            env._close()


# ------------------------------------------------------------------------------------------- 5. replay_score
def clean_teacher_episodes() -> dict[str, tuple[H.HermesTask, list[dict]]]:
    out: dict[str, tuple[H.HermesTask, list[dict]]] = {}
    seed = 0
    while len(out) < len(H.KINDS):
        msgs = H.teacher_conversation(random.Random(seed), 0.0)
        t = H.parse_question(msgs[0]["content"])
        out.setdefault(t.kind, (t, msgs))
        seed += 1
        assert seed < 500
    return out


EPISODES = clean_teacher_episodes()


@pytest.mark.parametrize("kind", H.KINDS)
def test_a_logged_clean_episode_replays_to_full_score(kind):
    t, msgs = EPISODES[kind]
    rec = H.conversation_record(t, msgs, 5.0)
    assert rec["task_id"] == t.task_id and rec["family"] == "hermes" and rec["tools"] == W.tool_schema()
    calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
    assert len(calls) == len(t.calls) and all(isinstance(c["function"]["arguments"], str) for c in calls)
    assert [(c["function"]["name"], tuple(sorted(json.loads(c["function"]["arguments"]).items()))) for c in calls] == [
        (n, a) for n, a in t.calls
    ]
    assert H.final_answer(rec["messages"]) == right_answer(t)
    assert H.replay_score(rec["messages"]) == 5.0
    assert H.replay_score(msgs) == 5.0  # the teacher's own form: arguments as dicts


def test_replay_score_is_on_the_scale_asked_for():
    _, msgs = EPISODES["read"]
    assert H.replay_score(msgs, scale=1.0) == 1.0
    assert H.replay_score(without_calls(msgs)[:1], scale=10.0) == 0.0


def without_calls(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m.get("role") != "tool" and not m.get("tool_calls")]


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_the_same_conversation_without_its_calls_is_not_paid(kind):
    t, msgs = EPISODES[kind]
    rec = H.conversation_record(t, msgs, 5.0)
    stripped = without_calls(rec["messages"])
    assert len(stripped) == 2 and H.final_answer(stripped) == H.DONE
    assert H.replay_score(stripped) < 3
    # a file task is paid for its end state: the calls without a final answer still solve it
    assert H.replay_score(rec["messages"][:-1]) == 5.0


def test_the_teachers_answer_without_a_look_is_a_guess_not_the_answer():
    """An answer kind (read, find, count) is paid for the string it reports, which only a look can give: the files
    are a seeded draw from the prompt. So the teacher's slip "answer without any call" must be a guess, never the
    expected string (a correct answer without a call would teach the policy that looking is optional)."""
    rng = random.Random(11)
    seen = 0
    for _ in range(3000):
        conv = H.teacher_conversation(rng, noise=1.0)
        if any(m.get("tool_calls") or "<tool_call>" in (m.get("content") or "") for m in conv):
            continue
        t = H.parse_question(conv[0]["content"])
        if t.kind in ("read", "find"):
            seen += 1
            assert t.answer_contains not in conv[-1]["content"], (t.question, conv[-1])
            assert H.verify(t, None, conv[-1]["content"]) < 3
    assert seen > 50


def test_a_conversation_that_is_not_a_hermes_task_gives_none():
    t, msgs = EPISODES["create"]
    assert H.replay_score([{"role": "user", "content": "what is 2+2?"}, *msgs[1:]]) is None
    assert H.replay_score([{"role": "system", "content": t.question}, {"role": "assistant", "content": "x"}]) is None
    assert H.replay_score([]) is None
    assert H.replay_score([{"role": "user", "content": [{"type": "text", "text": t.question}]}]) is None
    # the FIRST user message decides, not a later one
    assert H.replay_score([{"role": "user", "content": "hi"}, *msgs]) is None


def test_calls_with_unknown_tools_or_bad_arguments_do_not_raise():
    t, msgs = EPISODES["copy"]
    f = next(iter(t.files))
    bad = [
        ("rm", "{}"),
        ("reset", json.dumps({"question": "write mor to kelo.txt"})),
        ("_close", "{}"),
        ("_open", json.dumps({"files": {"x.txt": "x"}})),
        ("__init__", "{}"),
        ("process", json.dumps({"action": "list"})),
        ("read_file", "not json {"),
        ("read_file", "[1, 2]"),
        ("read_file", "5"),
        ("read_file", "null"),
        ("read_file", None),
        ("read_file", json.dumps({"path": 5})),
        ("read_file", json.dumps({"path": ["a"]})),
        ("read_file", json.dumps({"path": None})),
        ("read_file", json.dumps({"path": f, "offset": "x"})),
        ("read_file", json.dumps({"path": f, "limit": -3})),
        ("read_file", '{"path": "' + f + '", "offset": 1e400}'),
        ("read_file", json.dumps({"path": "a\u0000b"})),
        ("read_file", json.dumps({"path": f, "self": 1})),
        ("read_file", json.dumps({"nope": 1})),
        ("write_file", json.dumps({"path": "x.txt"})),
        ("write_file", json.dumps({"path": "x.txt", "content": 5})),
        ("write_file", json.dumps({"path": {}, "content": "x"})),
        ("patch", json.dumps({"path": f, "old_string": 1, "new_string": 2})),
        ("patch", json.dumps({"path": f, "old_string": "a", "new_string": "b", "mode": "patch"})),
        ("search_files", json.dumps({"pattern": "("})),
        ("search_files", json.dumps({"pattern": ["x"], "target": "files"})),
        ("search_files", json.dumps({"pattern": "x", "path": 3})),
        ("terminal", json.dumps({"command": None})),
        ("terminal", json.dumps({"command": 7})),
        ("terminal", json.dumps({"command": "echo 'unbalanced >> a.txt"})),
        ("terminal", json.dumps({"command": "echo 'a >> b.txt"})),
        ("terminal", json.dumps({"command": "ls", "background": True})),
        (None, "{}"),
        (5, "{}"),
    ]
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in bad]
    calls += [{"type": "function"}, {"type": "function", "function": None}, {}]
    noisy = [msgs[0], {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "x"}]
    score = H.replay_score([*noisy, *msgs[1:]])
    assert score == 5.0  # the junk changed nothing, the teacher's calls still solve it
    alone = H.replay_score([*noisy, {"role": "assistant", "content": H.DONE}])
    assert alone is not None and 0 <= alone < 3


# --------------------------------------------------------------------------------------------- 6. export CLI
def export(out: Path, seed: int | None = None) -> subprocess.CompletedProcess:
    cmd = [str(REPO / ".venv/bin/hermes-lab"), "tasks", "export", "--family", "hermes", "--split", "heldout"]
    cmd += ["--n", "14", "--out", str(out)] + (["--seed", str(seed)] if seed is not None else [])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    runs = [export(d / "a.jsonl"), export(d / "b.jsonl"), export(d / "c.jsonl", seed=1)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    return d


def test_export_writes_14_tasks_and_the_same_file_for_the_same_seed(exported):
    a = (exported / "a.jsonl").read_bytes()
    assert a == (exported / "b.jsonl").read_bytes()
    assert a != (exported / "c.jsonl").read_bytes()
    assert not list(exported.glob("*.tmp"))
    lines = a.decode("utf-8").splitlines()
    assert len(lines) == 14
    rows = [json.loads(line) for line in lines]
    for row in rows:
        assert set(row) == {"id", "prompt", "files", "expect"}
        assert set(row["expect"]) and set(row["expect"]) <= {"files", "answer_contains"}
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in row["files"].items())
        assert T.split_of(row["prompt"]) == "heldout"
    assert [r["prompt"] for r in rows] == [t.question for t in H.generate_tasks(14, "heldout", 0)]
    kinds = [H.parse_question(r["prompt"]).kind for r in rows]
    assert kinds == [H.KINDS[i % 7] for i in range(14)]


def test_each_exported_task_solved_by_hand_passes_verify(exported, tmp_path):
    rows = [json.loads(line) for line in (exported / "a.jsonl").read_text(encoding="utf-8").splitlines()]
    for k, row in enumerate(rows):
        t = H.parse_question(row["prompt"])
        assert t is not None and t.to_dict() == row
        root = tmp_path / f"ws{k}"
        root.mkdir()
        W.lay_files(root, row["files"])
        for rel, text in row["expect"].get("files", {}).items():
            (root / rel).write_text(text, encoding="utf-8")
        answer = row["expect"].get("answer_contains", H.DONE)
        assert H.verify(t, root, answer) == 5.0, row
        assert H.verify(t, root, None) < 3 or "answer_contains" not in row["expect"]


def test_export_refuses_bad_arguments(tmp_path):
    cmd = [str(REPO / ".venv/bin/hermes-lab"), "tasks", "export", "--n", "0", "--out", str(tmp_path / "x.jsonl")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "--n" in (r.stderr + r.stdout)
    assert not (tmp_path / "x.jsonl").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
