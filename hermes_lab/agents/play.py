"""The agent family's tasks played by the real Hermes Agent against one policy, served for it on 127.0.0.1.

Stage: execute and validate with ``agent.runner: hermes`` (execute's agent episodes against the champion; the
regression gate's agent family, each arm in turn).
Reads the round's config and the policy (a base model, and an adapter or none); writes under ``root``: ``params.yaml``
(the config the server runs with: the round's own, whole), ``gateway.out`` (its output), ``log/`` (its request log:
every request Hermes sent, the exact tokens of each answer) and the Hermes runner's folders (``ws/``: one per task,
its workspace, its HERMES_HOME and its session, as ``agents.hermes_loop.HermesLoop`` leaves them).

The policy is served by ``hermes-lab serve`` (``python -m hermes_lab.live.serve``) in a process of its own, both arms
of the gateway the one policy (``--ratio 0``, no rollout): the real agent talks to it as to any model server, and
what the verifier reads afterwards is what Hermes left on disk. The server samples each request with random numbers
drawn from its prompt (``serve.seed_from_prompt``): a task played against two policies meets the same draws wherever
their conversations agree, so the two arms' runs pair as the built-in loop's seeded episodes do.

    with served(cfg, base_model, adapter, root) as url:
        runs = play(cfg, url, tasks, root)         # one agents.hermes_loop.LoopRun each, in the tasks' order
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from hermes_lab.agents import hermes_chat as HA
from hermes_lab.agents import hermes_loop as HL
from hermes_lab.core.layout import PlayLayout

START_TIMEOUT = 600.0  # seconds for the server to load the policy (the embedded one is built first if need be)


def plays_hermes(cfg: Any) -> bool:
    """Whether the real Hermes Agent plays the round's agent family: ``agent.runner: hermes`` and the ``hermes``
    family (the real agent has Hermes's tools; the old ``time`` family's tool is not one of them)."""
    return cfg.agent.runner == "hermes" and cfg.grpo.environment.startswith("hermes_lab.tasks.hermes:")


def ready(say: Callable[[str], None] = print) -> Path:
    """The real agent can play here: the pinned hermes-agent installed (``say`` tells first, it takes ~40 s once)
    and bubblewrap able to make its sandbox. Returns the ``hermes`` executable; raises ``HermesRunError`` (its
    ``HermesMissing`` or ``BwrapMissing``) naming what is missing."""
    HA.check_sandbox()
    try:
        HA.find_hermes()
    except HA.HermesMissing:
        say(f"installing hermes-agent=={HA.HERMES_VERSION} for agent.runner: hermes (once, ~40 s)")
    return HL.install_hermes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def arm_spec(base_model: str, adapter: str | None) -> str:
    """What ``hermes-lab serve --baseline`` takes for this policy: the adapter's folder, else the base model."""
    return str(Path(adapter).resolve()) if adapter else base_model


@contextlib.contextmanager
def served(
    cfg: Any, base_model: str, adapter: str | None, root: str | Path, seed_from_prompt: bool = True
) -> Iterator[str]:
    """``hermes-lab serve`` on a free 127.0.0.1 port with this policy as its only arm; yields its root URL and stops
    it after. ``seed_from_prompt``: each request sampled with random numbers drawn from its prompt (validate's pairs,
    execute's reproducible draws). A server that exits or does not answer ``/healthz`` in START_TIMEOUT is a
    RuntimeError with its output's tail."""
    lay = PlayLayout(root)
    lay.root.mkdir(parents=True, exist_ok=True)
    params = lay.params
    raw = cfg.to_dict()
    raw["model"]["base_model"] = base_model
    params.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")  # the config holds no secret
    port, spec = free_port(), arm_spec(base_model, adapter)
    cmd = [sys.executable, "-m", "hermes_lab.live.serve", "--params", str(params), "--port", str(port)]
    cmd += ["--baseline", spec, "--candidate", spec, "--ratio", "0", "--log-dir", str(lay.log.root)]
    cmd += ["--experiment", lay.root.name, "--set", "serve.rollout=false"]
    # the same task's same state sampled with the same random numbers under either arm (pairs), on every run
    cmd += ["--set", f"serve.seed_from_prompt={str(seed_from_prompt).lower()}"]
    out = lay.output.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, lay.output)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, out: Path) -> None:
    t0 = time.monotonic()
    with httpx.Client(timeout=2, trust_env=False) as http:
        while time.monotonic() - t0 < START_TIMEOUT:
            if proc.poll() is not None:
                raise RuntimeError(f"hermes-lab serve exited ({proc.returncode}): {out.read_text()[-1500:]}")
            try:
                if http.get(url + "/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    raise RuntimeError(f"hermes-lab serve did not answer {url}/healthz in {START_TIMEOUT:.0f} s")


def play(
    cfg: Any,
    url: str,
    tasks: Sequence[Any],
    root: str | Path,
    progress: Callable[[HL.LoopRun], None] | None = None,
) -> list[HL.LoopRun]:
    """The tasks played by the real Hermes Agent against the server at ``url`` (``agent.parallel`` at once, each
    confined to its own workspace under ``root/ws``), each graded by its verifier; in the tasks' order. A progress
    bar unless ``progress`` is given."""
    from tqdm.auto import tqdm

    a = cfg.agent
    hermes = HL.install_hermes()
    bar = tqdm(total=len(tasks), desc="real Hermes Agent", unit="task", mininterval=2) if progress is None else None
    if bar is not None:
        progress = lambda _run: bar.update(1)  # noqa: E731
    with HL.HermesLoop(
        f"{url}/v1",
        cfg.serve.public_model,
        workspace_root=PlayLayout(root).runs,
        hermes_bin=hermes,
        timeout=a.timeout,
        max_turns=a.max_turns,
        parallel=a.parallel,
    ) as loop:
        try:
            return loop.run(tasks, progress=progress)
        finally:
            if bar is not None:
                bar.close()


def play_policy(
    cfg: Any,
    base_model: str,
    adapter: str | None,
    tasks: Sequence[Any],
    root: str | Path,
    progress: Callable[[HL.LoopRun], None] | None = None,
    seed_from_prompt: bool = True,
) -> list[HL.LoopRun]:
    """``served`` and ``play`` in one: the policy up, the tasks played, the policy down."""
    with served(cfg, base_model, adapter, root, seed_from_prompt) as url:
        return play(cfg, url, tasks, root, progress)


def conversation_records(runs: Sequence[HL.LoopRun], root: str | Path) -> list[dict[str, Any]]:
    """The runs as the canonical conversation record (``logs.record``'s fields): the messages as Hermes kept
    them, the tools its requests carried (the server's log, ``root/log``), the verifier's reward, the run's
    conversation id; what prep reads as a logged agent conversation."""
    import json

    def lines(path: Path) -> list[dict[str, Any]]:
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []

    log = PlayLayout(root).log
    by_hash = {r["tools_hash"]: r["tools"] for r in lines(log.tools)}
    tools: dict[str, Any] = {}
    for r in lines(log.requests):  # a conversation's tools: those of its first request
        if r.get("conversation_id") and r.get("tools_hash") in by_hash:
            tools.setdefault(r["conversation_id"], by_hash[r["tools_hash"]])
    return [
        {
            "id": r.session_id,
            "task_id": r.task_id,
            "family": "hermes",
            "messages": r.messages,
            "tools": tools.get(r.session_id or "") or [],
            "reward": r.reward,
            "runner": "hermes",
        }
        for r in runs
    ]
