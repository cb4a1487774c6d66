"""``make live-demo``: the live flywheel on the embedded default, on a fast clock: two rounds start themselves.

Reads ``params/embedded.yaml``; writes its own runs folder, ``runs/live-demo/`` (emptied at the start, so the
demo runs the same whatever ran before it: rounds, flywheels, an earlier demo), with everything a live
flywheel writes there (``live/flywheel/``, ``live/collect-01``, ``live/round-NN``, ``round-NN/``, MLflow).

    make live-demo                      # = python -m hermes_lab.round.live_demo (--runner hermes)
    make live-demo RUNNER=builtin       # the stand-in's client-side loop plays the agent episodes instead
    python -m hermes_lab.round.live_demo --time-scale 360 --rounds 2

What happens, a line at each transition (the supervisor's ``[live ...]`` lines, the gateway's looks):
1. ``hermes-lab flywheel --live`` starts: one gateway on one address, serving the base policy in-process;
2. a traffic source (``hermes_lab.agents.standin``) sends mixed traffic: string tasks (the openai SDK; the verifier's
   score posted as feedback) and, at ``serve.agent_share``, tasks of the ``hermes`` family played by the real Hermes
   Agent (``--runner hermes``: its own loop and tools, sandboxed, a workspace per task, the verifier's verdict on
   that workspace posted by conversation id; ``--runner builtin``: the stand-in's client-side loop); once
   ``data.min_samples`` conversations have feedback and the cooldown has passed, round 1 starts by itself in a
   worker process (prep on that traffic: the string tasks and the conversations; review; train on the string tasks,
   then every turn of the conversations on the tokens the policy saw, then episodes in the family's environment;
   validate, where the real Hermes Agent plays the same held-out tasks against each arm: agent.runner) while the
   gateway keeps answering (the traffic slows down to leave the training its core);
3. its candidate is swapped into the same gateway and the staged rollout decides it on the clock, counting
   conversations; the round takes the decision (promotion: the candidate is the next experiment's baseline); its
   line gives the agent family's live success per arm beside its held-out success;
4. round 2 starts the same way on the experiment's traffic, is swapped in and decided.
Then the traffic stops, and the supervisor closes its gateway once it has paused (so no request of the agent is
refused at the end). At the end it checks what the demo is for: the gateway's pid and address never changed, no
request failed, every round trained on conversations, and the champion's agent success rose round after round: on
validate's held-out tasks played by the real Hermes Agent (the same seeded tasks for every champion) when it played
them, else the live success per conversation.
The clock: x360 (``--time-scale``): the 50% stage of 3 h takes 30 s (up to 120 s extended), the 1 h cooldown 10 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from hermes_lab.core.layout import RunsLayout
from hermes_lab.round.live_rounds import describe_agent, read_json_or_empty

DEMO_KEYS: dict[str, dict[str, Any]] = {
    "round": {"runs_dir": "runs/live-demo"},  # the demo's own runs/: nothing else is touched
    "data": {"min_samples": 300, "cooldown_hours": 1},  # 300 conversations; the cooldown shown, not waited out
    # one tested stage at 50% (3 h = 30 s at x360, extended up to 9 h more: ab.max_extension 3), then 100%: the A/B
    # counts conversations, ~400 in a planned stage at the ~13 a wall second the agent gets answered (0.035 an
    # experiment second: request_rate, where the confidence sequence is tightest). A first round is ~+1 on the 5
    # scale and decided at 3 h; a second one ~+0.35-0.7, and at +0.35 still undecided at 6 h ([-0.05, +0.77])
    "ab": {"request_rate": 0.035, "stages": [[0.5, 10800], [1.0, 0]], "max_extension": 3.0},
    # the demo's training: the string tasks as a round trains them, the turn phase shorter (8 turn steps took 31 s of a
    # 181 s train stage). 20 episode steps, not 10: with policy v14, 10 left the hermes family to chance and the
    # regression gate stopped round 1 (55.7% -> 52.6% held out, the drop's bound 8.1% against the 5% tolerance)
    "grpo": {"turn_steps": 4, "episode_steps": 20},
    # the final norm at the LoRA's own rate: at the round's 0.08 the first round takes the tiny policy to its greedy
    # ceiling (+44.6 points) and the second has nothing left but to regress (add -6.8: the regression gate stops it),
    # so a demo of two compounding rounds would show only one
    "lora": {"modules_to_save_learning_rate": None},
    # the held-out sets at 48 tasks a family (a round's regression gate, the train stage's before/after pass rate
    # and as many agent episodes): the 200 of a round's headline gain took 50 s of a train stage
    "validate": {"eval_tasks_per_family": 48, "gain_tasks_per_family": 48},
}


def say(msg: str) -> None:
    print(f"=== live-demo: {msg}", flush=True)


def demo_params(base: str, out: Path) -> Path:
    cfg = yaml.safe_load(Path(base).read_text(encoding="utf-8")) or {}
    for sec, kv in DEMO_KEYS.items():
        cfg.setdefault(sec, {}).update(kv)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# written by hermes_lab.round.live_demo: {base} + {json.dumps(DEMO_KEYS)}\n" + yaml.safe_dump(cfg))
    return out


def get(url: str) -> dict[str, Any] | None:
    import httpx

    try:
        return httpx.get(url, timeout=10, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return None


HERMES_IN_FLIGHT = 4  # the real Hermes runner: sandboxed Hermes processes at once (each ~150 MB, its own requests)


def run(
    base_params: str,
    time_scale: float,
    rounds: int,
    port: int,
    agent_share: float | None = None,
    runner: str = "hermes",
) -> int:
    from hermes_lab.agents.standin import run_agent
    from hermes_lab.config.schema import load_config
    from hermes_lab.core import paths

    if runner == "hermes":  # installed and sandboxed before any traffic, not 70 failed conversations a batch
        from hermes_lab.agents.hermes_chat import HermesRunError
        from hermes_lab.agents.play import ready

        try:
            ready(say)
        except HermesRunError as e:
            raise SystemExit(f"live-demo: --runner hermes, but the real Hermes Agent cannot run here: {e}") from None
    runs = paths.resolve(DEMO_KEYS["round"]["runs_dir"])
    if runs.exists():
        shutil.rmtree(runs)
    params = demo_params(base_params, runs.parent / "live-demo.yaml")
    cfg = load_config(params)
    share = cfg.serve.agent_share if agent_share is None else agent_share
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    say(f"{params} = {base_params} + {json.dumps(DEMO_KEYS)}; clock x{time_scale:g}; gateway {url}")
    who = "the real Hermes Agent's own loop" if runner == "hermes" else "client-side calls"
    say(f"traffic: string tasks and agent episodes ({who}), {share:.0%} agent (serve.agent_share)")
    cmd = [sys.executable, "-m", "hermes_lab.round.supervisor", "--live", "--params", str(params)]
    cmd += ["--time-scale", str(time_scale), "--port", str(port), "--rounds", str(rounds)]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: [print(line, end="", flush=True) for line in sup.stdout], daemon=True).start()
    pid, answered, failed, sent, batch = None, 0, 0, 0, 0
    # once the rounds are done no conversation starts (run_agent skips the rest of its batch): the supervisor closes
    # the gateway after 2 s without a request, and the real Hermes runner's batch of 240 outlived that by a minute
    done = threading.Event()

    def finished(fw: dict[str, Any]) -> bool:
        return fw.get("phase") == "stopped" or len(fw.get("rounds") or []) >= rounds

    def watch() -> None:
        while not done.is_set():
            if finished(get(url + "/v1/flywheel") or {}):
                done.set()
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()
    try:
        while sup.poll() is None:
            h = get(url + "/healthz")
            if h is None:
                if pid is not None:
                    # closed while the agent paused between batches: fine once its rounds were done
                    st = read_json_or_empty(RunsLayout(runs).flywheel.status)
                    if finished(st):
                        break
                    raise SystemExit(f"live-demo: the gateway at {url} stopped answering while the demo sent traffic")
                time.sleep(0.5)
                continue
            if pid is None:
                pid = h["pid"]
            elif h["pid"] != pid:
                raise SystemExit(f"live-demo: the gateway's pid changed ({pid} -> {h['pid']})")
            fw = get(url + "/v1/flywheel") or {}
            if done.is_set() or finished(fw):
                break  # the traffic stops first; the supervisor closes its gateway once it has paused
            busy = fw.get("phase") in ("training", "deciding")  # leave the worker its core
            batch += 1
            n, conc = (4, 1) if busy else (240, 32)  # a trickle while a round trains; else two arms batch
            s = run_agent(
                url,
                n,
                conc,
                seed=10_000 + batch,
                progress=False,
                agent_share=share,
                max_turns=cfg.grpo.max_turns,
                runner=runner,
                stop=done,
                hermes_in_flight=min(conc, HERMES_IN_FLIGHT),
            )
            answered, failed, sent = answered + s["answered"], failed + s["errors"], sent + s["http_requests"]
            if s["errors"]:
                say(f"{s['errors']} failed conversations: {s['first_errors']}")
            if busy:
                time.sleep(3.0)
        say("traffic stopped; waiting for the supervisor to close its gateway")
        rc = sup.wait(120)
    finally:
        done.set()
        if sup.poll() is None:
            sup.terminate()
            sup.wait(60)
    status = json.loads(RunsLayout(runs).flywheel.status.read_text(encoding="utf-8"))
    done = status.get("rounds") or []
    say(f"{len(done)} rounds in {time.time() - t0:.0f} s, one gateway: pid {pid}, {url} throughout")
    turned = 0
    for r in done:
        gain = "" if r.get("gain") is None else f", held-out {r['gain'] * 100:+.1f} points"
        say(f"  round {r['round']:02d}: {r['status']}{gain} (experiment {r.get('experiment')})")
        line, logged = trained_on(runs, r["round"])
        turned += logged > 0
        say(f"    {line}")
        if r.get("agent"):
            say(f"    agent family: {describe_agent(r['agent'])}")
    series = champion_series(runs, done, cfg.reward.success_threshold)
    rise = rising(series, len(done))
    if series:
        line = " -> ".join(f"{v:.1%} ({who}, {n} conversations)" for who, v, n in series)
        say(f"  the champion's live agent success per conversation: {line}{'' if rise else ' (not rising)'}")
    played = champion_played(done)
    if played:  # the real Hermes Agent's own task success, the same held-out tasks for every champion, seeded
        line = " -> ".join(f"{v:.1%} ({who})" for who, v, _n in played)
        up = rising(played, len(done))
        tail = "" if up else " (not rising)"
        say(f"  the champion's real-Hermes success on {played[0][2]} held-out tasks: {line}{tail}")
        # what the demo checks: ~75-250 live conversations a policy are +-6-11 points, as much as a round moves
        # the family; validate's paired, seeded tasks measure each champion on the same draws
        rise = up
    say(
        f"  the agent: {answered} conversations answered ({sent} requests), {failed} failed; "
        f"swaps in the gateway: {len(status['swaps'])}"
    )
    # what the demo is for: every round trained on the gateway's conversations and was decided live (promoted or
    # rolled back, not held at a hard end), nothing failed, and on mixed traffic the champion's agent got better
    decided = [r for r in done if r.get("status") in ("promoted", "rolled back")]
    problems = [f"supervisor exit {rc}"] if rc else []
    problems += [f"{len(done)} of {rounds} rounds done"] if len(done) < rounds else []
    problems += [f"{len(done) - len(decided)} rounds not decided live"] if len(decided) < len(done) else []
    problems += [f"{failed} failed conversations"] if failed else []
    problems += [f"{len(status['swaps'])} swaps for {rounds} rounds"] if len(status["swaps"]) < rounds else []
    if share:
        problems += [f"{len(done) - turned} rounds trained on no conversation"] if turned < len(done) else []
        what = "real-Hermes held-out" if played else "live agent"
        problems += [f"the champion's {what} success did not rise round after round"] if not rise else []
    if problems:
        say("FAILED: " + "; ".join(problems))
    ok = not problems
    return 0 if ok else 1


def trained_on(runs: Path, n: int) -> tuple[str, int]:
    """What a round trained on from the gateway's log (execute's files, train's run.json): a line, and how many turn
    rows it trained on the tokens the in-process arm logged."""
    rd = RunsLayout(runs).round(n)

    def lines(p: Path) -> int:
        return p.read_bytes().count(b"\n") if p.is_file() else 0

    traj, convs = lines(rd.trajectories), lines(rd.agent_episodes)
    try:
        run = json.loads(rd.train.run.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        run = {}
    turns = run.get("turns") or {}
    rows, logged = turns.get("turn_rows", 0), turns.get("turn_rows_logged", 0)
    line = (
        f"trained on the gateway's log: {traj} string-task requests and {convs} conversations (agent episodes): "
        f"{rows} turns ({logged} on the tokens the policy saw) in {turns.get('steps', 0)} steps of the turn phase"
    )
    return line, logged


def rising(series: list[tuple[str, float, int]], rounds: int) -> bool:
    """A champion's figure for the base and after each of ``rounds`` decided rounds, each above the one before."""
    return len(series) > rounds and all(b[1] > a[1] for a, b in itertools.pairwise(series))


def champion_played(done: list[dict[str, Any]]) -> list[tuple[str, float, int]]:
    """The champion's success on validate's held-out tasks played by the real Hermes Agent (agent.runner hermes):
    the base (round 1's baseline arm), then the champion after each decided round (its candidate when promoted, else
    the champion it kept). Every policy plays the same tasks with random numbers drawn from each request's prompt,
    so a champion measured again as the next round's baseline scores what it scored as a candidate. Rows: (who,
    success, tasks); empty when a round's validate was played by the built-in loop."""
    rows: list[tuple[str, float, int]] = []
    champ = "the base"
    for r in done:
        p = (r.get("agent") or {}).get("played")
        if not p:
            return []
        if not rows:
            rows.append((champ, p["before"]["pass_rate"], p["before"]["tasks"]))
        if str(r.get("status", "")).startswith("promoted"):
            champ = f"round {r['round']:02d}"
            rows.append((champ, p["after"]["pass_rate"], p["after"]["tasks"]))
        else:
            rows.append((champ, p["before"]["pass_rate"], p["before"]["tasks"]))
    return rows


def champion_series(runs: Path, done: list[dict[str, Any]], threshold: float) -> list[tuple[str, float, int]]:
    """The champion's live agent success per conversation: the base, then the champion after each decided round
    (its candidate when promoted, else the champion it kept), each policy over every agent conversation it answered
    live: the base on the first traffic (collect-01) and as a baseline; a round's candidate in its own experiment
    and, once promoted, as the next experiment's baseline. One experiment's arm is ~50-140 conversations (+-5-7
    points); pooled, a policy's figure is not one experiment's luck. Rows: (who, success, conversations)."""
    from hermes_lab.live.log import agent_success

    tally: dict[str, list[int]] = {}

    def add(who: str, arm: dict[str, Any] | None) -> None:
        if arm and arm.get("n"):
            t = tally.setdefault(who, [0, 0])
            t[0] += round(arm["success"] * arm["n"])
            t[1] += arm["n"]

    champ = "the base"
    add(champ, agent_success(RunsLayout(runs).collect(1).root, threshold)["baseline"])
    order = [champ]
    for r in done:
        live = (r.get("agent") or {}).get("live") or {}
        add(champ, live.get("baseline"))
        add(f"round {r['round']:02d}", live.get("candidate"))
        if str(r.get("status", "")).startswith("promoted"):
            champ = f"round {r['round']:02d}"
        order.append(champ)
    return [(who, tally[who][0] / tally[who][1], tally[who][1]) for who in order if who in tally]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params/embedded.yaml", help="base config (the demo keys are added to it)")
    p.add_argument("--time-scale", type=float, default=360.0, help="clock speed (stages, looks, cooldown)")
    p.add_argument("--rounds", type=int, default=2, help="self-triggered rounds to run")
    p.add_argument("--port", type=int, default=8700, help="the gateway's port")
    p.add_argument(
        "--agent-share", type=float, default=None, help="share of agent episodes in the traffic (serve.agent_share)"
    )
    p.add_argument(
        "--runner",
        default="hermes",
        choices=("builtin", "hermes"),
        help="who plays the agent episodes: the stand-in's client loop, or the real Hermes Agent's own (sandboxed)",
    )


def run_cli(args: argparse.Namespace) -> int:
    return run(args.params, args.time_scale, args.rounds, args.port, args.agent_share, args.runner)


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.round.live_demo", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
