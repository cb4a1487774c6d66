"""A stand-in agent: embedded tasks through the official ``openai`` SDK, the task's own score as feedback.

Stage: validate (live A/B). Talks to a running gateway (``hermes-lab serve``); reads and writes nothing
on disk. It is how a newcomer (and the tests) drive the gateway the way a real agent built on the OpenAI
SDK would: ``base_url`` = the gateway, one public model name, ``metadata={"task_id": ...}``, ``user=``
(the unit when ``ab.unit: user``), the gateway's ``X-Request-ID`` and ``X-Hermes-Conversation`` read from the raw
response, and later the test harness' verdict ("system feedback") posted to ``/v1/feedback``. Two kinds of
conversation, mixed at ``serve.agent_share`` (``--agent-share``):

- a string task (``hermes_lab.tasks.suite``): one request, its answer scored by the task's verifier, the score
  posted under the request id;
- an agent episode (``hermes_lab.tasks.hermes``, the embedded agent family: a workspace task on the Hermes Agent's
  own tools) played as a client-side agent loop: the task with Hermes's tool schemas in ``tools``, every tool call
  the answer makes executed by the agent on the task's own workspace (``WorkspaceEnv``: Hermes's tools and result
  strings, confined to a temporary folder; an unknown tool becomes the tool message ``{'error': ...}``) and its result
  sent back in the next request, for at most ``max_turns`` tool-calling turns; the verifier's score of what the
  workspace holds afterwards and of the final answer posted under the conversation id.

With ``--runner hermes`` the agent episodes are the real Hermes Agent's: its own loop (``run_agent.AIAgent``) and
tools, many tasks per sandboxed process (``hermes_lab.agents.hermes_loop``: each task confined to its own workspace),
one process per conversation in flight; each run is filed under the conversation id it sends and the verifier's
score of its workspace and final answer is posted as that conversation's feedback. The pinned hermes-agent's
virtualenv is made on first use (from the package registry).

    hermes-lab agent --url http://127.0.0.1:8700 --requests 500 --concurrency 8 --agent-share 0.3
    hermes-lab agent --url http://127.0.0.1:8700 --requests 60 --agent-share 1 --runner hermes
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W


def plays_agent(seed: int, i: int, share: float) -> bool:
    """Whether conversation ``i`` of a run is an agent episode (a fixed draw per seed and index)."""
    return share > 0 and random.Random(f"agent-share:{seed}:{i}").random() < share


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
    agent_share: float = 0.0,
    max_turns: int = 2,
    temperature: float | None = None,
    stop: threading.Event | None = None,
    runner: str = "builtin",
    workspace_root: str | os.PathLike[str] | None = None,
    hermes_in_flight: int = 0,
) -> dict[str, Any]:
    """Run ``n`` conversations (``concurrency`` in flight), a share ``agent_share`` of them agent episodes, and post
    each one's score; returns a summary.

    ``users`` > 0 spreads conversations over that many user ids (``user=``); ``stream_every`` k > 0 streams every
    k-th request; ``temperature`` is sent when given (0: greedy); ``stop`` set: conversations not yet started are
    skipped (counted as ``skipped``). Every conversation ends in ``results`` (kind, request_id, conversation_id,
    arm, reward, error; an episode also its turns, tool calls and whether its first answer called a tool).
    ``runner``: "builtin" (this module's client loop) or "hermes" (the real Hermes Agent's loop, its runs' folders
    under ``workspace_root``, a temporary folder by default; ``max_tokens``, ``temperature`` and ``users`` are
    Hermes's own business then; ``hermes_in_flight`` > 0: at most that many of its processes run at once, while the
    string tasks keep the whole ``concurrency``)."""
    import httpx
    import openai
    from tqdm.auto import tqdm

    root = url.rstrip("/").removesuffix("/v1")
    key = api_key or "none"  # the SDK wants a key; a gateway without serve.api_key_env ignores it
    client = openai.OpenAI(base_url=root + "/v1", api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id  # the gateway's one public model
    http = httpx.Client(base_url=root, headers={"Authorization": f"Bearer {key}"}, timeout=30, trust_env=False)
    tasks = T.generate_tasks(n, split=split, seed=seed)
    agent_tasks = H.generate_tasks(n, split=split, seed=seed) if agent_share > 0 else []
    tools = W.tool_schema() if agent_share > 0 else []
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    lock = threading.Lock()
    bar = tqdm(total=n, desc="agent conversations", disable=not progress, mininterval=1)
    count = iter(range(1 << 62))

    def ask(msgs: list[dict[str, Any]], kw: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """One request: (the assistant message as an SDK agent appends it, the response headers)."""
        if stream_every and next(count) % stream_every == 0:
            with client.chat.completions.with_streaming_response.create(
                model=model, messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
            ) as raw:
                text, calls = "", {}
                for c in raw.parse():
                    d = c.choices[0].delta if c.choices else None
                    if d is None:
                        continue
                    text += d.content or ""
                    for tc in d.tool_calls or []:  # OpenAI's tool-call deltas: id and name first, then arguments
                        got = calls.setdefault(
                            tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                        )
                        got["id"] = tc.id or got["id"]
                        if tc.function is not None:
                            got["function"]["name"] = tc.function.name or got["function"]["name"]
                            got["function"]["arguments"] += tc.function.arguments or ""
                msg: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    msg["tool_calls"] = [calls[k] for k in sorted(calls)]
                return msg, raw.headers
        raw = client.chat.completions.with_raw_response.create(model=model, messages=msgs, **kw)
        return raw.parse().choices[0].message.model_dump(exclude_none=True), raw.headers

    def string_task(i: int, kw: dict[str, Any], out: dict[str, Any]) -> None:
        t = tasks[i]
        out.update(kind="string", task_id=t.task_id, prompt=t.prompt)
        msg, h = ask([{"role": "user", "content": t.prompt}], {**kw, "metadata": {"task_id": t.task_id}})
        out.update(request_id=h.get("x-request-id"), conversation_id=h.get("x-hermes-conversation"))
        text = msg.get("content") or ""
        out.update(arm=h.get("x-hermes-arm"), response=text, reward=T.verify(t.prompt, text), requests=1)
        if feedback:
            r = http.post("/v1/feedback", json={"request_id": out["request_id"], "reward": out["reward"]})
            out["feedback_status"] = r.status_code

    def episode(i: int, kw: dict[str, Any], out: dict[str, Any]) -> None:
        t = agent_tasks[i]
        env = H.WorkspaceEnv(seed=seed)
        env.reset(question=t.question)
        by_name = {f.__name__: f for f in W.env_tools(env)}
        try:
            msgs: list[dict[str, Any]] = t.prompt()
            out.update(kind="agent", task_id=t.task_id, prompt=t.question, requests=0, tool_calls=0, tool_errors=0)
            kw = {**kw, "tools": tools, "metadata": {"task_id": t.task_id}}
            for k in range(max_turns + 1):
                msg, h = ask(msgs, kw)
                out["requests"] += 1
                if k == 0:
                    out.update(request_id=h.get("x-request-id"), conversation_id=h.get("x-hermes-conversation"))
                    out.update(arm=h.get("x-hermes-arm"), first_call=bool(msg.get("tool_calls")))
                msgs.append(msg)
                calls = msg.get("tool_calls") or []
                if not calls or k == max_turns:
                    break
                for c in calls:  # executed here, by the agent, as its tools are
                    f, out["tool_calls"] = c.get("function") or {}, out["tool_calls"] + 1
                    errors = env.errors
                    try:
                        if f.get("name") not in by_name:
                            raise ValueError(f"Tool {f.get('name')} not found.")
                        args = json.loads(f.get("arguments") or "{}")
                        result: Any = by_name[f["name"]](**(args if isinstance(args, dict) else {}))
                        out["tool_errors"] += env.errors - errors  # an error result of Hermes's tools
                    except Exception as e:  # shown to the policy as TRL shows it
                        out["tool_errors"] += 1
                        result = {"error": str(e)}
                    msgs.append(
                        {
                            "role": "tool",
                            "tool_call_id": c.get("id"),
                            "name": f.get("name") or "",
                            "content": str(result),
                        }
                    )
            answer = H.final_answer(msgs)
            out.update(turns=out["requests"], response=answer, reward=env._hermes_score(answer))
            if feedback:
                fb = {"conversation_id": out["conversation_id"], "reward": out["reward"], "source": "system"}
                out["feedback_status"] = http.post("/v1/feedback", json=fb).status_code
        finally:
            env._close()  # the workspace goes, whatever happened

    loops: queue.Queue[Any] = queue.Queue()  # the Hermes runner's sandboxed processes, one per episode in flight
    slots = threading.BoundedSemaphore(hermes_in_flight or max(1, concurrency))
    made: list[Any] = []
    own_root = runner == "hermes" and workspace_root is None  # a temporary folder of ours: removed at the end
    root_dir = Path(tempfile.mkdtemp(prefix="hermes-lab-agent-")) if own_root else Path(workspace_root or ".")

    def hermes_loop() -> Any:
        """A Hermes runner's process from the pool, or a new one (its own folder under ``root_dir``)."""
        from hermes_lab.agents import hermes_loop as HL

        try:
            return loops.get_nowait()
        except queue.Empty:
            hermes = HL.install_hermes()  # HermesMissing (a HermesRunError) when it cannot be made here
            where = Path(tempfile.mkdtemp(prefix="loop-", dir=root_dir))
            loop = HL.HermesLoop(
                root + "/v1",
                model,
                workspace_root=where,
                hermes_bin=hermes,
                max_turns=max_turns + 1,
                feedback=feedback,
                api_key=key,
            ).start()
            made.append(loop)
            return loop

    def hermes_episode(i: int, kw: dict[str, Any], out: dict[str, Any]) -> None:
        t = agent_tasks[i]
        out.update(kind="agent", task_id=t.task_id, prompt=t.question, runner="hermes")
        with slots:
            loop = hermes_loop()
            try:
                r = loop.run([t])[0]
            finally:
                loops.put(loop)
        calls = [m for m in r.messages if m.get("role") == "assistant"]
        out.update(conversation_id=r.session_id, requests=len(calls), turns=len(calls), response=r.answer)
        out.update(tool_calls=len(r.tool_calls), first_call=bool(calls and calls[0].get("tool_calls")), reward=r.reward)
        if r.exit_code != 0:
            out["error"] = f"hermes run {r.exit_code}: {r.stderr_tail[-300:]}"
        if feedback:
            out["feedback_status"] = r.feedback_status

    def one(i: int) -> None:
        out: dict[str, Any] = {}
        if stop is not None and stop.is_set():
            out["skipped"] = True
        else:
            kw: dict[str, Any] = {}
            if users:
                kw["user"] = f"user-{seed}-{i % users:05d}"
            if max_tokens:
                kw["max_tokens"] = max_tokens
            if temperature is not None:
                kw["temperature"] = temperature
            try:
                agent = hermes_episode if runner == "hermes" else episode
                (agent if plays_agent(seed, i, agent_share) else string_task)(i, kw, out)
            except (openai.OpenAIError, httpx.HTTPError, RuntimeError) as e:  # RuntimeError: the Hermes runner's
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
        for loop in made:
            loop.close()
        if own_root:
            shutil.rmtree(root_dir, ignore_errors=True)
    return {**summarize(results), "hermes_processes": len(made)}


def _rates(rs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    arms: dict[str, list[float]] = {}
    for r in rs:
        if "reward" in r:
            arms.setdefault(r.get("arm") or "?", []).append(r["reward"])
    return {
        a: {
            "n": len(v),
            "mean_reward": round(sum(v) / len(v), 4),
            "pass_rate": round(sum(x >= 3 for x in v) / len(v), 4),
        }
        for a, v in sorted(arms.items())
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts over every conversation; ``per_arm``: all of them, ``agent``: the episodes (success = reward >= 3)."""
    eps = [r for r in results if r.get("kind") == "agent" and "reward" in r]
    return {
        "requests": len(results),
        "answered": sum("reward" in r for r in results),
        "errors": sum("error" in r for r in results),
        "skipped": sum(bool(r.get("skipped")) for r in results),
        "http_requests": sum(r.get("requests", 0) for r in results),
        "feedback_accepted": sum(r.get("feedback_status") == 202 for r in results),
        "per_arm": _rates(results),
        "agent": {
            "episodes": len(eps),
            "success": round(sum(r["reward"] >= 3 for r in eps) / len(eps), 4) if eps else None,
            "first_call_rate": round(sum(bool(r.get("first_call")) for r in eps) / len(eps), 4) if eps else None,
            "per_arm": _rates(eps),
        },
        "first_errors": Counter(r["error"][:160] for r in results if "error" in r).most_common(3),
        "results": results,
    }


# ------------------------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8700", help="the gateway (its root or .../v1)")
    p.add_argument("--requests", type=int, default=100, help="how many conversations to run")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight at once")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--users", type=int, default=0, help="spread requests over this many user ids (ab.unit: user)")
    p.add_argument("--stream-every", type=int, default=0, help="stream every k-th request (0: none)")
    p.add_argument("--no-feedback", action="store_true", help="do not post the scores")
    p.add_argument("--key-env", default="", metavar="VAR", help="env var with the gateway key (serve.api_key_env)")
    p.add_argument("--params", default=None, help="config YAML (serve.agent_share; default: built-in defaults)")
    p.add_argument(
        "--agent-share", type=float, default=None, help="share of agent episodes (default serve.agent_share)"
    )
    p.add_argument("--split", default="train", choices=("train", "heldout"), help="which tasks to draw")
    p.add_argument(
        "--runner",
        default="builtin",
        choices=("builtin", "hermes"),
        help="who plays the agent episodes: this client's loop, or the real Hermes Agent's own (sandboxed)",
    )
    p.add_argument(
        "--hermes-in-flight",
        type=int,
        default=0,
        metavar="N",
        help="--runner hermes: at most N Hermes processes at once, the string tasks keeping --concurrency "
        "(0: --concurrency)",
    )


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.config.schema import load_config

    key = os.environ.get(args.key_env, "") if args.key_env else None
    if args.key_env and not key:
        print(f"hermes-lab agent: {args.key_env} is not set", file=sys.stderr)
        return 2
    over = {"serve.agent_share": args.agent_share} if args.agent_share is not None else None
    cfg = load_config(args.params, over)  # a share outside 0..1 is refused here, naming the key
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
            split=args.split,
            agent_share=cfg.serve.agent_share,
            max_turns=cfg.grpo.max_turns,
            runner=args.runner,
            hermes_in_flight=args.hermes_in_flight,
        )
    except Exception as e:  # the gateway is down or refuses: one line, not a traceback
        print(f"hermes-lab agent: cannot reach the gateway at {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        f"agent: {s['answered']}/{s['requests']} answered, {s['errors']} errors, "
        f"{s['feedback_accepted']} feedback accepted ({s['http_requests']} requests)"
    )
    for arm, v in s["per_arm"].items():
        print(f"  {arm:9s} n={v['n']:5d}  mean reward {v['mean_reward']:.3f}  pass rate {v['pass_rate']:.1%}")
    ag = s["agent"]
    if ag["episodes"]:
        calls = ag["first_call_rate"]
        print(f"  agent episodes: {ag['episodes']}, success {ag['success']:.1%}, first answer a tool call {calls:.1%}")
        for arm, v in ag["per_arm"].items():
            print(f"    {arm:9s} n={v['n']:5d}  success {v['pass_rate']:.1%}")
    for err, k in s["first_errors"]:
        print(f"  error x{k}: {err}", file=sys.stderr)
    return 0 if s["errors"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.agents.standin", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
