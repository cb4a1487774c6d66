"""The real Hermes Agent's own loop on ``hermes`` tasks: many tasks in one sandboxed process, graded on disk.

Stage: execute, validate and the live traffic against the real agent (``hermes-lab agent --runner hermes``; the
tests in tests/e2e/test_hermes_loop.py). Reads tasks (``tasks.hermes.HermesTask`` or lines of ``hermes-lab tasks
export``) and the pinned hermes-agent virtualenv (``install_hermes`` makes it once).
Writes ``model.sock`` (the sandbox's one way to the model server) in a folder of its own under the system's temp
dir (a unix socket's path holds 107 bytes: a deep ``workspace_root`` would not), removed at the end; and only under
``workspace_root`` else: one folder
per task, ``<task id>-XXXX/`` with ``ws/`` (the task's files, then what Hermes left), ``home/`` (its HERMES_HOME:
``config.yaml``, Hermes's ``state.db``, ``sessions/``, ``logs/``, ``driver.log``) and ``tmp/``.

    with HermesLoop(base_url, model, workspace_root=root) as loop:
        runs = loop.run(tasks)          # one HermesRun each: the verifier's reward, the messages, the id

What runs: ``agents/hermes_driver.py`` in the virtualenv's interpreter, under bubblewrap::

    bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --bind ROOT ROOT --unshare-net --unshare-pid
          --unshare-ipc --die-with-parent --new-session  python hermes_driver.py

The driver imports Hermes once and forks a child per task that confines itself (Landlock: only its own three
folders writable or readable among the tasks', TCP to the model's port only; the driver's docstring) before Hermes
sees the prompt, and is killed at the task's timeout. The network namespace is empty: the model server is reached
through ``model.sock``, which this module forwards to ``base_url``'s 127.0.0.1 port.

Each task's ``config.yaml`` names the model server (provider ``custom``) and sends ``X-Hermes-Conversation: <id>``
on every request (``model.default_headers``), so the gateway files the whole run under that id; after the run the
verifier (``tasks.hermes.verify``: the workspace and the final answer, never Hermes's account) scores it, and with
``feedback=True`` the reward is posted to the gateway as that conversation's feedback (``POST /v1/feedback``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hermes_lab.agents import hermes_chat as HA
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import workspace as W

DRIVER = Path(__file__).with_name("hermes_driver.py")
SYSTEM_CA_DIR = "/etc/ssl/certs"
START_TIMEOUT = 120.0  # seconds for the driver to import Hermes and say it is ready


class HermesLoopError(HA.HermesRunError):
    """The sandboxed driver could not start, or died."""


@dataclass
class LoopRun(HA.HermesRun):
    """A task run by Hermes's loop: the CLI run's fields (``session_id`` is the gateway's conversation id), and
    the conversation as Hermes kept it and the feedback post's HTTP status (None: not posted or no answer)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    feedback_status: int | None = None


def local_url(base_url: str) -> tuple[str, int]:
    """``base_url`` with its host 127.0.0.1 (the only address the sandbox reaches), and its port. Another host is a
    named error: the runner never sends a task anywhere but this machine."""
    u = urlsplit(base_url)
    if u.hostname not in ("127.0.0.1", "localhost"):
        raise ValueError(f"base_url {base_url!r}: the Hermes runner only reaches a model server on 127.0.0.1")
    port = u.port or (443 if u.scheme == "https" else 80)
    return urlunsplit((u.scheme, f"127.0.0.1:{port}", u.path, u.query, u.fragment)), port


class _Forwarder:
    """A unix socket at ``path`` whose every connection is passed on to 127.0.0.1:``port`` (the model server)."""

    def __init__(self, path: Path, port: int):
        self.path, self.port = path, port
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(64)
        threading.Thread(target=self._accept, daemon=True, name="hermes-model-forward").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return  # closed
            try:
                up = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                up.settimeout(None)
            except OSError:
                conn.close()
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.srv.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


def _pump(a: socket.socket, b: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := a.recv(65536):
            b.sendall(data)
    for s in (a, b):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


class HermesLoop:
    """One sandboxed Hermes process running tasks, ``parallel`` at a time (``run``); a context manager."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        workspace_root: str | os.PathLike[str],
        toolsets: Sequence[str] | None = HA.DEFAULT_TOOLSETS,
        timeout: float = 120,
        max_turns: int = 6,
        hermes_bin: str | os.PathLike[str] | None = None,
        context_length: int | None = None,
        feedback: bool = False,
        feedback_source: str = "system",
        api_key: str = "sk-unused",
        parallel: int = 2,
    ):
        self.base_url, self.port = local_url(base_url)
        self.model, self.toolsets, self.timeout, self.max_turns = model, toolsets, timeout, max_turns
        self.context_length, self.feedback, self.api_key = context_length, feedback, api_key
        self.feedback_source = feedback_source  # the gateway's serve.feedback_source: the task harness's verdict
        if parallel < 1:
            raise ValueError(f"parallel={parallel}: at least one task at a time")
        self.parallel = parallel  # tasks at once: Hermes's own CPU in one overlaps the model's answer to another
        self.hermes = HA.find_hermes(hermes_bin)
        self.python = self.hermes.parent / "python"
        self.root = Path(workspace_root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.forward: _Forwarder | None = None
        self.sock_dir: Path | None = None

    # ------------------------------------------------------------------------------------- the process
    def command(self) -> list[str]:
        """The driver under bubblewrap: the sandbox of the module's docstring."""
        bwrap = HA.check_sandbox()
        cmd = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        for p in HA._ro_binds(self.hermes):
            cmd += ["--ro-bind", p, p]
        root = str(self.root)
        cmd += ["--bind", root, root, "--chdir", root]
        cmd += ["--ro-bind", str(DRIVER), str(DRIVER)]  # a clone under /tmp: the tmpfs above would hide it
        if self.sock_dir is not None:  # the model socket's folder (under /tmp too, most often)
            cmd += ["--bind", str(self.sock_dir), str(self.sock_dir)]
        cmd += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session"]
        return [*cmd, str(self.python), str(DRIVER), "--parallel", str(self.parallel)]

    def stated_context_length(self) -> int | None:
        """The model's ``max_model_len`` as the server's ``/v1/models`` states it (what Hermes itself probes for at
        every agent's start: ~0.15 s and five requests a task), asked once here and written into each task's
        config.yaml, which Hermes takes before any probe. None where nothing is stated, or the length is one Hermes
        would not take as stated (under 64,000: it ignores it or refuses to run): Hermes then probes as it would."""
        import httpx

        try:
            with httpx.Client(trust_env=False, timeout=10) as http:
                data = http.get(f"{self.base_url}/models").json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        lens = [m.get("max_model_len") for m in data if isinstance(m, dict) and m.get("id") == self.model]
        n = lens[0] if lens else None
        return n if isinstance(n, int) and n >= HA.HERMES_MIN_CONTEXT else None

    def start(self) -> HermesLoop:
        if self.context_length is None:
            self.context_length = self.stated_context_length()
        self.sock_dir = Path(tempfile.mkdtemp(prefix="hermes-lab-sock-"))
        sock = self.sock_dir / "model.sock"
        self.forward = _Forwarder(sock, self.port)
        home = self.root / ".driver"  # the driver's own HERMES_HOME (what Hermes writes at import); tasks have theirs
        home.mkdir(exist_ok=True)
        env = HA.sandbox_env(self.root, home, self.api_key)
        env.update(HERMES_LAB_MODEL_SOCKET=str(sock), HERMES_LAB_MODEL_PORT=str(self.port))
        env.update(HERMES_LAB_DRIVER_HOME=str(home))
        try:
            return self._start(env)
        except BaseException:
            self.close()  # the forwarder and the socket's folder too, whatever failed (bubblewrap missing...)
            raise

    def _start(self, env: dict[str, str]) -> HermesLoop:
        if Path(SYSTEM_CA_DIR).is_dir():
            # the system's hashed CA folder, which OpenSSL reads a certificate at a time when one is needed, for
            # certifi's bundle, which every HTTP client Hermes makes parses whole (five a task, ~0.15 s of CPU)
            # though the only address in reach is plain HTTP on 127.0.0.1; httpx takes it from the environment
            env["SSL_CERT_DIR"] = SYSTEM_CA_DIR
        self.proc = subprocess.Popen(
            self.command(),
            cwd=self.root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.root / "driver.stderr", "ab"),  # noqa: SIM115 - the child keeps it
            text=True,
            start_new_session=True,
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read_lines, args=(self.proc.stdout, self.lines), daemon=True).start()
        line = self._read_line(START_TIMEOUT)
        if not line or not json.loads(line).get("ready"):
            tail = (self.root / "driver.stderr").read_text(errors="replace")[-2000:]
            raise HermesLoopError(f"the sandboxed Hermes driver did not start: {tail or 'no output'}")
        return self

    @staticmethod
    def _read_lines(stdout: Any, lines: queue.Queue[str | None]) -> None:
        """A thread: the driver's lines into ``lines`` as they come (several may come at once), None at its end."""
        with contextlib.suppress(OSError, ValueError):
            for line in stdout:
                lines.put(line)
        lines.put(None)

    def _read_line(self, timeout: float) -> str | None:
        """The driver's next line; None when it ended or said nothing for ``timeout`` seconds."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.forward is not None:
            self.forward.close()
            self.forward = None
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
            self.sock_dir = None

    def __enter__(self) -> HermesLoop:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------- the tasks
    def prepare(self, task: H.HermesTask) -> dict[str, Any]:
        """The task's folders (files laid, config.yaml written) and its line for the driver."""
        run_dir = Path(tempfile.mkdtemp(prefix=f"{task.task_id}-", dir=self.root))
        ws, home, tmp = run_dir / "ws", run_dir / "home", run_dir / "tmp"
        for d in (ws, home, tmp):
            d.mkdir()
        W.lay_files(ws, task.files)
        cid = f"hermes-{task.task_id}-{uuid.uuid4().hex[:10]}"
        HA.hermes_home(home, self.base_url, self.model, api_key=self.api_key, context_length=self.context_length)
        with (home / "config.yaml").open("a", encoding="utf-8") as f:  # model: is the file's only section
            f.write(f"  default_headers:\n    X-Hermes-Conversation: {json.dumps(cid)}\n")
        return {
            "id": task.task_id,
            "conversation_id": cid,
            "prompt": task.question,
            "workspace": str(ws),
            "home": str(home),
            "tmp": str(tmp),
            "timeout": self.timeout,
            "toolsets": list(self.toolsets) if self.toolsets is not None else None,
            "max_turns": self.max_turns,
            "base_url": self.base_url,
            "model": self.model,
            "port": self.port,
        }

    def run(
        self,
        tasks: Iterable[H.HermesTask | Mapping[str, Any]],
        progress: Callable[[LoopRun], None] | None = None,
    ) -> list[LoopRun]:
        """Run the tasks, ``parallel`` at a time; each result graded by the verifier (and posted as feedback when
        asked) as it ends, ``progress`` called then. Returns the runs in the tasks' order."""
        if self.proc is None or self.proc.stdin is None:
            raise HermesLoopError("HermesLoop.run before start() (use it as a context manager)")
        todo = [(t, self.prepare(t)) for t in map(HA.as_task, tasks)]
        by_cid = {line["conversation_id"]: (i, t, line) for i, (t, line) in enumerate(todo)}
        stdin = self.proc.stdin

        def feed() -> None:  # a thread: the driver takes lines as slots free, while results are read here
            with contextlib.suppress(OSError, ValueError):  # the driver died: the reads below say so
                for _, line in todo:
                    stdin.write(json.dumps(line) + "\n")
                    stdin.flush()

        writer = threading.Thread(target=feed, daemon=True, name="hermes-loop-feed")
        writer.start()
        runs: list[LoopRun | None] = [None] * len(todo)
        for _ in todo:  # each running task ends within its timeout: the next result is never further off
            out = self._read_line(self.timeout + 60)
            if out is None:
                left = [t.task_id for (t, _), r in zip(todo, runs, strict=True) if r is None]
                raise HermesLoopError(f"no result from the driver for {len(left)} task(s) {left[:5]} (died or hung)")
            res = json.loads(out)
            i, t, line = by_cid[res.get("conversation_id")]
            runs[i] = self._grade(t, line, res)
            if progress is not None:
                progress(runs[i])
        writer.join()
        return [r for r in runs if r is not None]

    def _grade(self, t: H.HermesTask, line: dict[str, Any], res: dict[str, Any]) -> LoopRun:
        ws, home = Path(line["workspace"]), Path(line["home"])
        messages = [m for m in res.get("messages") or [] if isinstance(m, dict)]
        answer = HA.final_answer(messages)
        source = "messages" if answer is not None else "none"
        if answer is None and isinstance(res.get("final_response"), str):
            answer, source = res["final_response"], "final_response"
        reward = H.verify(t, ws, answer)
        posted = self._post_feedback(line["conversation_id"], reward) if self.feedback else None
        exit_code = HA.TIMEOUT_EXIT if res.get("timed_out") else (1 if res.get("error") else 0)
        return LoopRun(
            task_id=t.task_id,
            prompt=t.question,
            toolsets=tuple(self.toolsets) if self.toolsets is not None else None,
            exit_code=exit_code,
            timed_out=bool(res.get("timed_out")),
            answer=answer,
            answer_source=source,
            reward=reward,
            success=reward >= HA.SUCCESS,
            seconds=float(res.get("seconds") or 0.0),
            session_id=line["conversation_id"],
            tool_calls=HA._tool_names(messages),
            workspace=ws,
            home=home,
            stdout_tail="",
            stderr_tail=str(res.get("error") or "")[-HA.TAIL :],
            messages=messages,
            feedback_status=posted,
        )

    def _post_feedback(self, conversation_id: str, reward: float) -> int | None:
        """The verifier's reward as the conversation's feedback on the gateway; its HTTP status (None: no answer)."""
        import httpx

        root = self.base_url.rsplit("/v1", 1)[0]
        body = {"conversation_id": conversation_id, "reward": reward, "source": self.feedback_source}
        try:
            with httpx.Client(trust_env=False, timeout=30) as http:
                return http.post(f"{root}/v1/feedback", json=body).status_code
        except httpx.HTTPError:
            return None


def install_hermes(version: str = HA.HERMES_VERSION) -> Path:
    """The pinned hermes-agent's ``hermes`` executable, its virtualenv made first when it is not there
    (``$HERMES_FIXTURE_VENV``, else ``~/.cache/hermes-lab/hermes-agent-<version>``; from the package registry, about
    40 s once). Raises HermesMissing when no Python >= 3.11 or no registry can make it."""
    venv = Path(
        os.environ.get("HERMES_FIXTURE_VENV") or Path.home() / ".cache" / "hermes-lab" / f"hermes-agent-{version}"
    )
    py = venv / "bin" / "python"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        shown = subprocess.run([str(py), "-m", "pip", "show", "hermes-agent"], capture_output=True, text=True)
        if f"Version: {version}" not in shown.stdout:
            cmd = [str(py), "-m", "pip", "install", "-q", f"hermes-agent=={version}"]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise HA.HermesMissing(f"cannot install hermes-agent=={version} into {venv}: {detail.strip()[-500:]}") from None
    return HA.find_hermes(venv / "bin" / "hermes")


def run_tasks(tasks: Iterable[H.HermesTask | Mapping[str, Any]], base_url: str, model: str, **kw: Any) -> list[LoopRun]:
    """``HermesLoop(base_url, model, **kw)`` started, every task run, stopped."""
    with HermesLoop(base_url, model, **kw) as loop:
        return loop.run(tasks)
