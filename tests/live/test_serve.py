"""hermes-lab serve, the live A/B gateway: a real uvicorn subprocess on 127.0.0.1, driven by the openai SDK.

Upstreams are real: the in-process tiny policy and an aiohttp OpenAI-compatible server (tests/fake_openai.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from gateway_process import GATEWAY_KEY, UPSTREAM_KEY, Gateway, formula_arm

from fake_openai import FakeOpenAI, free_port
from repo_paths import REPO


@pytest.fixture(scope="module")
def stub():
    s = FakeOpenAI(models=("cand-model",), api_key=UPSTREAM_KEY).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mixed(stub, tmp_path_factory):
    """Baseline: the in-process tiny policy; candidate: the stub upstream (with its key); a gateway key."""
    tmp = tmp_path_factory.mktemp("mixed")
    args = ["--params", str(REPO / "params/embedded.yaml"), "--ratio", "0.5"]
    args += ["--baseline", "embedded:tiny", "--candidate", stub.url, "--candidate-model", "cand-model"]
    args += ["--candidate-key-env", "UPSTREAM_TEST_KEY", "--set", "serve.api_key_env=GATEWAY_TEST_KEY"]
    args += ["--set", "serve.max_body_bytes=65536", "--set", "ab.min_per_arm=3"]
    gw = Gateway(tmp, args, env={"UPSTREAM_TEST_KEY": UPSTREAM_KEY, "GATEWAY_TEST_KEY": GATEWAY_KEY}).start()
    yield gw
    gw.stop()


def ids_for(arm: str, ratio: float, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        rid = f"{prefix}-{i}"
        if formula_arm(rid, ratio) == arm:
            out.append(rid)
        i += 1
    return out


# ------------------------------------------------------------------------------------- the openai SDK
def test_sdk_sync_routes_and_logs(mixed, stub):
    client = openai.OpenAI(base_url=mixed.url + "/v1", api_key=GATEWAY_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["hermes"]
    for arm in ("baseline", "candidate"):
        for rid in ids_for(arm, 0.5, 3, f"sync-{arm}"):
            raw = client.chat.completions.with_raw_response.create(
                model="hermes",
                messages=[{"role": "user", "content": "rev abcd="}],
                metadata={"task_id": "t-sync"},
                extra_headers={"X-Request-ID": rid},
            )
            assert raw.headers["x-request-id"] == rid and raw.headers["x-hermes-arm"] == arm
            text = raw.parse().choices[0].message.content
            if arm == "candidate":
                assert text == "dcba"  # the stub's answer, not the tiny policy's
    recs = {r["request_id"]: r for r in mixed.records()}
    for arm in ("baseline", "candidate"):
        for rid in ids_for(arm, 0.5, 3, f"sync-{arm}"):
            r = recs[rid]
            assert r["arm"] == arm and r["status"] == "ok" and r["task_id"] == "t-sync" and r["stage"] == 0
            assert r["prompt"] == "rev abcd=" and r["messages"] == [{"role": "user", "content": "rev abcd="}]
            assert r["model"] == ("cand-model" if arm == "candidate" else "embedded:tiny")
            assert r["usage"]["total_tokens"] > 0 and r["latency_ms"] > 0 and r["ratio"] == 0.5
    # the stub got its own key, never the gateway's, and the gateway's model name was replaced
    chats = [r for r in stub.requests if r.path == "/v1/chat/completions"]
    assert chats and all(r.headers["authorization"] == f"Bearer {UPSTREAM_KEY}" for r in chats)
    assert all(r.body["model"] == "cand-model" for r in chats)


def test_sdk_async_and_streaming(mixed):
    async def go() -> list:
        client = openai.AsyncOpenAI(base_url=mixed.url + "/v1", api_key=GATEWAY_KEY, max_retries=0)
        reqs = [
            client.chat.completions.with_raw_response.create(
                model="hermes",
                messages=[{"role": "user", "content": f"up ab{c}="}],
                extra_headers={"X-Request-ID": f"async-{c}"},
            )
            for c in "cdefghij"
        ]
        out = await asyncio.gather(*reqs)
        await client.close()
        return out

    answers = asyncio.run(go())
    assert {r.headers["x-request-id"] for r in answers} == {f"async-{c}" for c in "cdefghij"}
    client = openai.OpenAI(base_url=mixed.url + "/v1", api_key=GATEWAY_KEY, max_retries=0)
    for arm in ("baseline", "candidate"):
        rid = ids_for(arm, 0.5, 1, f"stream-{arm}")[0]
        with client.chat.completions.with_streaming_response.create(
            model="hermes",
            messages=[{"role": "user", "content": "sort 3142="}],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Request-ID": rid},
        ) as raw:
            assert raw.headers["x-hermes-arm"] == arm
            chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage]
        assert usage and usage[-1].total_tokens > 0
        if arm == "candidate":
            assert text == "1234"
        rec = next(r for r in mixed.records() if r["request_id"] == rid)
        assert rec["stream"] and rec["response"] == text and rec["ttft_ms"] is not None and rec["usage"]
    # without include_usage the client gets no usage chunk, but the log still records the usage
    rid = ids_for("candidate", 0.5, 1, "stream-nousage")[0]
    stream = client.chat.completions.create(
        model="hermes",
        messages=[{"role": "user", "content": "up xy="}],
        stream=True,
        extra_headers={"X-Request-ID": rid},
    )
    assert all(c.choices for c in stream)
    assert next(r for r in mixed.records() if r["request_id"] == rid)["usage"]["total_tokens"] > 0


def test_feedback_experiment_and_refusals(mixed):
    h = mixed.http()
    rid = ids_for("candidate", 0.5, 1, "fb")[0]
    body = {"model": "hermes", "messages": [{"role": "user", "content": "up fb="}]}
    assert h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid}).status_code == 200
    assert (
        h.post("/v1/feedback", json={"request_id": rid, "reward": 4.5, "detail": {"tests": "3/3"}}).status_code == 202
    )
    assert h.post("/v1/feedback", json={"request_id": "never-sent", "reward": 1}).status_code == 404
    for bad in (
        {"request_id": rid, "reward": 5.5},
        {"request_id": rid, "reward": -1},
        {"request_id": rid},
        {"reward": 1},
    ):
        assert h.post("/v1/feedback", json=bad).status_code == 422, bad
    assert h.post("/v1/feedback", json={"request_id": rid, "reward": True}).status_code == 422
    assert h.post("/v1/feedback", content=b"{not json").status_code == 422
    fb = mixed.records("feedback.jsonl")
    assert [(f["request_id"], f["reward"], f["source"], f["arm"]) for f in fb if f["request_id"] == rid] == [
        (rid, 4.5, "system", "candidate")
    ]
    exp = h.get("/v1/experiment").json()
    recs = mixed.records()
    assert exp["n_candidate"] == sum(r["arm"] == "candidate" for r in recs)
    assert exp["n_baseline"] == sum(r["arm"] == "baseline" for r in recs)
    assert (
        exp["stage"] == 0
        and exp["ratio"] == 0.5
        and exp["decision"] in ("keep observing", "widen", "promote", "roll back", "hold")
    )
    assert {"delta", "interval", "look"} <= set(exp) or exp["look"] is None
    # refusals: no key, wrong key, body too large, unknown model, bad JSON; none of them is logged
    n = len(mixed.records())
    assert httpx.post(mixed.url + "/v1/chat/completions", json=body, trust_env=False).status_code == 401
    bad_key = {"Authorization": "Bearer nope"}
    assert (
        httpx.post(mixed.url + "/v1/chat/completions", json=body, headers=bad_key, trust_env=False).status_code == 401
    )
    big = {"model": "hermes", "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert h.post("/v1/chat/completions", json=big).status_code == 413
    assert h.post("/v1/chat/completions", content=b"{oops").status_code == 400
    assert len(mixed.records()) == n
    # any model name is served by the experiment (serve.models empty): an agent keeps its own
    other = h.post("/v1/chat/completions", json={**body, "model": "gpt-4o"})
    assert other.status_code == 200 and mixed.records()[-1]["requested_model"] == "gpt-4o"
    assert httpx.get(mixed.url + "/healthz", trust_env=False).status_code == 200  # no key needed


@pytest.mark.slow
def test_agent_drives_the_gateway_and_prep_accounts_for_every_request(mixed, tmp_path):
    env = {**mixed.env, "GATEWAY_TEST_KEY": GATEWAY_KEY}
    cmd = [
        sys.executable,
        "-m",
        "hermes_lab.agents.standin",
        "--url",
        mixed.url,
        "--requests",
        "40",
        "--concurrency",
        "4",
    ]
    cmd += ["--stream-every", "4", "--key-env", "GATEWAY_TEST_KEY", "--seed", "3", "--agent-share", "0.25"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "40/40 answered, 0 errors, 40 feedback accepted" in r.stdout
    # one request the client never scores: kept aside as unrewarded, still accounted for
    h = mixed.http()
    h.post("/v1/chat/completions", json={"model": "hermes", "messages": [{"role": "user", "content": "up zz="}]})
    out = tmp_path / "prep"
    cmd = [sys.executable, "-m", "hermes_lab.prep", "--input", str(mixed.log_dir), "--output", str(out)]
    cmd += ["--params", str(REPO / "params/embedded.yaml"), "--set", "data.min_samples=10"]
    # a runs dir of its own: the checkout's runs/state.json (after a `make round`) would put prep in cooldown
    cmd += ["--set", f"round.runs_dir={tmp_path / 'runs'}"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    (g,) = summary["gateway"].values()
    recs = mixed.records()
    assert g["requests"] == len(recs) == g["errors"] + g["answered"] + g["conversation_turns"]
    assert g["answered"] == g["rewarded"] + g["judged"] + g["unrewarded"] and g["unrewarded"] >= 1
    assert g["errors"] == sum(x["status"] != "ok" for x in recs)
    traj = [json.loads(x) for x in Path(g["trajectories"]).read_text().splitlines()]
    unrew = [json.loads(x) for x in Path(g["unrewarded_file"]).read_text().splitlines()]
    assert len(traj) == g["rewarded"] and len(unrew) == g["unrewarded"]
    agent_tasks = {x["task_id"] for x in traj if x["task_id"] and not x["task_id"].startswith("t-")}
    # every string task, with its task_id from metadata and its reward; the agent episodes whole, as conversations
    assert g["conversations"] >= 3 and len(agent_tasks) + g["conversations"] >= 40
    assert all(0 <= x["reward"] <= 5 for x in traj)
    (pf,) = [f for f in summary["per_file"] if f["file"] == g["trajectories"]]
    assert pf["read"] == g["rewarded"] == pf["accepted"] + pf["rejected"] + pf["duplicates"]
    assert "gateway " in r.stdout and "unrewarded" in r.stdout


def test_no_key_in_any_log(mixed, stub):
    """Run last in this module: the gateway key and the upstream key appear in no file the gateway wrote,
    and the client's key (the gateway key) never reached the upstream."""
    assert stub.requests and all(GATEWAY_KEY not in json.dumps(vars(r)) for r in stub.requests)
    h = mixed.http()
    h.post("/v1/chat/completions", json={"model": "hermes", "messages": [{"role": "user", "content": "up k="}]})
    texts = [p.read_text(errors="replace") for p in mixed.log_dir.iterdir()] + [mixed.output()]
    assert texts and all(GATEWAY_KEY not in t and UPSTREAM_KEY not in t for t in texts)
    assert "Authorization" not in "".join(texts) and "authorization" not in "".join(texts)


# ------------------------------------------------------------------------------------------ assignment
def test_assignment_is_the_md5_formula_on_1000_ids(stub, tmp_path):
    args = ["--ratio", "0.3", "--baseline", stub.url, "--baseline-model", "cand-model", "--candidate", stub.url]
    args += ["--candidate-model", "cand-model", "--baseline-key-env", "K", "--candidate-key-env", "K"]
    gw = Gateway(tmp_path, args, env={"K": UPSTREAM_KEY}).start()
    try:
        body = {"model": "hermes", "messages": [{"role": "user", "content": "up a="}]}
        got = {}
        with httpx.Client(base_url=gw.url, trust_env=False) as h:
            for i in range(1000):
                rid = f"req-{i:04d}"
                r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid})
                assert r.status_code == 200 and r.headers["x-request-id"] == rid
                got[rid] = r.headers["x-hermes-arm"]
            for _ in range(10):  # sticky: the same id always lands in the same arm
                r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": "req-0007"})
                assert r.headers["x-hermes-arm"] == got["req-0007"]
            gen = h.post("/v1/chat/completions", json=body)  # no id sent: one is generated and returned
            assert len(gen.headers["x-request-id"]) >= 16
        assert got == {rid: formula_arm(rid, 0.3) for rid in got}
        assert 0.25 < sum(a == "candidate" for a in got.values()) / 1000 < 0.35
        assert {r["request_id"]: r["arm"] for r in gw.records() if r["request_id"] in got} == got
    finally:
        gw.stop()


def test_unit_user_routes_by_user(stub, tmp_path):
    args = ["--ratio", "0.5", "--set", "ab.unit=user", "--baseline", stub.url, "--baseline-model", "cand-model"]
    args += ["--candidate", stub.url, "--candidate-model", "cand-model", "--baseline-key-env", "K"]
    args += ["--candidate-key-env", "K"]
    gw = Gateway(tmp_path, args, env={"K": UPSTREAM_KEY}).start()
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        h = httpx.Client(base_url=gw.url, trust_env=False)
        for i in range(40):
            user = f"user-{i % 8}"
            msgs = [{"role": "user", "content": "up u="}]
            if i % 2:
                raw = client.chat.completions.with_raw_response.create(model="hermes", messages=msgs, user=user)
                arm = raw.headers["x-hermes-arm"]
            else:  # or the X-Hermes-User header
                r = h.post(
                    "/v1/chat/completions", json={"model": "hermes", "messages": msgs}, headers={"X-Hermes-User": user}
                )
                arm = r.headers["x-hermes-arm"]
            assert arm == formula_arm(user, 0.5)
        assert {r["unit"] for r in gw.records()} == {f"user-{k}" for k in range(8)}
    finally:
        gw.stop()


# --------------------------------------------------------------------------------------------- kill -9
@pytest.mark.parametrize("durability", ["fsync", "write"])
def test_kill9_loses_no_answered_request(stub, tmp_path, durability):
    args = ["--ratio", "0.5", "--baseline", stub.url, "--baseline-model", "cand-model", "--candidate", stub.url]
    args += ["--candidate-model", "cand-model", "--baseline-key-env", "K", "--candidate-key-env", "K"]
    args += ["--set", f"serve.durability={durability}"]
    gw = Gateway(tmp_path, args, env={"K": UPSTREAM_KEY}).start()
    received: list[str] = []
    lock, stop = threading.Lock(), threading.Event()
    body = {"model": "hermes", "messages": [{"role": "user", "content": "add 2+3="}]}

    def client(k: int) -> None:
        with httpx.Client(base_url=gw.url, trust_env=False, timeout=5) as h:
            for i in range(2000):
                if stop.is_set():
                    return
                try:
                    r = h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": f"k{k}-{i}"})
                except httpx.HTTPError:
                    return  # the gateway died under us
                if r.status_code == 200:
                    with lock:
                        received.append(r.headers["x-request-id"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    while len(received) < 300 and all(t.is_alive() for t in threads):
        time.sleep(0.01)
    gw.kill9()  # mid-traffic: 8 clients have requests in flight
    stop.set()
    for t in threads:
        t.join(10)
    logged = {r["request_id"] for r in gw.records()}
    assert len(received) >= 300
    assert set(received) <= logged, f"{len(set(received) - logged)} answered requests missing from the log"
    gw.start()  # the same log dir: the same experiment goes on
    try:
        exp = gw.experiment()
        n_before = len(gw.records())
        assert exp["n_baseline"] + exp["n_candidate"] == n_before >= len(received)
        assert exp["restarts"] == 1
        r = gw.http().post("/v1/chat/completions", json=body, headers={"X-Request-ID": "after-restart"})
        assert r.status_code == 200
        exp2 = gw.experiment()
        assert exp2["n_baseline"] + exp2["n_candidate"] == n_before + 1
        # feedback on a request answered before the crash is still accepted
        assert gw.http().post("/v1/feedback", json={"request_id": received[0], "reward": 5}).status_code == 202
    finally:
        gw.stop()


def test_experiment_decision_is_hermes_lab_ab_on_feedback(stub, tmp_path):
    """A bad baseline vs a perfect candidate: /v1/experiment's interval lies above 0, computed by ab.stats."""
    bad = FakeOpenAI(models=("bad-model",))
    bad.chat_reply = "no idea"
    bad.start()
    args = ["--ratio", "0.5", "--baseline", bad.url, "--baseline-model", "bad-model", "--candidate", stub.url]
    args += ["--candidate-model", "cand-model", "--candidate-key-env", "K", "--set", "ab.min_per_arm=10"]
    gw = Gateway(tmp_path, args, env={"K": UPSTREAM_KEY}).start()
    try:
        from hermes_lab.tasks import suite as T

        h = gw.http()
        assert gw.experiment()["look"] is None  # no feedback yet: no look
        for t in T.generate_tasks(80, seed=5):
            r = h.post(
                "/v1/chat/completions", json={"model": "hermes", "messages": [{"role": "user", "content": t.prompt}]}
            )
            text = r.json()["choices"][0]["message"]["content"]
            fb = {"request_id": r.headers["x-request-id"], "reward": T.verify(t.prompt, text)}
            assert h.post("/v1/feedback", json=fb).status_code == 202
        exp = gw.experiment()
        assert exp["feedback"]["baseline"] + exp["feedback"]["candidate"] == 80
        assert (
            exp["delta"] > 2 and exp["interval"][0] > 0 and exp["look"]["n_candidate"] == exp["feedback"]["candidate"]
        )
        # significant, but promotion waits for the stage's planned end (ab.stages: 2 h): keep observing
        assert exp["decision"] == "keep observing"
        assert any("significant improvement" in r for r in exp["reasons"])
    finally:
        gw.stop()
        bad.stop()


def test_upstream_failure_is_a_logged_502(stub, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    args = [
        "--ratio",
        "0.5",
        "--baseline",
        dead,
        "--baseline-model",
        "m",
        "--candidate",
        dead,
        "--candidate-model",
        "m",
    ]
    gw = Gateway(tmp_path, args).start()
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "hermes", "messages": [{"role": "user", "content": "up a="}]},
            trust_env=False,
        )
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        (rec,) = gw.records()
        assert rec["status"] == "error" and rec["http_status"] == 502 and "127.0.0.1" in rec["error"]
        assert gw.experiment()["errors"][rec["arm"]] == 1
    finally:
        gw.stop()


@pytest.mark.slow
def test_mlflow_traces_from_the_gateway(stub, tmp_path, mlflow_store):
    """serve.mlflow_traces: each request a trace in a real SQLite store, each feedback an assessment on it."""
    args = ["--ratio", "0.5", "--baseline", stub.url, "--baseline-model", "cand-model", "--candidate", stub.url]
    args += ["--candidate-model", "cand-model", "--baseline-key-env", "K", "--candidate-key-env", "K"]
    args += ["--set", "serve.mlflow_traces=true"]
    gw = Gateway(tmp_path, args, env={"K": UPSTREAM_KEY}).start()  # MLFLOW_TRACKING_URI: the fixture's store
    h = gw.http()
    for i in range(3):
        body = {"model": "hermes", "messages": [{"role": "user", "content": "up cat="}]}
        assert h.post("/v1/chat/completions", json=body, headers={"X-Request-ID": f"ml-{i}"}).status_code == 200
        assert h.post("/v1/feedback", json={"request_id": f"ml-{i}", "reward": float(i)}).status_code == 202
    gw.stop()  # a graceful stop flushes the sink
    mlflow = mlflow_store
    mlflow.set_experiment("hermes-lab")
    traces = mlflow.search_traces(return_type="list")
    by_id = {t.info.tags["serve/request_id"]: t.info.trace_id for t in traces}
    assert set(by_id) == {"ml-0", "ml-1", "ml-2"}
    t = mlflow.get_trace(by_id["ml-2"])
    assert [(a.name, a.value) for a in t.info.assessments] == [("system", 2.0)]
    assert UPSTREAM_KEY not in json.dumps(t.to_dict())
