"""The live flywheel (`hermes-lab flywheel --live`, hermes_lab.round.supervisor) as an operator meets it: one
supervisor process with its gateway, traffic from clients that post feedback, a round that starts itself on
volume, its candidate swapped into the same gateway, and kill -9 twice: once while the round trains, once
during the candidate's rollout. Each time the same command continues where it was, and no answered request
is missing from the logs. The status page is opened in Chromium while the experiment runs.

It is also the test of a round on live traffic (execute.source: live, ab.mode: live; the hand-run path's pieces
too: `hermes-lab status` while the round awaits its live A/B, `hermes-lab serve --log-dir` on the round's
experiment serving its prepared arms): its data is the gateway's log joined with feedback, its A/B report the
gateway's decided rollout, and the champion moves only when the rollout reached 100%.

Real components throughout: the supervisor and its worker as subprocesses, uvicorn on 127.0.0.1, the tiny
policy and the round's own adapter as arms, papermill, TRL, a SQLite MLflow store.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.state import FlywheelState, state_path
from hermes_lab.live import serve
from hermes_lab.logs import gateway
from hermes_lab.round import runner

from fake_openai import free_port
from repo_paths import REPO
from test_live_rollout import Traffic
from test_round import HERMES, small_params

pytestmark = pytest.mark.slow


class Supervisor:
    def __init__(self, tmp: Path, params: Path, port: int):
        self.tmp, self.params, self.port, self.starts = tmp, params, port, 0
        self.proc: subprocess.Popen | None = None
        # one client for the status polls: a new one (httpx.get) builds an SSL context, ~50 ms of CPU, twice a second
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False)

    def start(self) -> Supervisor:
        self.starts += 1
        out = open(self.tmp / f"supervisor-{self.starts}.out", "w")  # noqa: SIM115 (the child holds it)
        cmd = [*HERMES, "flywheel", "--live", "--params", str(self.params), "--port", str(self.port)]
        cmd += ["--rounds", "1", "--time-scale", "60"]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        return self

    def output(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("supervisor-*.out")))

    def status(self) -> dict:
        try:
            return self.http.get("/v1/flywheel").json()
        except (httpx.HTTPError, ValueError):
            return {}

    def wait(self, cond, what: str, timeout: float = 600) -> dict:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the supervisor exited {self.proc.returncode} waiting for {what}:\n" + self.output()[-4000:]
                )
            s = self.status()
            if s and cond(s):
                return s
            time.sleep(0.5)
        raise AssertionError(
            f"timed out waiting for {what}; status {json.dumps(self.status())[:1500]}\n" + self.output()[-4000:]
        )

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_live_flywheel_survives_kill_9_in_training_and_in_rollout(tmp_path, capsys):
    params = small_params(
        tmp_path,
        data={"min_samples": 100, "cooldown_hours": 0, "review_fraction": 0.5},
        ab={"stages": [[0.5, 600], [1.0, 0]], "look_every": 150, "min_per_arm": 10},
        # the turn phase (the conversations' logged turns, 80-token completions) once, not embedded.yaml's 8 steps
        # (55 of the train stage's 85 s): that it trains on the logged tokens is what is asserted, not its gain
        grpo={"turn_steps": 1},
    )
    runs = tmp_path / "runs"
    sup = Supervisor(tmp_path, params, free_port()).start()
    url = f"http://127.0.0.1:{sup.port}"
    first = sup.wait(lambda s: s.get("phase") == "collecting", "the gateway", timeout=180)
    # ~20 requests/s while the data gate and the rollout's looks wait for them; ~2/s while a round trains up to the
    # first kill, ~1/s after it (the gateway's answers are the tiny policy's CPU time, which the round's stages
    # need): traffic all along, so both kills meet requests in flight
    busy, trickle, idle = 0.1, 1.0, 3.0
    traffic = Traffic(url, threads=2, prefix="fw", pause=busy, agents=1)  # mixed: string tasks and agent episodes
    # until the data gate opens, more clients at once: the gateway batches concurrent requests into one generate,
    # so the 100 conversations come in a third of the time for about the same CPU
    burst = Traffic(url, threads=4, prefix="fwb", pause=busy)
    try:
        # 1. the round starts itself on volume; kill -9 while it trains
        sup.wait(lambda s: s.get("phase") == "training", "round 1 due", timeout=400)
        burst.stop()
        traffic.pause = trickle

        def training(s: dict) -> bool:
            prog = FlywheelState.load(state_path(runs)).progress or {}
            return s.get("phase") == "training" and "review" in prog.get("completed", [])

        s = sup.wait(training, "round 1 training", timeout=400)
        worker = s["round"]["pid"]
        assert s["pid"] == first["pid"] and s["round"]["number"] == 1
        sup.kill9()
        for _ in range(40):  # the worker (and its kernels) die with the supervisor: no orphaned training
            if not alive(worker):
                break
            time.sleep(0.25)
        assert not alive(worker), "the round's worker outlived the killed supervisor"
        done_before = FlywheelState.load(state_path(runs)).progress["completed"]
        assert done_before[:3] == ["execute", "prep", "review"]

        # 2. the same command: the round continues from its last completed stage, then its candidate is
        # swapped into the gateway and its rollout runs; kill -9 during the rollout
        sup.start()
        traffic.pause = idle  # no kill until the rollout
        s = sup.wait(
            lambda s: s.get("phase") == "experiment" and (s.get("experiment") or {}).get("name") == "round-01",
            "the swap to round 1's experiment",
        )
        traffic.pause = busy  # the rollout's looks
        assert "resuming" in sup.output()
        from test_status_page import chromium_page  # the browser helpers (skips without Chromium)

        page = httpx.get(url + "/", timeout=30, trust_env=False)
        assert page.status_code == 200 and "round-01" in page.text and "Waiting for" in page.text
        try:  # the page as a person sees it (tests/artifacts/live_flywheel.png); without Chromium the kill test goes on
            text, shot = chromium_page(url + "/", "live_flywheel")
            assert "round-01" in text and "Waiting for" in text and shot.is_file()
        except pytest.skip.Exception:
            pass
        exp_dir, rd = runs / "live" / "round-01", runs / "round-01"
        exp = json.loads((exp_dir / "experiment.json").read_text())  # as the round's A/B stage prepared it
        assert exp["arms"]["baseline"]["base"] == "embedded:tiny" and exp["arm_specs"]["candidate"]["spec"] == str(
            rd / "train"
        )
        sup.wait(lambda s: json.loads((exp_dir / "experiment.json").read_text())["looks"], "a look")
        waiting = " ".join(runner.status(str(params))["reasons"])  # what `hermes-lab status` prints
        assert "round 1 is awaiting its live A/B" in waiting and "ab: live" in waiting, waiting
        assert json.loads((exp_dir / "experiment.json").read_text())["status"] == "running"  # killed mid-rollout
        sup.kill9()
        sup.start()
        sup.wait(lambda s: s.get("pid") is not None, "the restart")
        t0 = time.time()
        stopped_at = None
        while sup.proc.poll() is None and time.time() - t0 < 600:  # --rounds 1: it stops once round 1 ended
            phase = sup.status().get("phase")
            if phase == "deciding":  # decided: the round's last stages run
                traffic.pause = idle
            if phase == "stopped" and stopped_at is None:  # the clients stop first, then the gateway closes
                traffic.stop()
                stopped_at = time.time()
            time.sleep(0.5)
        assert sup.proc.returncode == 0, sup.output()[-4000:]
        assert stopped_at is not None and time.time() - stopped_at < 30  # closed once its traffic paused
    finally:
        burst.stop()
        traffic.stop()
        sup.http.close()
        if sup.proc.poll() is None:
            sup.proc.terminate()
            sup.proc.wait(60)
    out = sup.output()
    summary = json.loads((runs / "round-01" / "summary.json").read_text())
    assert summary["status"].startswith(("promoted", "rolled back", "candidate held")), summary["status"]
    exp = json.loads((runs / "live" / "round-01" / "experiment.json").read_text())
    assert exp["restarts"] >= 1 and exp["status"] != "running" and exp["report"]
    assert "candidate swapped in without a restart" in out and "round 01:" in out
    # no answered request is missing: every 200 the clients got is in one of the experiments' logs
    logged = set()
    for p in runs.glob("live/*/requests.jsonl"):
        logged |= {json.loads(x)["request_id"] for x in p.read_text().splitlines() if x.strip()}
    sent = traffic.sent + burst.sent
    answered = [rid for rid, _, status, _ in sent if status == 200]
    assert len(answered) > 200
    missing = [rid for rid in answered if rid not in logged]
    assert not missing, f"{len(missing)} of {len(answered)} answered requests are in no log: {missing[:5]}"
    assert not [x for x in sent if x[2] not in (200,)], "a request the gateway took was refused"
    # round 1 trained on the traffic of collect-01: every trajectory is one of its requests, joined with feedback
    collect = runs / "live" / "collect-01"
    collected = {json.loads(x)["request_id"] for x in (collect / "requests.jsonl").read_text().splitlines()}
    traj = [json.loads(x) for x in (rd / "trajectories.jsonl").read_text().splitlines()]
    assert len(traj) >= 100 and {t["request_id"] for t in traj} <= collected
    assert all(t["gateway_log"].startswith(str(collect)) for t in traj)
    assert json.loads((rd / "prep" / "summary.json").read_text())["counts"]["new_samples"] >= 100
    cfg = load_config(runs / "live" / "flywheel" / "round-01.yaml")
    assert cfg.execute.source == "live" and gateway.source_dir(cfg, rd) == collect
    # the round took the gateway's decision: its A/B report is the live one, the champion moved iff promoted
    report = json.loads((rd / "ab" / "ab_report.json").read_text())
    assert report["mode"] == "live" and report["decision"] == exp["decision"]["decision"]
    assert summary["decision"] == report["decision"] and summary["ab"]["delta"] == report["delta"]
    state = FlywheelState.load(state_path(runs))
    assert state.last_round == 1 and state.progress is None
    assert (state.champion_adapter == str(rd / "train" / "adapter")) == (report["promoted"] is True)
    assert (rd / "ab" / "live_trajectories.jsonl").stat().st_size > 0  # the traffic: the next round's fuel
    # the agent episodes of collect-01 were conversations of the round: prep's, trained turn by turn on the tokens
    # the in-process arm logged (and their questions started the episode phase), decided live per conversation
    convs = [json.loads(x) for x in (rd / "agent_episodes.jsonl").read_text().splitlines()]
    assert convs and all(c["tools"] and c["meta"]["gateway_log"].startswith(str(collect)) for c in convs)
    assert all(t.get("tokens") for c in convs for t in c["meta"]["turns"] if t["status"] == "ok")
    turns = json.loads((rd / "train" / "run.json").read_text())["turns"]  # the turn phase, after the string tasks'
    assert turns["steps"] > 0 and turns["turn_rows_logged"] >= turns["turn_rows"] / 2 > 0  # long ones: cut, rendered
    assert (rd / "train" / "turns" / "adapter" / "adapter_config.json").is_file()
    row = json.loads((runs / "live" / "flywheel" / "status.json").read_text())["rounds"][0]
    assert sum(v["n"] for v in row["agent"]["live"].values()) > 0 and row["agent"]["heldout_after"] is not None
    assert "agent family: live success" in out
    # hermes-lab status reads the flywheel's last status
    st = runner.status(str(params))
    assert st["live"]["alive"] is False and st["live"]["rounds"][0]["round"] == 1
    runner.run_cli_status(argparse.Namespace(params=str(params)))  # what `hermes-lab status` prints
    shown = capsys.readouterr().out
    assert "live flywheel" in shown and "not running" in shown, shown
    # by hand, `hermes-lab serve --log-dir` on a round's experiment serves the arms it was prepared with
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--params", str(runs / "live" / "flywheel" / "params.yaml"), "--log-dir", str(exp_dir)])
    gw = serve.make_gateway(args)
    if gw.worker is not None:
        gw.worker.close()
    assert gw.specs["candidate"].adapter == str(rd / "train" / "adapter") and gw.specs["baseline"].adapter is None
    assert gw.state["restarts"] == exp["restarts"] + 1 and gw.state["status"] == exp["status"]  # continued, as is
