"""The ``hermes`` task family: workspace tasks done with the Hermes Agent's own tools, judged on disk.

Reads nothing; writes only inside a task's workspace (``tasks.workspace``). The policy build
teaches the family (``teacher_conversation``), execute and validate play it (``policy.episodes`` with
``WorkspaceEnv``, or the real Hermes Agent), the episode phase serves ``WorkspaceEnv`` to TRL, and
``hermes-lab tasks export --family hermes`` writes tasks for any agent to run.

A task is a prompt, the files laid in its workspace before the run and the expected end state: files' exact
content and/or a string the final answer must contain. Kinds (each a Hermes tool, two of them two-step)::

    read    first line of kelo.txt?          read_file            answer holds the line
    create  write mor to kelo.txt            write_file           kelo.txt == "mor"
    append  append mor to kelo.txt           terminal (echo >>)   kelo.txt gained the line
    edit    in kelo.txt replace red with mor patch                kelo.txt with the word replaced
    find    which file has mor?              search_files         answer names the file
    count   how many files in kelo?          terminal (ls | wc)   answer holds the number
    copy    copy line 1 of kelo.txt to mor.txt   read_file, then write_file   mor.txt == the line

Words are made up (3-5 letters) and a task's files follow from its prompt (a seeded draw), so a prompt is a whole
task: a logged conversation is re-scored from its first user message (``parse_question``), and held-out prompts
(split by the prompt's hash, as the other families) are never trained on.

The verifier (``verify``) reads the workspace after the run and the final answer, never the policy's account of
what it did: SCALE when every expectation holds; partial credit below the success threshold for a near miss (a
file with similar content, an answer close to the expected string); 0 for no answer and no change. An answer must
also stay short and name no decoy (another line of the file, the other file, another number): an answer that lists
every candidate is not paid.

``WorkspaceEnv`` (TRL's ``environment_factory`` contract) lays a task's files in a workspace of its own and serves
Hermes's five tools on it with Hermes's result strings (``tasks.workspace``, held to the real agent's results by a
test); its reward is the verifier on that workspace.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hermes_lab.tasks import agent as A
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W

FAMILY = "hermes"
HERMES_VERSION = "0.19.0"  # the pinned hermes-agent: its tools' schemas (hermes_tools.json), its runners
HERMES_MIN_CONTEXT = 64_000  # hermes-agent 0.19.0's MINIMUM_CONTEXT_LENGTH: a model stating less is refused
ENVIRONMENT = "hermes_lab.tasks.hermes:WorkspaceEnv"  # grpo.environment for this family
SCALE = T.SCALE
KINDS = ("read", "create", "append", "edit", "find", "count", "copy")
TOOLS = W.TOOLS  # the Hermes tools the tasks use
DONE = "done"  # the final answer of a task whose result is on disk
# the teacher's slips (format, no call, misspelt argument, broken call). Equal shares left half of the sampled
# first answers without a valid call (the real Hermes CLI through the gateway); a third of misspelt arguments taught
# the policy to misspell what it copies (create, append and edit fell from 95% to 55-70% greedy, one build each)
SLIPS = (0.45, 0.15, 0.25, 0.15)
SHOWN_ROOT = "/workspace"  # the workspace's path in tool results: one string on every run (a reproducible build)
MAX_ANSWER = 60  # characters: a longer final answer is not paid (no listing every candidate)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PROMPTS = {
    "read": "first line of {f}?",
    "create": "write {w} to {f}",
    "append": "append {w} to {f}",
    "edit": "in {f} replace {a} with {w}",
    "find": "which file has {w}?",
    "count": "how many files in {d}?",
    "copy": "copy line 1 of {f} to {g}",
}
_PARSE = [
    ("read", re.compile(r"^first line of (?P<f>[a-z]{3,5}\.txt)\?$")),
    ("create", re.compile(r"^write (?P<w>[a-z]{3,5}) to (?P<f>[a-z]{3,5}\.txt)$")),
    ("append", re.compile(r"^append (?P<w>[a-z]{3,5}) to (?P<f>[a-z]{3,5}\.txt)$")),
    ("edit", re.compile(r"^in (?P<f>[a-z]{3,5}\.txt) replace (?P<a>[a-z]{3,5}) with (?P<w>[a-z]{3,5})$")),
    ("find", re.compile(r"^which file has (?P<w>[a-z]{3,5})\?$")),
    ("count", re.compile(r"^how many files in (?P<d>[a-z]{3,5})\?$")),
    ("copy", re.compile(r"^copy line 1 of (?P<f>[a-z]{3,5}\.txt) to (?P<g>[a-z]{3,5}\.txt)$")),
]


@dataclass(frozen=True)
class HermesTask:
    task_id: str
    kind: str
    question: str  # the user message
    files: dict[str, str] = field(hash=False)  # laid in the workspace before the run
    expect_files: dict[str, str] | None = field(default=None, hash=False)
    answer_contains: str | None = None
    decoys: tuple[str, ...] = ()  # strings a paid answer must not contain (the other candidates)
    calls: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # the teacher's calls, in order

    @property
    def family(self) -> str:
        return FAMILY

    def prompt(self) -> list[dict[str, str]]:
        """The conversational prompt TRL and the episode runner start from."""
        return [{"role": "user", "content": self.question}]

    def expect(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.expect_files is not None:
            out["files"] = dict(self.expect_files)
        if self.answer_contains is not None:
            out["answer_contains"] = self.answer_contains
        return out

    def to_dict(self) -> dict[str, Any]:
        """The exported form (``hermes-lab tasks export``): id, prompt, files, expect."""
        return {"id": self.task_id, "prompt": self.question, "files": dict(self.files), "expect": self.expect()}


def _word(rng: random.Random, avoid: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    while True:
        w = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))
        if w not in avoid:
            return w


def _calls(*calls: tuple[str, dict[str, str]]) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    return tuple((name, tuple(sorted(args.items()))) for name, args in calls)


def make_task(kind: str, names: dict[str, str]) -> HermesTask:
    """The task of ``kind`` whose prompt uses ``names`` (f, g, d, w, a as the kind needs); its files are drawn
    from the prompt, so the same prompt always makes the same task."""
    if kind not in _PROMPTS:
        raise ValueError(f"unknown hermes task kind {kind!r}; kinds: {', '.join(KINDS)}")
    question = _PROMPTS[kind].format(**names)
    rng = random.Random(f"hermes-task:{question}")
    used = {n.removesuffix(".txt") for n in names.values()}
    f, g, d, w, a = (names.get(k, "") for k in "fgdwa")
    files: dict[str, str] = {}
    expect: dict[str, str] | None = None
    contains: str | None = None
    decoys: tuple[str, ...] = ()
    if kind == "read":
        first, second = _word(rng, used), _word(rng, used)
        files = {f: f"{first}\n{second}\n"}
        contains, decoys = first, (second,) if second != first else ()
        calls = _calls(("read_file", {"path": f}))
    elif kind == "create":
        expect, calls = {f: w}, _calls(("write_file", {"content": w, "path": f}))
    elif kind == "append":
        first = _word(rng, used)
        files = {f: f"{first}\n"}
        expect = {f: f"{first}\n{w}\n"}
        calls = _calls(("terminal", {"command": f"echo {w} >> {f}"}))
    elif kind == "edit":
        key = _word(rng, used)
        files = {f: f"{key}={a}\n"}
        expect = {f: f"{key}={w}\n"}
        calls = _calls(("patch", {"mode": "replace", "new_string": w, "old_string": a, "path": f}))
    elif kind == "find":
        hit, other = _word(rng, used) + ".txt", _word(rng, used) + ".txt"
        while other == hit:
            other = _word(rng, used) + ".txt"
        files = {hit: f"the {w}\n", other: f"the {_word(rng, used | {w})}\n"}
        if rng.random() < 0.5:
            files = dict(reversed(list(files.items())))
        contains, decoys = hit, (other,)
        calls = _calls(("search_files", {"pattern": w}))
    elif kind == "count":
        n = rng.randint(2, 5)
        names_in = set()
        while len(names_in) < n:
            names_in.add(_word(rng))
        files = {f"{d}/{x}.txt": f"{x}\n" for x in sorted(names_in)}
        contains, decoys = str(n), tuple(str(k) for k in range(10) if k != n)
        calls = _calls(("terminal", {"command": f"ls {d} | wc -l"}))
    elif kind == "copy":
        first, second = _word(rng, used), _word(rng, used)
        files = {f: f"{first}\n{second}\n"}
        expect = {f: f"{first}\n{second}\n", g: first}
        calls = _calls(("read_file", {"path": f}), ("write_file", {"content": first, "path": g}))
    else:
        raise ValueError(f"unknown hermes task kind {kind!r}; kinds: {', '.join(KINDS)}")
    task_id = f"{FAMILY}-{T.prompt_hash(question)[:8]}"
    return HermesTask(task_id, kind, question, files, expect, contains, decoys, calls)


def parse_question(text: str) -> HermesTask | None:
    """The task behind a user message, or None when it is not one of ours."""
    text = (text or "").strip()
    for kind, rx in _PARSE:
        m = rx.match(text)
        if m:
            names = m.groupdict()
            if len(set(names.values())) < len(names):  # two names alike: not a task make_task draws
                return None
            return make_task(kind, names)
    return None


def _draw(kind: str, rng: random.Random) -> HermesTask:
    need = {"read": "f", "create": "wf", "append": "wf", "edit": "faw", "find": "w", "count": "d", "copy": "fg"}
    names: dict[str, str] = {}
    for k in need[kind]:
        word = _word(rng, {v.removesuffix(".txt") for v in names.values()})
        names[k] = word + ".txt" if k in "fg" else word
    return make_task(kind, names)


def generate_tasks(n: int, split: str = "train", seed: int = 0) -> list[HermesTask]:
    """``n`` tasks of the split, round-robin over the kinds (deterministic in n, split, seed)."""
    if split not in {"train", "heldout", "any"}:
        raise ValueError(f"split must be train, heldout or any, got {split!r}")
    rng = random.Random(f"hermes-family:{seed}:{split}")
    out = []
    for i in range(n):
        while True:
            t = _draw(KINDS[i % len(KINDS)], rng)
            if split == "any" or T.split_of(t.question) == split:
                break
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ verifier
def _similar(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def verify(task: HermesTask, workspace: str | Path | None, answer: str | None, scale: float = SCALE) -> float:
    """The task's reward on 0..scale from what the run left: the workspace's files and the final answer.

    SCALE when every expected file has exactly its content and the answer (when one is expected) contains the
    expected string, stays under MAX_ANSWER characters and names no decoy. Otherwise partial credit, at most
    half the scale (under the success threshold): the mean similarity of the expectations."""
    parts: list[float] = []
    root = Path(workspace) if workspace is not None else None
    for rel, want in (task.expect_files or {}).items():
        got = _read(root, rel)
        parts.append(1.0 if got == want else (0.9 * _similar(got, want) if got is not None else 0.0))
    if task.answer_contains is not None:
        text = (answer or "").strip()
        ok = (
            bool(text)
            and len(text) <= MAX_ANSWER
            and re.search(rf"(?<![\w.]){re.escape(task.answer_contains)}(?![\w])", text) is not None
            and not any(re.search(rf"(?<![\w.]){re.escape(d)}(?![\w])", text) for d in task.decoys)
        )
        parts.append(1.0 if ok else (0.9 * _similar(text[:MAX_ANSWER], task.answer_contains) if text else 0.0))
    if not parts:
        return 0.0
    if all(p == 1.0 for p in parts):
        return float(scale)
    return round(0.5 * scale * sum(parts) / len(parts), 4)


def _read(root: Path | None, rel: str) -> str | None:
    if root is None:
        return None
    p = root / rel
    try:
        if p.is_symlink() or not p.is_file():
            return None
        return p.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ environment
class WorkspaceEnv(W.Workspace):
    """The family's environment in TRL's contract (``GRPOTrainer(environment_factory=WorkspaceEnv)``).

    ``reset`` takes the dataset row (the prompt is the task: ``parse_question``) and lays the task's files in a fresh
    workspace; the public methods are Hermes's tools (``tasks.workspace``); ``_hermes_score(final_answer)`` is the
    verifier on the workspace."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(shown_root=SHOWN_ROOT)
        self._seed = seed
        self.task: HermesTask | None = None

    @staticmethod
    def _hermes_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
        """Training episodes' starting rows (train split): what ``grpo.episode_tasks`` tops up from."""
        return [{"prompt": t.prompt(), "task_id": t.task_id} for t in generate_tasks(n, "train", seed)]

    def reset(self, prompt: Any = None, question: str | None = None, **_: Any) -> None:
        text = question
        if text is None:
            text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt or "")
        task = parse_question(text)
        if task is None:
            raise ValueError(f"WorkspaceEnv.reset: the prompt is not a hermes task: {text!r}")
        self._open(task.files)
        self.task = task
        return None

    def _hermes_score(self, answer: str | None) -> float:
        """The episode's reward on 0..SCALE: the verifier on this workspace and the final answer."""
        if self.task is None:
            return 0.0
        return verify(self.task, self._root, answer, SCALE)


final_answer = A.final_answer  # the last assistant message's text when it makes no tool call, else None


def replay_score(messages: list[dict[str, Any]], scale: float = SCALE) -> float | None:
    """A logged conversation of this family scored by replaying its tool calls in a fresh workspace and verifying
    the end state with its final answer (the workspace's tools are deterministic); None: not one of our tasks."""
    user = next((m for m in messages if m.get("role") == "user"), None)
    content = user.get("content") if user else ""
    task = parse_question(content if isinstance(content, str) else "")
    if task is None:
        return None
    env = WorkspaceEnv()
    env.reset(question=task.question)
    try:
        tools = {f.__name__: f for f in W.env_tools(env)}
        for m in messages:
            for c in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
                f = c.get("function") or {}
                args = f.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        continue
                if f.get("name") in tools and isinstance(args, dict):
                    # arguments the tool does not take: Hermes would refuse the call too
                    with contextlib.suppress(TypeError):
                        tools[f["name"]](**args)
        return verify(task, env.workspace, final_answer(messages), scale)
    finally:
        env._close()


# ------------------------------------------------------------------------------------------------ teacher
def call_message(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}],
    }


def teacher_conversation(rng: random.Random, noise: float) -> list[dict[str, Any]]:
    """One episode as the tiny policy's noisy teacher plays it (train split only), with the results the workspace's
    tools return. Clean (share 1 - noise): the task's calls, then the answer. Slips, in the shares of ``SLIPS``: a
    format slip in the final answer (``suite.corrupt``), an answer without any call, a call with a misspelt argument
    (its error or wrong result, then the answer), a broken call (invalid JSON: plain text for the parser)."""
    while True:
        t = _draw(rng.choice(KINDS), rng)
        if T.split_of(t.question) == "train":
            break
    env = WorkspaceEnv()
    env.reset(question=t.question)
    try:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": t.question}]
        slip = rng.random() < noise
        kind = rng.choices(range(4), SLIPS)[0] if slip else -1
        if kind == 1:  # an answer without any call: a guess (right by chance only)
            return [*msgs, {"role": "assistant", "content": _guess(t, rng)}]
        calls = [(name, dict(args)) for name, args in t.calls]
        if kind == 3:  # a broken call: a missing brace
            name, args = calls[0]
            broken = "<tool_call>" + json.dumps({"name": name, "arguments": args})[:-1] + "</tool_call>"
            return [*msgs, {"role": "assistant", "content": broken}]
        if kind == 2:  # a misspelt string argument in one call
            j = rng.randrange(len(calls))
            name, args = calls[j]
            key = rng.choice(sorted(args))
            v = args[key]
            if len(v) > 1:
                i = rng.randrange(len(v))
                args[key] = v[:i] + rng.choice(_LETTERS.replace(v[i], "")) + v[i + 1 :]
        tools = {f.__name__: f for f in W.env_tools(env)}
        for name, args in calls:
            msgs.append(call_message(name, args))
            msgs.append({"role": "tool", "name": name, "content": tools[name](**args)})
        answer = t.answer_contains or DONE
        if kind == 0:
            answer = T.corrupt(answer, rng)
        elif kind == 2 and t.answer_contains is not None:
            answer = _word(rng)  # the wrong read gave nothing to copy
        msgs.append({"role": "assistant", "content": answer})
        return msgs
    finally:
        env._close()


def _guess(t: HermesTask, rng: random.Random) -> str:
    """What an answer without a look says: DONE for a task on files, else a made-up word, file name or count."""
    if t.answer_contains is None:
        return DONE
    if t.kind == "count":
        return str(rng.randint(2, 5))
    return _word(rng) + (".txt" if t.kind == "find" else "")


def conversation_record(task: HermesTask, messages: list[dict[str, Any]], reward: float) -> dict[str, Any]:
    """An episode as execute logs it: the canonical conversation record's fields (``logs.record``)."""
    msgs = A.logged_messages(messages, sort_keys=True)
    return {"task_id": task.task_id, "family": FAMILY, "messages": msgs, "tools": W.tool_schema(), "reward": reward}
