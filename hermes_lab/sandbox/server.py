"""A stand-in SandboxFusion server: ``POST /run_code`` on this machine, each run through the local executor.

Stage: none of the round's; a service. Reads and writes nothing under runs/ (runs use the local executor's temp
dirs). It lets the HTTP executor (``hermes_lab.sandbox.fusion``, ``sandbox.executor: fusion``) be tested and
used without SandboxFusion itself, and gives a machine without one a sandbox service that several trainers can
share. It implements the API's request and response shapes for ``language: python``; other languages, ``files``
and ``fetch_files`` are answered with ``SandboxError``, as SandboxFusion answers what it cannot run.

    python -m hermes_lab.sandbox.server --port 8800          # then sandbox.executor: fusion,
                                                            #      sandbox.url: http://127.0.0.1:8800
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from hermes_lab.sandbox.executor import Limits, RunRequest, RunResult
from hermes_lab.sandbox.local import LocalExecutor

MAX_TIMEOUT_S = 60.0


def run_code_response(req: Any, executor: LocalExecutor, default: Limits) -> dict[str, Any]:
    """The ``RunCodeResponse`` for a ``RunCodeRequest`` body (a dict), as SandboxFusion's sandbox_api builds it."""
    if not isinstance(req, dict) or not isinstance(req.get("code"), str):
        return _error("the request needs 'code' (a string) and 'language'")
    if req.get("language") != "python":
        return _error(f"language {req.get('language')!r} is not supported by this stand-in (python only)")
    if req.get("files") or req.get("fetch_files"):
        return _error("files and fetch_files are not supported by this stand-in")
    stdin = req.get("stdin") or ""
    if not isinstance(stdin, str):
        return _error("stdin must be a string")
    try:
        timeout = min(MAX_TIMEOUT_S, float(req.get("run_timeout", 10)))
        memory = int(req.get("memory_limit_MB", -1))
    except (TypeError, ValueError):
        return _error("run_timeout and memory_limit_MB must be numbers")
    limits = Limits(
        timeout_s=timeout,
        cpu_s=timeout,
        memory_mb=memory if memory > 0 else default.memory_mb,
        file_mb=default.file_mb,
        max_processes=default.max_processes,
        max_files=default.max_files,
        max_output_kb=default.max_output_kb,
    )
    r = executor.run_one(RunRequest(req["code"], stdin), limits)
    run = _run_result(r)
    if run["status"] == "Error":
        return {**_error(r.detail or "the sandbox failed"), "run_result": run}
    ok = run["status"] == "Finished" and run["return_code"] == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": "",
        "compile_result": None,
        "run_result": run,
        "executor_pod_name": None,
        "files": {},
    }


def _run_result(r: RunResult) -> dict[str, Any]:
    status, code = "Finished", r.exit_code
    if r.status == "timeout":
        status, code = "TimeLimitExceeded", None
    elif r.status in ("killed", "output_limit"):  # SandboxFusion reports a killed process by a negative code
        code = -(r.signal or 9)
    elif r.status == "sandbox_error":
        status, code = "Error", None
    stderr = r.stderr if r.status != "output_limit" else r.stderr + f"\n{r.detail}"
    return {"status": status, "execution_time": r.seconds, "return_code": code, "stdout": r.stdout, "stderr": stderr}


def _error(message: str) -> dict[str, Any]:
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


def build_app(executor: LocalExecutor, default: Limits | None = None) -> Any:
    """The Starlette app: POST /run_code, GET /v1/ping (SandboxFusion's health check answers 'pong')."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    limits = default or Limits()

    async def run_code(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"detail": "the body is not JSON"}, status_code=422)
        return JSONResponse(await run_in_threadpool(run_code_response, body, executor, limits))

    async def ping(request: Request) -> PlainTextResponse:
        return PlainTextResponse("pong")

    return Starlette(routes=[Route("/run_code", run_code, methods=["POST"]), Route("/v1/ping", ping)])


def serve(sock: socket.socket, executor: LocalExecutor, default: Limits | None = None) -> Any:
    """A uvicorn server on a bound socket (``server.run(sockets=[sock])`` blocks; tests run it in a thread)."""
    import uvicorn

    config = uvicorn.Config(build_app(executor, default), log_level="warning", access_log=False, ws="none")
    return uvicorn.Server(config)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8800, help="port to bind (0: any free port)")
    p.add_argument("--workers", type=int, default=None, help="programs run at once (default: the cores)")


def run_cli(args: argparse.Namespace) -> int:
    executor = LocalExecutor(workers=args.workers)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"sandbox server: cannot bind {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    rep = executor.describe()
    print(f"sandbox server: http://{args.host}:{sock.getsockname()[1]}/run_code  ({rep.get('network')})", flush=True)
    serve(sock, executor).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.sandbox.server", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
