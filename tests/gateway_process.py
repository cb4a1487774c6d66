"""A `hermes-lab serve` gateway started for a test (``python -m hermes_lab.live.serve`` in a subprocess on 127.0.0.1,
its output kept in files for the secrets checks), and the user's ABRouter formula to check its routing against.

    gw = Gateway(tmp_path, ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny"]).start()
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from fake_openai import PROXY_ENV_VARS, free_port
from repo_paths import REPO

GATEWAY_KEY = "gw-test-key-8f3a91c2d7"
UPSTREAM_KEY = "sk-upstream-5b7e0d44a1c9"


def formula_arm(unit: str, ratio: float) -> str:
    """The user's ABRouter, written out: first 8 hex digits of md5 / 0xFFFFFFFF < ratio -> candidate."""
    return "candidate" if int(hashlib.md5(unit.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < ratio else "baseline"


def wait_healthy(url: str, proc: subprocess.Popen, output: Callable[[], str], timeout: float = 120) -> None:
    """Until the gateway at ``url`` answers /healthz 200; its exit or ``timeout`` s fail with its ``output()``."""
    t0 = time.time()
    with httpx.Client(timeout=1, trust_env=False) as poll:  # one client for the polls (a new one is ~50 ms of CPU)
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited {proc.returncode}: {output()}")
            try:
                if poll.get(url + "/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
    raise RuntimeError(f"gateway did not start: {output()}")


class Gateway:
    """`python -m hermes_lab.live.serve` in a subprocess; stdout/stderr kept in files for the secrets check."""

    def __init__(self, tmp: Path, args: list[str], env: dict[str, str] | None = None, port: int | None = None):
        self.tmp, self.args, self.port = tmp, args, port or free_port()
        self.log_dir = tmp / "log"
        self.env = {k: v for k, v in os.environ.items() if k not in PROXY_ENV_VARS}
        self.env.update(PYTHONPATH=str(REPO), MLFLOW_DISABLE_TELEMETRY="true", **(env or {}))
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._poller: httpx.Client | None = None  # experiment()'s, kept: a new client is ~50 ms of CPU (SSL context)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> Gateway:
        self.starts += 1
        out = open(self.tmp / f"gateway-{self.starts}.out", "w")  # noqa: SIM115 (the child holds it)
        cmd = [
            sys.executable,
            "-m",
            "hermes_lab.live.serve",
            "--port",
            str(self.port),
            "--log-dir",
            str(self.log_dir),
        ]
        cmd += ["--set", f"round.runs_dir={REPO / 'runs'}", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp)
        wait_healthy(self.url, self.proc, self.output, timeout)
        return self

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("gateway-*.out")))

    def kill9(self) -> None:
        self._close_poller()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def _close_poller(self) -> None:
        if self._poller is not None:
            self._poller.close()
            self._poller = None

    def stop(self) -> None:
        self._close_poller()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:  # a graceful stop flushes the log and the MLflow traces: a loaded machine needs more than 30 s
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def records(self, name: str = "requests.jsonl") -> list[dict]:
        p = self.log_dir / name
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []

    def experiment(self) -> dict:
        if self._poller is None:
            self._poller = self.http()
        return self._poller.get("/v1/experiment").json()

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {GATEWAY_KEY}"}, trust_env=False, timeout=60
        )
