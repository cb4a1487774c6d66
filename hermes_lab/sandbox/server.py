"""A stand-in SandboxFusion server: ``POST /run_code`` on this machine, each run through the local executor.

Stage: none of the round's; a service. Reads and writes nothing under runs/ (runs are the local sandbox's). It lets
the HTTP executor (``hermes_lab.sandbox.fusion``, ``sandbox.executor: fusion``) be tested and used without
SandboxFusion itself, and gives a machine without one a sandbox service that several trainers can share. It
speaks the API as SandboxFusion's ``sandbox/server/sandbox_api.py`` defines it and its official client
(``sandbox-fusion`` on PyPI) expects it, for ``language`` python and bash:

- ``RunCodeRequest`` validated as FastAPI does: a body that is not that object answers 422 with pydantic's
  ``{"detail": [{"loc", "msg", "type"}]}``; a language SandboxFusion knows but this stand-in does not run
  answers ``SandboxError``, as SandboxFusion answers what it cannot run;
- ``files`` (path -> base64, relative to the program's work dir) written before the run, ``fetch_files`` read
  after it and returned base64 in ``files`` (a file not there, or not a regular file: a FIFO, a device, is
  left out); a name of either that leaves the work dir answers ``SandboxError``;
- a body over ``--max-body-mb`` answers 413, JSON nested past the parser's depth 400 (never a 500);
- ``run_result``: ``Finished`` with the program's own exit code (negative: the signal that killed it, as
  asyncio reports it), ``TimeLimitExceeded`` with no code; the program's ``__file__`` is its file in the work
  dir and its tracebacks are its own; output past the server's limit is cut and ``message`` says
  ``output_limit``;
- ``GET /v1/ping`` answers ``"pong"`` as JSON; ``--workers`` runs at most that many programs at once, whatever
  the number of requests in flight (the others wait their turn).

    python -m hermes_lab.sandbox.server --port 8800 --workers 2   # then sandbox.executor: fusion,
                                                                 #      sandbox.url: http://127.0.0.1:8800
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import socket
import sys
import threading
from typing import Any

from hermes_lab.sandbox.executor import Limits, RunRequest, RunResult
from hermes_lab.sandbox.local import LocalExecutor

MAX_TIMEOUT_S = 60.0
MAX_BODY = 64 << 20  # a request's bytes (its files travel in it, base64): more is answered 413
RUNS = ("python", "bash")
# SandboxFusion's Language literal (sandbox/runners/types.py): anything else is a malformed request (422)
LANGUAGES = RUNS + (
    "cpp",
    "nodejs",
    "go",
    "go_test",
    "java",
    "php",
    "csharp",
    "typescript",
    "sql",
    "rust",
    "cuda",
    "lua",
    "R",
    "perl",
    "D_ut",
    "ruby",
    "scala",
    "julia",
    "pytest",
    "junit",
    "kotlin_script",
    "jest",
    "verilog",
    "python_gpu",
    "lean",
    "swift",
    "racket",
)


class Invalid(ValueError):
    """A request field that pydantic would refuse: (location, message, type), answered 422."""

    def __init__(self, loc: str, msg: str, kind: str):
        super().__init__(msg)
        self.error = {"loc": ["body", loc] if loc else ["body"], "msg": msg, "type": kind}


def validate(body: Any) -> dict[str, Any]:
    """``RunCodeRequest`` with its defaults filled in, or ``Invalid``."""
    if not isinstance(body, dict):
        raise Invalid(
            "", "Input should be a valid dictionary or object to extract fields from", "model_attributes_type"
        )
    if not isinstance(body.get("code"), str):
        raise Invalid(
            "code", "Field required" if "code" not in body else "Input should be a valid string", "string_type"
        )
    if body.get("language") not in LANGUAGES:
        raise Invalid("language", f"Input should be one of {', '.join(map(repr, LANGUAGES))}", "literal_error")
    req = {"compile_timeout": 10.0, "run_timeout": 10.0, "memory_limit_MB": -1, "stdin": None, "files": {}}
    req.update({k: v for k, v in body.items() if k in (*req, "code", "language", "fetch_files")})
    for key in ("compile_timeout", "run_timeout"):
        if isinstance(req[key], bool) or not isinstance(req[key], (int, float)):
            raise Invalid(key, "Input should be a valid number", "float_type")
    if isinstance(req["memory_limit_MB"], bool) or not isinstance(req["memory_limit_MB"], int):
        raise Invalid("memory_limit_MB", "Input should be a valid integer", "int_type")
    if req["stdin"] is not None and not isinstance(req["stdin"], str):
        raise Invalid("stdin", "Input should be a valid string", "string_type")
    files = req["files"]
    if not isinstance(files, dict) or not all(isinstance(v, (str, type(None))) for v in files.values()):
        raise Invalid("files", "Input should be a valid dictionary of strings", "dict_type")
    fetch = req.get("fetch_files", [])
    if not isinstance(fetch, list) or not all(isinstance(v, str) for v in fetch):
        raise Invalid("fetch_files", "Input should be a valid list of strings", "list_type")
    req["fetch_files"] = fetch
    return req


def run_code_response(req: dict[str, Any], executor: LocalExecutor, default: Limits) -> dict[str, Any]:
    """The ``RunCodeResponse`` for a validated request, as SandboxFusion's sandbox_api builds it."""
    if req["language"] not in RUNS:
        return _error(f"language {req['language']!r} is not run by this stand-in (python and bash only)")
    files: dict[str, bytes] = {}
    for name in [*req["files"], *req["fetch_files"]]:
        if not _inside(name):
            field = "files" if name in req["files"] else "fetch_files"
            return _error(f"{field}: {name!r} must be a relative path inside the work dir")
    for name, content in req["files"].items():
        if content is None:
            continue  # SandboxFusion skips a file without content
        try:
            files[name] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            return _error(f"files: {name!r} is not base64")
    timeout = min(MAX_TIMEOUT_S, max(0.1, float(req["run_timeout"])))
    memory = req["memory_limit_MB"]
    limits = Limits(
        timeout_s=timeout,
        cpu_s=timeout,
        memory_mb=memory if memory > 0 else default.memory_mb,
        file_mb=default.file_mb,
        max_processes=default.max_processes,
        max_files=default.max_files,
        max_output_kb=default.max_output_kb,
    )
    run = RunRequest(req["code"], req["stdin"] or "", req["language"], files, tuple(req["fetch_files"]))
    r = executor.run_one(run, limits)
    result = _run_result(r)
    if r.status == "sandbox_error":
        return {**_error(r.detail or "the sandbox failed"), "run_result": result}
    ok = result["status"] == "Finished" and result["return_code"] == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": f"output_limit: {r.detail}" if r.status == "output_limit" else "",
        "compile_result": None,
        "run_result": result,
        "executor_pod_name": None,
        "files": {k: base64.b64encode(v).decode() for k, v in r.files.items()},
    }


def _inside(name: str) -> bool:
    """A name of ``files`` or ``fetch_files``: a relative path that stays in the work dir (no '..', no NUL)."""
    return bool(name) and "\0" not in name and not os.path.isabs(name) and ".." not in name.split("/")


def _run_result(r: RunResult) -> dict[str, Any]:
    status, code = "Finished", r.exit_code
    if r.status == "timeout":
        status, code = "TimeLimitExceeded", None
    elif r.status in ("killed", "output_limit"):  # as asyncio reports a process a signal ended
        code = -(r.signal or 9)
    elif r.status == "sandbox_error":
        status, code = "Error", None
    return {"status": status, "execution_time": r.seconds, "return_code": code, "stdout": r.stdout, "stderr": r.stderr}


def _error(message: str) -> dict[str, Any]:
    return {
        "status": "SandboxError",
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


class BodyRefused(ValueError):
    """A request body the stand-in does not parse: too large (413) or nested too deep for the parser (400)."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


async def read_json(request: Any, max_body: int) -> Any:
    """The body as JSON, read at most ``max_body`` bytes (Content-Length first, then as it streams: a chunked
    body has none). Too large: 413; nested past the parser's recursion (a RecursionError, no ValueError): 400;
    malformed: ValueError (422, as FastAPI answers)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body:
        raise BodyRefused(413, f"the request body is over {max_body >> 20} MiB")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            raise BodyRefused(413, f"the request body is over {max_body >> 20} MiB")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise BodyRefused(400, "the JSON body is nested too deeply") from None
    except MemoryError:
        raise BodyRefused(413, "the JSON body does not fit in memory") from None


def build_app(
    executor: LocalExecutor, default: Limits | None = None, workers: int | None = None, max_body: int = MAX_BODY
) -> Any:
    """The Starlette app: POST /run_code, GET /v1/ping. ``workers``: programs at once (default the executor's);
    ``max_body``: a request's bytes at most."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = default or Limits()
    turns = threading.BoundedSemaphore(workers or executor.workers)

    def run_in_turn(req: dict[str, Any]) -> dict[str, Any]:
        with turns:
            return run_code_response(req, executor, limits)

    async def run_code(request: Request) -> JSONResponse:
        try:
            req = validate(await read_json(request, max_body))
        except BodyRefused as e:
            return JSONResponse({"detail": str(e)}, status_code=e.status)
        except ValueError as e:
            error = (
                e.error
                if isinstance(e, Invalid)
                else {"loc": ["body"], "msg": "JSON decode error", "type": "json_invalid"}
            )
            return JSONResponse({"detail": [error]}, status_code=422)
        return JSONResponse(await run_in_threadpool(run_in_turn, req))

    async def ping(request: Request) -> JSONResponse:
        return JSONResponse("pong")

    return Starlette(routes=[Route("/run_code", run_code, methods=["POST"]), Route("/v1/ping", ping)])


def serve(
    sock: socket.socket,
    executor: LocalExecutor,
    default: Limits | None = None,
    workers: int | None = None,
    max_body: int = MAX_BODY,
) -> Any:
    """A uvicorn server on a bound socket (``server.run(sockets=[sock])`` blocks; tests run it in a thread)."""
    import uvicorn

    app = build_app(executor, default, workers, max_body)
    config = uvicorn.Config(app, log_level="warning", access_log=False, ws="none")
    return uvicorn.Server(config)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8800, help="port to bind (0: any free port)")
    p.add_argument("--workers", type=int, default=None, help="programs run at once (default: the cores)")
    p.add_argument("--python", default=None, help="the runs' interpreter, a virtualenv's (default: stdlib only)")
    p.add_argument("--max-body-mb", type=int, default=MAX_BODY >> 20, help="a request's size at most (413 past it)")


def run_cli(args: argparse.Namespace) -> int:
    executor = LocalExecutor(workers=args.workers, python=args.python)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"sandbox server: cannot bind {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    rep = executor.describe()
    gaps = "; ".join(rep.get("missing") or []) or "every layer enforced"
    print(f"sandbox server: http://{args.host}:{sock.getsockname()[1]}/run_code  ({rep['mode']}: {gaps})", flush=True)
    serve(sock, executor, workers=args.workers, max_body=args.max_body_mb << 20).run(sockets=[sock])
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.sandbox.server", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
