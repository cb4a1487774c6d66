"""The live staged rollout inside `hermes-lab serve`, on a time-scaled wall clock: a real uvicorn gateway
subprocess, real OpenAI-compatible upstreams (tests/fake_openai.py), traffic and feedback over HTTP.

A "perfect" stub answers every embedded task right (verifier score 5), a "bad" one answers "no idea" (0), a
failing one answers 500. Stages are short in experiment seconds and the clock runs 10x, so a rollout takes
seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from gateway_process import Gateway, formula_arm

from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T
from hermes_lab.tasks import workspace as W

from fake_openai import FakeOpenAI

SCALE = 10  # the experiment clock runs 10x: a 60 s stage is 6 s of wall time


@pytest.fixture(scope="module")
def perfect():
    s = FakeOpenAI(models=("good",)).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bad():
    s = FakeOpenAI(models=("bad",))
    s.chat_reply = "no idea"
    s.start()
    yield s
    s.stop()


def params(tmp: Path, stages: list, look_every: float, rate: float = 2.0, **serve) -> Path:
    """ab.request_rate: about what Traffic sends per experiment second (it tunes the bets, never validity)."""
    p = tmp / "live.yaml"
    ab = {"stages": stages, "look_every": look_every, "min_per_arm": 8, "request_rate": rate, "max_extension": 1.0}
    p.write_text(yaml.safe_dump({"ab": ab, "serve": serve}))
    return p


def arms(baseline: FakeOpenAI, b_model: str, candidate: FakeOpenAI, c_model: str) -> list[str]:
    return [
        "--baseline",
        baseline.url,
        "--baseline-model",
        b_model,
        "--candidate",
        candidate.url,
        "--candidate-model",
        c_model,
    ]


class Traffic:
    """Threads posting embedded tasks and the verifier's score as feedback, until stopped. The default, 3 threads
    with a 0.1 s pause, is ~25 requests/s: about params()'s ab.request_rate at SCALE, and a gateway that is not
    kept at full CPU for the seconds a rollout lasts (its stages are wall-clock time: more traffic only adds CPU).
    ``agents`` more threads play agent-family episodes (hermes workspace tasks) as a client-side agent loop (Hermes's
    tool schemas sent, its calls executed here on the task's workspace, the results sent back, the verifier's score of
    the workspace and the answer posted by conversation id)."""

    def __init__(self, url: str, threads: int = 3, prefix: str = "r", pause: float = 0.1, agents: int = 0):
        self.url, self.prefix, self.stop_, self.pause = url, prefix, threading.Event(), pause
        self.sent: list[tuple[str, str, int, str | None]] = []  # (request id, arm header, status, fallback header)
        self.episodes: list[tuple[str, float]] = []  # (conversation id, reward) of the finished agent episodes
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]
        self.threads += [threading.Thread(target=self._agent, args=(k,), daemon=True) for k in range(agents)]
        for t in self.threads:
            t.start()

    def _post(self, h: httpx.Client, rid: str, body: dict) -> httpx.Response | None:
        try:
            r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid})
        except httpx.HTTPError:
            time.sleep(0.05)  # the gateway is restarting
            return None
        with self.lock:
            self.sent.append((rid, r.headers.get("x-hermes-arm"), r.status_code, r.headers.get("x-hermes-fallback")))
        return r

    def _run(self, k: int) -> None:
        tasks = T.generate_tasks(400, seed=k)
        with httpx.Client(base_url=self.url, trust_env=False, timeout=30) as h:
            i = 0
            while not self.stop_.is_set():
                t, rid = tasks[i % len(tasks)], f"{self.prefix}{k}-{i}"
                i += 1
                r = self._post(h, rid, {"model": "hermes", "messages": [{"role": "user", "content": t.prompt}]})
                if r is None:
                    continue
                if r.status_code == 200:
                    text = r.json()["choices"][0]["message"]["content"]
                    try:
                        h.post("/v1/feedback", json={"request_id": rid, "reward": T.verify(t.prompt, text)})
                    except httpx.HTTPError:  # the gateway went down between the answer and its feedback
                        continue
                time.sleep(self.pause)

    def _agent(self, k: int) -> None:
        tasks, tools = H.generate_tasks(400, seed=100 + k), W.tool_schema()
        env = H.WorkspaceEnv(seed=k)
        with httpx.Client(base_url=self.url, trust_env=False, timeout=30) as h:
            i = 0
            while not self.stop_.is_set():
                t = tasks[i % len(tasks)]
                env.reset(question=t.question)  # a fresh workspace with the task's files
                by_name = {f.__name__: f for f in W.env_tools(env)}
                msgs, cid = t.prompt(), None
                for turn in range(3):
                    body = {"model": "hermes", "messages": msgs, "tools": tools, "metadata": {"task_id": t.task_id}}
                    r = self._post(h, f"{self.prefix}a{k}-{i}-{turn}", body)
                    if r is None or r.status_code != 200:
                        break
                    cid = cid or r.headers.get("x-hermes-conversation")
                    msg = r.json()["choices"][0]["message"]
                    msgs.append(msg)
                    if not msg.get("tool_calls") or turn == 2:
                        break
                    for c in msg["tool_calls"]:
                        try:
                            out = by_name[c["function"]["name"]](**json.loads(c["function"]["arguments"]))
                        except Exception as e:
                            out = {"error": str(e)}
                        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": str(out)})
                i += 1
                if cid is not None and msgs[-1]["role"] == "assistant":
                    reward = env._hermes_score(H.final_answer(msgs))
                    try:
                        h.post("/v1/feedback", json={"conversation_id": cid, "reward": reward})
                    except httpx.HTTPError:
                        continue
                    with self.lock:
                        self.episodes.append((cid, reward))
                time.sleep(self.pause)
        env._close()

    def stop(self) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(30)


def wait_for(gw: Gateway, cond, timeout: float = 90) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        exp = gw.experiment()
        if cond(exp):
            return exp
        time.sleep(0.3)
    raise AssertionError(f"timed out; experiment: {json.dumps(exp)[:2000]}\n{gw.output()[-3000:]}")


def test_better_candidate_is_promoted_through_every_stage(tmp_path, perfect, bad):
    stages = [[0.3, 60], [0.6, 60], [1.0, 0]]
    args = [
        "--params",
        str(params(tmp_path, stages, 20)),
        "--time-scale",
        str(SCALE),
        *arms(bad, "bad", perfect, "good"),
    ]
    gw = Gateway(tmp_path, args).start()
    traffic = Traffic(gw.url)
    try:
        exp = wait_for(gw, lambda e: e["report"] is not None)
        assert exp["status"] == "promoted" and exp["ratio"] == 1.0, exp
        n_before = len(traffic.sent)
        time.sleep(1.0)  # 100%: every new unit goes to the candidate
        with traffic.lock:
            after = traffic.sent[n_before + 3 :]
        assert after and all(a == "candidate" for _, a, _, _ in after)
    finally:
        traffic.stop()
        gw.stop()
    state = json.loads((gw.log_dir / "experiment.json").read_text())
    assert [r["decision"] for r in state["stage_results"]] == ["widen", "widen"]
    assert state["decision"]["promoted"] and state["stage"] == 2 and len(state["stage_starts"]) == 3
    # stage 1 started at the look that widened stage 0, no earlier than its planned end (60 s); looks every 20 s
    s1 = state["stage_starts"][1]
    assert s1 >= 60 and any(lk["t"] == s1 and lk["step"] == "next" for lk in state["looks"])
    assert all(round(lk["t"] - state["stage_starts"][lk["stage"]], 3) % 20 == 0 for lk in state["looks"])
    # the requests of each stage were routed at its ratio by the md5 formula
    recs = gw.records()
    for r in recs:
        if r["stage"] < 2:
            assert r["arm"] == formula_arm(r["unit"], stages[r["stage"]][0])
    # ab_report.json: ab-run's schema and the user's fields, the live decisions, the clock said
    rep = json.loads((gw.log_dir / "ab_report.json").read_text())
    assert rep["decision"] == "promote" and rep["promoted"] and rep["final_ratio"] == 1.0
    assert rep["delta"] > 3 and rep["p_value"] < 1e-6 and rep["significant"] is True
    assert [s["sequential_decision"] for s in rep["stages"]] == ["widen", "widen"]
    # the gateway decided on ab-run's regression-adjusted rule (embedded prompts: family:level cells, tasks)
    assert rep["stages"][0]["sequential"]["adjusted"] and rep["covariates"]["cells"] > 1
    assert rep["mode"] == "live" and rep["time_scale"] == SCALE and any("--time-scale 10" in r for r in rep["reasons"])
    # single-turn traffic: every request a conversation of one turn, counted per arm in the report
    conv = rep["conversations"]
    assert conv["baseline"]["conversations"] + conv["candidate"]["conversations"] == rep["requests_logged"]
    assert conv["baseline"]["turns_per_conversation"] == conv["candidate"]["turns_per_conversation"] == 1.0
    assert conv["candidate"]["tool_call_rate"] == 0.0 and conv["candidate"]["conversations"] > 0
    assert {Path(p).name for p in rep["plots"]} == {"ab_scores.png", "ab_sequence.png", "ab_breakdown.png"}
    assert all(Path(p).stat().st_size > 1000 for p in rep["plots"])
    out = gw.output()
    assert out.count("[look") == len(state["looks"]) and "-> widen: stage 2 starts" in out and "-> promoted" in out


def test_failing_candidate_is_rolled_back_at_the_first_look_and_fallback_hides_it(tmp_path, perfect):
    """The candidate upstream answers 500. With serve.fallback: baseline the client never sees an error, and
    the candidate's errors still count: the error guardrail rolls it back at the first look."""
    failing = FakeOpenAI(models=("good",))
    failing.fail = True
    failing.start()
    stages = [[0.5, 120], [1.0, 0]]
    p = params(tmp_path, stages, 40, rate=1.0, fallback="baseline")
    gw = Gateway(tmp_path, ["--params", str(p), "--time-scale", str(SCALE), *arms(perfect, "good", failing, "good")])
    gw.start()
    traffic = Traffic(gw.url)
    try:
        exp = wait_for(gw, lambda e: e["report"] is not None, timeout=60)
        assert exp["status"] == "rolled back" and exp["ratio"] == 0.0
        n_before = len(traffic.sent)
        time.sleep(1.0)
        with traffic.lock:
            after = traffic.sent[n_before + 3 :]
        assert after and all(a == "baseline" for _, a, _, _ in after)  # 0% at once
    finally:
        traffic.stop()
        gw.stop()
        failing.stop()
    assert all(s == 200 for _, _, s, _ in traffic.sent)  # the fallback answered every failed candidate call
    fell = [x for x in traffic.sent if x[3] == "baseline"]
    assert fell and all(a == "candidate" for _, a, _, _ in fell)
    state = json.loads((gw.log_dir / "experiment.json").read_text())
    (look,) = state["looks"]  # one look, at 40 s: the rollback
    assert look["t"] == 40 and look["decision"] == "roll back" and look["error_rate"]["candidate"] == 1.0
    cand = [r for r in gw.records() if r["arm"] == "candidate"]
    assert cand and all(r["status"] == "error" and r["fallback"]["arm"] == "baseline" for r in cand)
    assert all(r["fallback"]["http_status"] == 200 and r["http_status"] == 500 for r in cand)
    rep = json.loads((gw.log_dir / "ab_report.json").read_text())
    assert rep["decision"] == "roll back" and rep["rolled_back"] and rep["final_ratio"] == 0.0
    assert any("guardrail" in r and "error rate" in r for r in rep["reasons"])
    assert rep["guardrails"]["error_rate_candidate"] == 1.0


@pytest.mark.slow
def test_a_restart_in_stage_2_resumes_at_stage_2(tmp_path, perfect, bad):
    stages = [[0.3, 60], [0.6, 120], [1.0, 0]]
    args = [
        "--params",
        str(params(tmp_path, stages, 20)),
        "--time-scale",
        str(SCALE),
        *arms(bad, "bad", perfect, "good"),
    ]
    gw = Gateway(tmp_path, args).start()
    traffic = Traffic(gw.url)
    try:
        exp = wait_for(gw, lambda e: e["stage"] == 1 and e["looks"] >= 5)  # stage 2 (index 1), a look into it
        before = json.loads((gw.log_dir / "experiment.json").read_text())
        assert before["stage"] == 1 and before["ratio"] == 0.6
        gw.kill9()
        time.sleep(1.0)
        gw.start()
        exp = gw.experiment()
        assert exp["stage"] == 1 and exp["ratio"] == 0.6 and exp["restarts"] == 1
        assert exp["stage_starts"] == before["stage_starts"]
        assert exp["next_look"] is not None and exp["waiting_for"]
        exp = wait_for(gw, lambda e: e["report"] is not None)
        assert exp["status"] == "promoted"
    finally:
        traffic.stop()
        gw.stop()
    state = json.loads((gw.log_dir / "experiment.json").read_text())
    assert state["looks"][: len(before["looks"])] == before["looks"]  # kept across the restart
    assert [r["decision"] for r in state["stage_results"]] == ["widen", "widen"]
    assert state["stage_starts"][:2] == before["stage_starts"]
    assert "hermes-lab serve" in gw.output() and "now stage 2 (60%)" in gw.output()
    # --report rebuilds the same report from the log dir alone
    (gw.log_dir / "ab_report.json").unlink()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.live.serve",
            "--report",
            str(gw.log_dir),
            "--params",
            str(tmp_path / "live.yaml"),
        ],
        capture_output=True,
        text=True,
        env=gw.env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rep = json.loads((gw.log_dir / "ab_report.json").read_text())
    assert rep["decision"] == "promote" and rep["restarts"] == 1 and "decision: promote" in r.stdout
    assert [s["sequential_decision"] for s in rep["stages"]] == ["widen", "widen"]


def test_timeouts_and_5xx_are_errors_of_their_arm_and_fallback_streams_the_baseline(tmp_path, perfect):
    """serve.rollout off (a fixed 50% share). The candidate upstream accepts connections and never answers:
    a timeout is a 504 error of the candidate; with serve.fallback: baseline the client gets the baseline's
    answer instead, streamed or not, and the record stays the candidate's error."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections queue up; nothing is ever read or answered
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    args = ["--ratio", "0.5", "--baseline", perfect.url, "--baseline-model", "good", "--candidate", url]
    args += ["--candidate-model", "m", "--set", "serve.rollout=false", "--set", "serve.upstream_timeout_s=0.5"]
    (tmp_path / "plain").mkdir()
    gw = Gateway(tmp_path / "plain", args).start()
    try:
        h = gw.http()
        rid = next(f"to-{i}" for i in range(100) if formula_arm(f"to-{i}", 0.5) == "candidate")
        body = {"model": "hermes", "messages": [{"role": "user", "content": "up ab="}]}
        r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid})
        assert r.status_code == 504 and r.json()["error"]["code"] == "gateway_timeout"
        exp = gw.experiment()
        assert exp["errors"] == {"baseline": 0, "candidate": 1} and exp["looks"] == 0 and exp["next_look"] is None
    finally:
        gw.stop()
    (tmp_path / "fb").mkdir()
    gw = Gateway(tmp_path / "fb", [*args, "--set", "serve.fallback=baseline"]).start()
    try:
        h = gw.http()
        ids = [f"fb-{i}" for i in range(40) if formula_arm(f"fb-{i}", 0.5) == "candidate"][:2]
        r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": ids[0]})
        assert r.status_code == 200 and r.headers["x-hermes-fallback"] == "baseline"
        assert r.headers["x-hermes-arm"] == "candidate" and r.json()["choices"][0]["message"]["content"] == "AB"
        with h.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Request-ID": ids[1]}
        ) as s:
            assert s.status_code == 200 and s.headers["x-hermes-fallback"] == "baseline"
            raw = s.read().decode()
        assert raw.rstrip().endswith("data: [DONE]") and '"content":"A' in raw.replace(" ", "")
        recs = {x["request_id"]: x for x in gw.records()}
        for i in ids:
            rec = recs[i]
            assert rec["arm"] == "candidate" and rec["status"] == "error" and rec["http_status"] == 504
            assert rec["fallback"]["arm"] == "baseline" and rec["fallback"]["http_status"] == 200
        assert recs[ids[1]]["stream"] and gw.experiment()["errors"]["candidate"] == 2
        # feedback on a fallback answer is accepted but is not the candidate's reward
        assert h.post("/v1/feedback", json={"request_id": ids[0], "reward": 5}).status_code == 202
        assert gw.experiment()["feedback"]["candidate"] == 0
    finally:
        gw.stop()
        silent.close()
