"""A stand-in agent: embedded tasks through the official ``openai`` SDK, the verifier's score as feedback.

Stage: validate (live A/B). Talks to a running gateway (``hermes-lab serve``); reads and writes nothing
on disk. It is how a newcomer (and the tests) drive the gateway the way a real agent built on the OpenAI
SDK would: ``base_url`` = the gateway, one public model name, ``metadata={"task_id": ...}``, ``user=``
(the unit when ``ab.unit: user``), the gateway's ``X-Request-ID`` read from the raw response, and later the
test harness' verdict (the task verifier, "system feedback") posted to ``/v1/feedback`` under that id.

    hermes-lab agent --url http://127.0.0.1:8700 --requests 500 --concurrency 8
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hermes_lab.tasks import suite as T


def run_agent(
    url: str,
    n: int,
    concurrency: int = 4,
    *,
    seed: int = 0,
    api_key: str | None = None,
    users: int = 0,
    stream_every: int = 0,
    feedback: bool = True,
    split: str = "train",
    max_tokens: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Send ``n`` embedded tasks (``concurrency`` in flight), post each verifier score; returns a summary.

    ``users`` > 0 spreads requests over that many user ids (``user=``); ``stream_every`` k > 0 streams
    every k-th request. Every request ends in ``results`` (request_id, arm, reward, error)."""
    import httpx
    import openai
    from tqdm.auto import tqdm

    root = url.rstrip("/").removesuffix("/v1")
    key = api_key or "none"  # the SDK wants a key; a gateway without serve.api_key_env ignores it
    client = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id  # the gateway's one public model
    http = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False)
    tasks = T.generate_tasks(n, split=split, seed=seed)
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    lock = threading.Lock()
    bar = tqdm(total=n, desc="agent requests", disable=not progress, mininterval=1)

    def one(i: int) -> None:
        t = tasks[i]
        kw: dict[str, Any] = {"metadata": {"task_id": t.task_id}}
        if users:
            kw["user"] = f"user-{seed}-{i % users:05d}"
        if max_tokens:
            kw["max_tokens"] = max_tokens
        out: dict[str, Any] = {"task_id": t.task_id, "prompt": t.prompt}
        try:
            msgs = [{"role": "user", "content": t.prompt}]
            if stream_every and i % stream_every == 0:
                with client.chat.completions.with_streaming_response.create(
                    model=model, messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
                ) as raw:
                    out.update(request_id=raw.headers.get("x-request-id"), arm=raw.headers.get("x-hermes-arm"))
                    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
            else:
                raw = client.chat.completions.with_raw_response.create(model=model, messages=msgs, **kw)
                out.update(request_id=raw.headers.get("x-request-id"), arm=raw.headers.get("x-hermes-arm"))
                text = raw.parse().choices[0].message.content or ""
            out.update(response=text, reward=T.verify(t.prompt, text))
            if feedback:
                r = http.post(
                    "/v1/feedback",
                    json={"request_id": out["request_id"], "reward": out["reward"], "source": "system"},
                )
                out["feedback_status"] = r.status_code
        except (openai.OpenAIError, httpx.HTTPError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        with lock:
            results[i] = out
            bar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            list(pool.map(one, range(n)))
    finally:
        bar.close()
        http.close()
        client.close()
    return summarize(results)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    arms: dict[str, list[float]] = {}
    for r in results:
        if "reward" in r:
            arms.setdefault(r.get("arm") or "?", []).append(r["reward"])
    return {
        "requests": len(results),
        "answered": sum("reward" in r for r in results),
        "errors": sum("error" in r for r in results),
        "feedback_accepted": sum(r.get("feedback_status") == 202 for r in results),
        "per_arm": {
            a: {
                "n": len(v),
                "mean_reward": round(sum(v) / len(v), 4),
                "pass_rate": round(sum(x >= 3 for x in v) / len(v), 4),
            }
            for a, v in sorted(arms.items())
        },
        "first_errors": Counter(r["error"][:160] for r in results if "error" in r).most_common(3),
        "results": results,
    }


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8700", help="the gateway (its root or .../v1)")
    p.add_argument("--requests", type=int, default=100, help="how many tasks to send")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--users", type=int, default=0, help="spread requests over this many user ids (ab.unit: user)")
    p.add_argument("--stream-every", type=int, default=0, help="stream every k-th request (0: none)")
    p.add_argument("--no-feedback", action="store_true", help="do not post the verifier's scores")
    p.add_argument("--key-env", default="", metavar="VAR", help="env var with the gateway key (serve.api_key_env)")


def run_cli(args: argparse.Namespace) -> int:
    key = os.environ.get(args.key_env, "") if args.key_env else None
    if args.key_env and not key:
        print(f"hermes-lab agent: {args.key_env} is not set", file=sys.stderr)
        return 2
    try:
        s = run_agent(
            args.url,
            args.requests,
            args.concurrency,
            seed=args.seed,
            api_key=key,
            users=args.users,
            stream_every=args.stream_every,
            feedback=not args.no_feedback,
        )
    except Exception as e:  # the gateway is down or refuses: one line, not a traceback
        print(f"hermes-lab agent: cannot reach the gateway at {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        f"agent: {s['answered']}/{s['requests']} answered, {s['errors']} errors, "
        f"{s['feedback_accepted']} feedback accepted"
    )
    for arm, v in s["per_arm"].items():
        print(f"  {arm:9s} n={v['n']:5d}  mean reward {v['mean_reward']:.3f}  pass rate {v['pass_rate']:.1%}")
    for err, k in s["first_errors"]:
        print(f"  error x{k}: {err}", file=sys.stderr)
    return 0 if s["errors"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.live.agent", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
