"""The real Hermes Agent CLI on ``hermes`` tasks: one sandboxed ``hermes chat`` per task, graded on disk.

Stage: execute / validate against the real agent (tests/e2e/test_hermes_real.py runs it through ``hermes-lab serve``;
anyone can run an exported task file with it). Reads a task (a ``tasks.hermes.HermesTask`` or a line of
``hermes-lab tasks export``) and the pinned hermes-agent's virtualenv (``~/.cache/hermes-lab/hermes-agent-0.19.0``,
made by tests/fixtures/hermes/make_fixtures.py's ``hermes_python``; ``$HERMES_FIXTURE_VENV`` names another).
Writes only under ``workspace_root``: one folder per run, ``<task id>-XXXX/`` with ``ws/`` (the workspace: the
task's files, then what the agent left) and ``home/`` (the run's HERMES_HOME: ``config.yaml`` from
``hermes_home``, and what Hermes writes there: ``state.db``, ``sessions/``, ``logs/``).

The run, from the workspace (the model section of ``home/config.yaml`` points Hermes at ``base_url``)::

    bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --bind WS WS --bind HOME HOME --chdir WS \\
          --unshare-pid --die-with-parent --new-session \\
          hermes chat -q PROMPT -Q [-t terminal,file]

The whole filesystem is read-only but the workspace and that HERMES_HOME (``/tmp`` is an empty tmpfs, gone at the
end); the network is the host's (the model server is on 127.0.0.1). The environment is a clean one: PATH, HOME,
LANG, ``HERMES_HOME``, ``NO_COLOR=1``, ``OPENAI_API_KEY`` (the unused key), ``TERMINAL_CWD`` (the workspace); no
``*_PROXY`` variable and no other provider's key reach Hermes. A run past ``timeout`` is killed (exit code 124).

The final answer: ``-Q`` prints the session's id on stderr (``session_id: <id>``, its last line) and the answer on
stdout, but stdout also carries Hermes's own notices (a security-scanner warning, a reasoning box, a diff preview),
so the answer is read from Hermes's session store instead: ``hermes sessions export - --session-id <id>`` in the
same sandbox, its last assistant message without tool calls (stdout's last line when the export fails). The
workspace and that answer are graded by ``tasks.hermes.verify`` (success: reward >= 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import workspace as W

HERMES_VERSION = H.HERMES_VERSION
HERMES_MIN_CONTEXT = H.HERMES_MIN_CONTEXT
DEFAULT_TOOLSETS = ("terminal", "file")
SUCCESS = 3.0  # reward at or above: the task is done (the suite's threshold)
TIMEOUT_EXIT = 124  # the exit code of a run killed at its timeout (as timeout(1) says it)
TAIL = 4000  # characters of stdout / stderr kept in a result
_SESSION = re.compile(r"^session_id:\s*(\S+)\s*$", re.MULTILINE)


class HermesRunError(RuntimeError):
    """A real Hermes run cannot happen here."""


class BwrapMissing(HermesRunError):
    """bubblewrap is not installed, or cannot make a sandbox on this machine."""


class HermesMissing(HermesRunError):
    """The pinned hermes-agent's virtualenv (its ``bin/hermes``) is not there."""


@dataclass
class HermesRun:
    """One task run by the real Hermes CLI, and its grade."""

    task_id: str
    prompt: str
    toolsets: tuple[str, ...] | None  # None: Hermes's default toolsets
    exit_code: int  # TIMEOUT_EXIT when killed at the timeout
    timed_out: bool
    answer: str | None  # the final answer (None: none found)
    answer_source: str  # "export" (hermes sessions export), "stdout", or "none"
    reward: float  # tasks.hermes.verify on the workspace and the answer, 0..SCALE
    success: bool  # reward >= SUCCESS
    seconds: float  # the hermes chat run's wall time
    session_id: str | None
    tool_calls: tuple[str, ...]  # the names of the tools Hermes ran, in order (from the export)
    workspace: Path
    home: Path
    stdout_tail: str
    stderr_tail: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workspace"], d["home"] = str(self.workspace), str(self.home)
        return d


# ------------------------------------------------------------------------------------------------ set-up
def hermes_home(
    dir: str | os.PathLike[str],
    base_url: str,
    model: str,
    api_key: str = "sk-unused",
    context_length: int | None = None,
) -> Path:
    """A HERMES_HOME at ``dir`` whose ``config.yaml`` holds only the ``model:`` section: ``default`` (the model
    name), ``provider: custom``, ``base_url``, ``api_key`` and, when given, ``context_length`` (Hermes takes it
    before any probe of the server; it refuses one from 1,024 up to 63,999). Returns the folder."""
    home = Path(dir)
    home.mkdir(parents=True, exist_ok=True)
    q = json.dumps  # a JSON string is a YAML double-quoted scalar: any URL, name or key stays one string
    lines = [
        "model:",
        f"  default: {q(model)}",
        "  provider: custom",
        f"  base_url: {q(base_url)}",
        f"  api_key: {q(api_key)}",
    ]
    if context_length is not None:
        lines.append(f"  context_length: {int(context_length)}")
    (home / "config.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return home


def find_hermes(hermes_bin: str | os.PathLike[str] | None = None) -> Path:
    """The ``hermes`` executable: ``hermes_bin``, else the pinned virtualenv's (``$HERMES_FIXTURE_VENV``, else
    ``~/.cache/hermes-lab/hermes-agent-0.19.0``). Raises HermesMissing."""
    if hermes_bin is not None:
        p = Path(hermes_bin)
    else:
        venv = os.environ.get("HERMES_FIXTURE_VENV") or Path.home() / ".cache" / "hermes-lab" / (
            f"hermes-agent-{HERMES_VERSION}"
        )
        p = Path(venv) / "bin" / "hermes"
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise HermesMissing(
            f"{p}: no hermes executable; install hermes-agent=={HERMES_VERSION} into that virtualenv "
            f"(python tests/fixtures/hermes/make_fixtures.py's hermes_python({HERMES_VERSION!r}) makes it) "
            "or pass hermes_bin"
        )
    return p


@cache
def check_sandbox() -> str:
    """bubblewrap's path, once it has made a read-only sandbox here. Raises BwrapMissing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise BwrapMissing("bwrap (bubblewrap) is not installed: apt-get install bubblewrap")
    probe = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "true"]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BwrapMissing(f"bwrap cannot run: {e}") from None
    if done.returncode != 0:
        raise BwrapMissing(f"bwrap cannot make a sandbox here (exit {done.returncode}): {done.stderr.strip()[:300]}")
    return bwrap


def sandbox_command(
    argv: Sequence[str], workspace: str | os.PathLike[str], home: str | os.PathLike[str], ro: Sequence[str] = ()
) -> list[str]:
    """``argv`` under bubblewrap: everything read-only but ``workspace`` and ``home`` (bound read-write), a tmpfs
    ``/tmp``, the workspace as cwd, its own pid namespace, killed with its parent. ``ro``: folders to bind
    read-only again after the tmpfs (a virtualenv that lives under /tmp)."""
    ws, hm = str(Path(workspace).resolve()), str(Path(home).resolve())
    cmd = [check_sandbox(), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for p in ro:
        cmd += ["--ro-bind", p, p]
    cmd += ["--bind", ws, ws, "--bind", hm, hm, "--chdir", ws]
    cmd += ["--unshare-pid", "--die-with-parent", "--new-session", *argv]
    return cmd


def sandbox_env(workspace: str | os.PathLike[str], home: str | os.PathLike[str], api_key: str) -> dict[str, str]:
    """The environment Hermes runs with: a clean one (no proxies, no provider keys but the unused one)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", str(Path.home())),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HERMES_HOME": str(Path(home).resolve()),
        "NO_COLOR": "1",
        "OPENAI_API_KEY": api_key,
        "TERMINAL_CWD": str(Path(workspace).resolve()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",  # the virtualenv is read-only in there
    }
    if os.environ.get("TZ"):
        env["TZ"] = os.environ["TZ"]
    return env


def _under_tmp(p: Path) -> bool:
    return p == Path("/tmp") or Path("/tmp") in p.parents


def _ro_binds(hermes: Path) -> list[str]:
    venv = hermes.resolve().parent.parent  # <venv>/bin/hermes
    return [str(venv)] if _under_tmp(venv) else []


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str, str, bool]:
    """Run ``cmd`` in its own process group; at ``timeout`` the whole group is killed."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return TIMEOUT_EXIT, out or "", err or "", True


# ------------------------------------------------------------------------------------------------ a task
def as_task(task: H.HermesTask | Mapping[str, Any]) -> H.HermesTask:
    """A HermesTask from an exported line (``{"id", "prompt", "files", "expect"}``); the family's own task when
    the prompt is one of ours and says the same (it knows the decoys), else the line's expectations as stated."""
    if isinstance(task, H.HermesTask):
        return task
    line = dict(task)
    prompt, expect = str(line["prompt"]), dict(line.get("expect") or {})
    own = H.parse_question(prompt)
    if own is not None and own.files == dict(line.get("files") or {}) and own.expect() == expect:
        return own
    return H.HermesTask(
        task_id=str(line.get("id") or f"{H.FAMILY}-exported"),
        kind="exported",
        question=prompt,
        files=dict(line.get("files") or {}),
        expect_files=dict(expect["files"]) if "files" in expect else None,
        answer_contains=expect.get("answer_contains"),
    )


def session_id_of(stderr: str) -> str | None:
    """The id ``hermes chat -Q`` reports on stderr (``session_id: <id>``, the last one)."""
    found = _SESSION.findall(stderr or "")
    return found[-1] if found else None


def export_session(
    hermes: Path, workspace: Path, home: Path, session_id: str | None, api_key: str = "sk-unused", timeout: float = 60
) -> dict[str, Any] | None:
    """``hermes sessions export - [--session-id ID]`` on that HERMES_HOME (in the same sandbox): the session's
    record (its ``messages``), the last one exported when no id is known; None when there is none."""
    argv = [str(hermes), "sessions", "export", "-"]
    if session_id:
        argv += ["--session-id", session_id]
    code, out, _, _ = _run(
        sandbox_command(argv, workspace, home, _ro_binds(hermes)),
        sandbox_env(workspace, home, api_key),
        workspace,
        timeout,
    )
    if code != 0:
        return None
    sessions = []
    for line in out.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            sessions.append(obj)
    return sessions[-1] if sessions else None


def final_answer(messages: list[dict[str, Any]]) -> str | None:
    """The last assistant message that makes no tool call: its text (Hermes's final response)."""
    for m in reversed(messages):
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            content = m.get("content")
            return content if isinstance(content, str) else None
    return None


def _tool_names(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    names = []
    for m in messages:
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if isinstance(calls, str):  # a store that keeps them as JSON text
            try:
                calls = json.loads(calls)
            except json.JSONDecodeError:
                calls = None
        for c in calls or []:
            if isinstance(c, dict):
                names.append(str((c.get("function") or {}).get("name") or c.get("name") or ""))
    return tuple(names)


def run_task(
    task: H.HermesTask | Mapping[str, Any],
    base_url: str,
    model: str,
    *,
    workspace_root: str | os.PathLike[str],
    toolsets: Sequence[str] | None = DEFAULT_TOOLSETS,
    timeout: float = 120,
    hermes_bin: str | os.PathLike[str] | None = None,
    api_key: str = "sk-unused",
    context_length: int | None = None,
    max_turns: int | None = None,
) -> HermesRun:
    """Run one task with the real ``hermes chat -q PROMPT -Q [-t TOOLSETS]`` under bubblewrap (the module's
    docstring: the command, what is writable), against the OpenAI-compatible server at ``base_url`` serving
    ``model``, and grade the workspace and the final answer with ``tasks.hermes.verify``.

    ``toolsets``: Hermes's ``-t`` (None: its default toolsets); ``timeout``: seconds for the chat (then killed,
    exit code 124); ``max_turns``: Hermes's ``--max-turns`` (None: its default). Raises BwrapMissing or
    HermesMissing when the run cannot happen here."""
    t = as_task(task)
    hermes = find_hermes(hermes_bin)
    check_sandbox()
    root = Path(workspace_root)
    root.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{t.task_id}-", dir=root)).resolve()
    ws, home = run_dir / "ws", run_dir / "home"
    ws.mkdir()
    W.lay_files(ws, t.files)
    hermes_home(home, base_url, model, api_key=api_key, context_length=context_length)
    argv = [str(hermes), "chat", "-q", t.question, "-Q"]
    if toolsets is not None:
        argv += ["-t", ",".join(toolsets)]
    if max_turns is not None:
        argv += ["--max-turns", str(int(max_turns))]
    env = sandbox_env(ws, home, api_key)
    t0 = time.perf_counter()
    code, out, err, timed_out = _run(sandbox_command(argv, ws, home, _ro_binds(hermes)), env, ws, timeout)
    seconds = time.perf_counter() - t0
    sid = session_id_of(err)
    record = export_session(hermes, ws, home, sid, api_key)
    answer, source, calls = None, "none", ()
    if record is not None:
        sid = sid or record.get("id")
        answer = final_answer(record["messages"])
        calls = _tool_names(record["messages"])
        source = "export" if answer is not None else "none"
    if answer is None and out.strip():
        answer, source = out.strip().splitlines()[-1], "stdout"
    reward = H.verify(t, ws, answer)
    return HermesRun(
        task_id=t.task_id,
        prompt=t.question,
        toolsets=tuple(toolsets) if toolsets is not None else None,
        exit_code=code,
        timed_out=timed_out,
        answer=answer,
        answer_source=source,
        reward=reward,
        success=reward >= SUCCESS,
        seconds=round(seconds, 3),
        session_id=sid,
        tool_calls=calls,
        workspace=ws,
        home=home,
        stdout_tail=out[-TAIL:],
        stderr_tail=err[-TAIL:],
    )
