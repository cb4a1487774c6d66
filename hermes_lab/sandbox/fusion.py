"""The HTTP executor: programs run by a sandbox service that speaks SandboxFusion's ``run_code`` API.

Stage: train (the tests reward, ``sandbox.executor: fusion``). Reads and writes nothing; one HTTP request per run.

SandboxFusion (github.com/bytedance/SandboxFusion, ``sandbox/server/sandbox_api.py``) is the open-source code
sandbox server verl and others use for code rewards. Its API, the part used here::

    POST {url}/run_code
    {"code": str, "language": "python", "run_timeout": float, "compile_timeout": float,
     "memory_limit_MB": int, "stdin": str | null, "files": {}, "fetch_files": []}
    -> {"status": "Success" | "Failed" | "SandboxError", "message": str,
        "compile_result": null | {...},
        "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time": float | null,
                       "return_code": int | null, "stdout": str | null, "stderr": str | null},
        "executor_pod_name": str | null, "files": {}}

How a response maps onto a ``RunResult``: ``TimeLimitExceeded`` -> timeout; ``Finished`` with return code 0
-> ok, another code -> error (a negative one, a signal -> killed); ``SandboxError``, ``Error``, a response that is
not that JSON, an HTTP error or no answer after the retries -> sandbox_error (the service failed, not the
program: the tests reward scores it None and counts it). Output reaching ``max_output_kb``, or cut by the
service (the stand-in's ``message: output_limit ...``) -> output_limit. ``language`` (python, bash), ``files``
and ``fetch_files`` go as the request's; the fetched files come back in ``RunResult.files``.
What the service isolates is its own business (SandboxFusion: overlayfs, cgroups, a network namespace).

``hermes_lab.sandbox.server`` is a stand-in for the same API on this machine (the local executor behind it).

    hermes-lab config --explain | grep sandbox.        # sandbox.executor: fusion, sandbox.url, ...
"""

from __future__ import annotations

import base64
import binascii
import os
import time
from typing import Any

from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult

RETRY_STATUS = {429, 500, 502, 503, 504}


class FusionExecutor(Executor):
    """A SandboxFusion ``run_code`` client: retried, concurrent up to ``workers``, a Bearer key when
    ``api_key_env`` names a set environment variable (SandboxFusion itself has none; a gateway in front may)."""

    name = "fusion"

    def __init__(
        self,
        url: str,
        workers: int | None = None,
        retries: int = 3,
        api_key_env: str = "",
        connect_timeout_s: float = 5.0,
    ):
        super().__init__(workers or 8)
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox.url must be an http(s) URL of a run_code server, got {url!r}")
        import httpx

        self.url = url.rstrip("/")
        self.retries = retries
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(60.0, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=self.workers, max_keepalive_connections=self.workers),
            trust_env=False,  # a stale HTTP_PROXY must not send code to a proxy
        )

    def run_one(self, req: RunRequest, limits: Limits) -> RunResult:
        import httpx

        body = {
            "code": req.program,
            "language": req.language,
            "run_timeout": float(limits.timeout_s),
            "compile_timeout": 10.0,
            "memory_limit_MB": int(limits.memory_mb),
            "stdin": req.stdin,
            "files": {k: base64.b64encode(v).decode() for k, v in req.files.items()},
            "fetch_files": list(req.fetch),
        }
        t0 = time.monotonic()
        error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(4.0, 0.25 * 2**attempt))
            try:
                r = self.client.post(f"{self.url}/run_code", json=body, timeout=float(limits.timeout_s) + 30.0)
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in RETRY_STATUS:
                error = f"HTTP {r.status_code}"
                continue
            if r.status_code != 200:
                return RunResult("sandbox_error", detail=f"HTTP {r.status_code}: {r.text[:200]}", seconds=_since(t0))
            try:
                data = r.json()
            except ValueError:
                return RunResult("sandbox_error", detail=f"not JSON: {r.text[:200]!r}", seconds=_since(t0))
            return self._result(data, limits, _since(t0))
        return RunResult(
            "sandbox_error", detail=f"{self.url}/run_code: {error} after {self.retries} retries", seconds=_since(t0)
        )

    @staticmethod
    def _result(data: Any, limits: Limits, seconds: float) -> RunResult:
        if not isinstance(data, dict) or data.get("status") not in ("Success", "Failed", "SandboxError"):
            return RunResult("sandbox_error", detail=f"not a run_code response: {str(data)[:200]}", seconds=seconds)
        run = data.get("run_result")
        if data["status"] == "SandboxError" or not isinstance(run, dict):
            return RunResult("sandbox_error", detail=str(data.get("message") or "no run_result")[:300], seconds=seconds)
        cap = int(limits.max_output_kb) << 10
        stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
        took = run.get("execution_time")
        seconds = float(took) if isinstance(took, (int, float)) else seconds
        files = _files(data.get("files"))
        # cut by this side's limit, or by the service's (the stand-in says so in message; a cut lands on its cap)
        cut = str(data.get("message") or "").startswith("output_limit")
        if cut or max(len(stdout.encode("utf-8", "replace")), len(stderr.encode("utf-8", "replace"))) >= cap:
            detail = str(data.get("message") or "")[len("output_limit: ") :] or f"more than {cap >> 10} KiB of output"
            return RunResult("output_limit", None, stdout[:cap], stderr[-cap:], seconds, detail=detail, files=files)
        status, code = run.get("status"), run.get("return_code")
        if status == "TimeLimitExceeded":
            detail = f"wall clock > {limits.timeout_s:g} s"
            return RunResult("timeout", None, stdout, stderr, seconds, detail=detail, files=files)
        if status != "Finished" or not isinstance(code, int):
            return RunResult("sandbox_error", None, stdout, stderr, seconds, detail=f"run_result status {status!r}")
        if code < 0:
            detail = f"killed by signal {-code}"
            return RunResult("killed", None, stdout, stderr, seconds, signal=-code, detail=detail, files=files)
        return RunResult("ok" if code == 0 else "error", code, stdout, stderr, seconds, files=files)

    def describe(self) -> dict[str, Any]:
        return {
            "executor": self.name,
            "workers": self.workers,
            "url": self.url,
            "network": "as the service isolates it (SandboxFusion: a network namespace per run)",
        }

    def close(self) -> None:
        super().close()
        self.client.close()


def _files(value: Any) -> dict[str, bytes]:
    """The response's fetched files (path -> base64), decoded; what does not decode is left out."""
    out: dict[str, bytes] = {}
    for k, v in (value or {}).items() if isinstance(value, dict) else ():
        try:
            out[str(k)] = base64.b64decode(v, validate=True)
        except (binascii.Error, TypeError, ValueError):
            continue
    return out


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 4)
