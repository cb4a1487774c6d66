"""Stage 00, execute: the policy works on tasks and its execution logs become trajectories.

Reads a policy (base model, optionally the champion adapter); writes ``runs/round-NN/trajectories.jsonl``
in the user's format, one record a line::

    {"prompt": ..., "response": ..., "reward": 4.2, "task_id": "t-001",
     "family": ..., "request_id": ..., "timestamp": ..., "policy": ...}

The reward is system feedback from the task verifiers (0..5). A code-family record also carries its task's
hidden tests (``"tests": {"kind": "assert", ...}``, ``hermes_lab.sandbox.specs``), as a user's code task
would: prep keeps them with the prompt and the tests reward runs them on every GRPO sample. On a real
deployment these logs come from
production: with ``execute.source: live`` the round's trajectories are the gateway's log of the previous
round's live A/B, joined with the agent's feedback (``hermes_lab.live.round``), and its multi-turn and
tool-calling conversations go to ``agent_episodes.jsonl`` (prep's conversations); on the embedded default
this stage is where every round's data comes from (later rounds also feed the A/B traffic logs of the
previous round into prep). The agent family's episodes (``execute.agent_tasks``) are played by the built-in loop, or
with ``agent.runner: hermes`` by the real Hermes Agent against the policy served on 127.0.0.1 (``round-NN/hermes/``).

    hermes-lab execute --params params/embedded.yaml --output runs/round-01/trajectories.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hermes_lab.agents.play import plays_hermes
from hermes_lab.config.schema import HermesConfig, load_config
from hermes_lab.core.inputs import EXECUTE
from hermes_lab.core.jsonl import write_text_atomic
from hermes_lab.core.layout import PlayLayout, RoundLayout
from hermes_lab.logs.gateway import gateway_trajectories, read_jsonl
from hermes_lab.policy.arms import resolve_adapter
from hermes_lab.tasks import suite as T


def execute(
    cfg: HermesConfig,
    output: str | os.PathLike[str],
    adapter: str | None = None,
    seed: int = 0,
    now: datetime | None = None,
    policy: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the policy on ``cfg.execute.num_tasks`` fresh training-split tasks; write trajectories JSONL.
    ``execute.source: live``: the round's data is a gateway log instead (``hermes_lab.logs.gateway``)."""
    from hermes_lab.policy import formats
    from hermes_lab.policy.model import load_policy

    ex = cfg.execute
    if ex.source == "live":
        from hermes_lab.logs import gateway

        src = gateway.source_dir(cfg, Path(output).parent)
        if src is not None:
            res = gateway.execute_live(cfg, output, src)
            # the traffic's conversations (agent episodes, tool calls, several turns): prep's conversations, as
            # execute.agent_tasks' episodes are offline (round.stages.fresh_data hands the file on)
            convs, dest = Path(res["live"]["conversations_file"]), RoundLayout(Path(output).parent).agent_episodes
            if res["live"]["conversations"]:
                shutil.copyfile(convs, dest.with_suffix(".jsonl.tmp"))
                os.replace(dest.with_suffix(".jsonl.tmp"), dest)
                res.update(agent_output=str(dest), conversations=res["live"]["conversations"])
            else:
                dest.unlink(missing_ok=True)
            return res
        print("execute.source is live, but this first round has no traffic yet: it executes the embedded tasks")
    adapter = resolve_adapter(adapter, "adapter", cfg)  # a train output dir (its adapter/) or 'champion' too
    pol = policy or load_policy(
        cfg.model.base_model,
        adapter=adapter,
        runs_dir=cfg.round.runs_dir,
        seed=cfg.model.seed,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    formats.prepare(pol.tokenizer, cfg.model.tool_parser)  # the policy's reader, as every stage reads it
    tasks_ = T.generate_tasks(ex.num_tasks, split="train", seed=seed, families=ex.families or None)
    tasks_ = [t for t in tasks_ for _ in range(ex.samples_per_task)]  # neighbours: one batch samples a group
    responses = pol.generate(
        [t.prompt for t in tasks_],
        temperature=ex.temperature,
        max_new_tokens=ex.max_new_tokens,
        seed=seed,
        batch_size=ex.batch_size,
        progress=progress,
    )
    start = now or datetime.now(timezone.utc)
    rng = uuid.UUID(int=(seed * 2654435761) % (1 << 128))  # deterministic request ids per seed
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    passed = 0
    rewards = T.score_tasks(tasks_, responses, cfg.reward.scale)  # code: its tests run in the sandbox
    with open(tmp, "w", encoding="utf-8") as f:
        for i, (t, r, reward) in enumerate(zip(tasks_, responses, rewards)):
            passed += reward >= cfg.reward.success_threshold
            rec = {
                "prompt": t.prompt,
                "response": r,
                "reward": reward,
                "task_id": t.task_id,
                "family": t.family,
                "request_id": str(uuid.uuid5(rng, str(i))),
                "timestamp": (start + timedelta(seconds=i)).isoformat(),
                "policy": adapter or cfg.model.base_model,
            }
            if t.family == "code":
                rec["tests"] = T.tests_of(t)
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, out)  # a half-written file never looks like a finished execution log
    n = len(tasks_)
    res: dict[str, Any] = {"records": n, "pass_rate": round(passed / max(n, 1), 4), "output": str(out)}
    if ex.agent_tasks:
        res.update(execute_agent(cfg, pol, RoundLayout(out.parent).agent_episodes, seed, start, adapter))
    return res


def execute_agent(
    cfg: HermesConfig, pol: Any, output: Path, seed: int, start: datetime, adapter: str | None
) -> dict[str, Any]:
    """The agent family's episodes (``execute.agent_tasks`` train-split tasks, played as TRL plays them), written
    as OpenAI chat conversations (messages with tool_calls and tool results, tools, reward, the family ``hermes``):
    what prep reads into its conversations and the episode phase of train starts from."""
    from hermes_lab.policy import episodes as E
    from hermes_lab.tasks import hermes as H

    # the round's embedded agent family; with a user's own environment, the hermes family's episodes are logged
    A = E.family_of_environment(cfg.grpo.environment) or H
    tasks_ = A.generate_tasks(cfg.execute.agent_tasks, split="train", seed=seed)
    if plays_hermes(cfg):
        return execute_with_hermes(cfg, tasks_, output, seed, start, adapter)
    eps = E.run_episodes(pol, tasks_, temperature=cfg.execute.temperature, seed=seed, max_turns=cfg.grpo.max_turns)
    tmp = output.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, e in enumerate(eps):
            rec = A.conversation_record(e.task, e.messages, e.reward)
            rec.update(
                id=f"agent-{seed}-{i}", timestamp=(start + timedelta(seconds=i)).isoformat(), model=adapter or "base"
            )
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, output)
    s = E.summarize(eps)
    return {"agent_episodes": len(eps), "agent_success": s["episode_success"], "agent_output": str(output)}


def execute_with_hermes(
    cfg: HermesConfig, tasks_: list[Any], output: Path, seed: int, start: datetime, adapter: str | None
) -> dict[str, Any]:
    """``agent.runner: hermes``: the tasks played by the real Hermes Agent against the policy served on 127.0.0.1
    (``agents.play``; the server's log and each task's folders under ``round-NN/hermes/``), written as the
    conversations Hermes kept, with its tools and the verifier's reward on what it left on disk."""
    from hermes_lab.agents.play import conversation_records, play_policy

    root = RoundLayout(output.parent).hermes.root
    # each request's random numbers drawn from its prompt: a round's execution is reproducible, as the built-in
    # loop's seeded episodes are (each task is played once, so nothing is sampled twice alike)
    runs = play_policy(cfg, cfg.model.base_model, adapter, tasks_, root)
    served = served_turns(cfg, root)
    lines = []
    for i, rec in enumerate(conversation_records(runs, root)):
        rec.update(timestamp=(start + timedelta(seconds=i)).isoformat(), model=adapter or "base", seed=seed)
        if rec["id"] in served:  # the conversation as the server answered it: each turn's exact tokens in meta
            rec.update(messages=served[rec["id"]]["messages"], meta=served[rec["id"]]["meta"])
        lines.append(json.dumps(rec) + "\n")
    write_text_atomic(output, "".join(lines))  # a half-written log never looks like a finished one
    done = sum(r.success for r in runs)
    return {
        "agent_episodes": len(runs),
        "agent_success": round(done / max(1, len(runs)), 4),
        "agent_output": str(output),
        "agent_runner": "hermes",
    }


def served_turns(cfg: HermesConfig, root: Path) -> dict[str, dict[str, Any]]:
    """The server's log of the real agent's conversations joined as a live gateway's is (``logs.gateway``, written
    under ``root/join``), by conversation id: each conversation's messages as the policy was sent them and, per
    answer, the prompt and completion token ids it saw and sampled (``meta.turns[].tokens``), which turn-level
    training (``grpo.turns``) trains on token for token, as a live round does."""
    lay = PlayLayout(root)
    info = gateway_trajectories(lay.log.root, lay.join, cfg)
    return {str(r["conversation_id"]): r for _, r in read_jsonl(info["conversations_file"])}


def add_arguments(p: argparse.ArgumentParser) -> None:
    EXECUTE.add_arguments(p)  # hermes_lab.core.inputs: the notebook's parameters and these, declared once


def run_cli(args: argparse.Namespace) -> int:
    overrides = {"execute.num_tasks": args.num_tasks} if args.num_tasks else None
    cfg = load_config(args.params, overrides)
    adapter = resolve_adapter(args.adapter, "--adapter", cfg)  # a train output dir means its adapter/
    res = execute(cfg, args.output, adapter=adapter, seed=args.seed)
    print(f"wrote {res['records']} trajectories to {res['output']} (pass rate {res['pass_rate']:.1%})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.agents.execute", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
