"""hermes_lab.live.log (the gateway's log dir), its prep join, the MLflow trace sink and the serve config checks."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hermes_lab.config.schema import ConfigError, load_config
from hermes_lab.live import log as L
from hermes_lab.logs import gateway
from hermes_lab.prep.run import run_prep


def write_lines(path: Path, rows: list, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail, encoding="utf-8")


def req(rid: str, prompt: str, response: str, arm: str = "baseline", status: str = "ok", **kw) -> dict:
    rec = {"request_id": rid, "unit": rid, "arm": arm, "model": "m", "stage": 0, "ratio": 0.5, "t": 1.0}
    rec.update(status=status, latency_ms=3.0, prompt=prompt, response=response, messages=[], task_id=None)
    rec.update(kw)
    return rec


@pytest.fixture
def log_dir(tmp_path) -> Path:
    d = tmp_path / "live" / "tiny-vs-round-01"
    d.mkdir(parents=True)
    write_lines(
        d / L.REQUESTS,
        [
            req("a", "up cat=", "CAT", task_id="t-1"),
            req("b", "rev abc=", "cba", arm="candidate"),
            req("c", "up cat=", "CAT."),  # no feedback; same prompt as 'a'
            req("d", "a question nobody else asked", "an answer"),  # no feedback, no reference
            req("e", "up dog=", "", status="error", error="upstream status 500"),
        ],
        tail='{"request_id": "torn", "prom',  # a crash mid-line
    )
    write_lines(
        d / L.FEEDBACK,
        [
            {"request_id": "a", "reward": 2.0, "source": "system"},
            {"request_id": "a", "reward": 5.0, "source": "system"},  # the latest wins
            {"request_id": "b", "reward": 1.0, "source": "reviewer"},  # another source: not the reward
            {"request_id": "b", "reward": 4.0, "source": "system"},
            {"request_id": "ghost", "reward": 3.0, "source": "system"},
        ],
    )
    return d


def test_join_accounts_for_every_request(log_dir, tmp_path):
    cfg = load_config(None)
    info = gateway.gateway_trajectories(log_dir, tmp_path / "out", cfg)
    assert (info["requests"], info["errors"], info["answered"]) == (5, 1, 4)
    assert (info["rewarded"], info["judged"], info["unrewarded"]) == (2, 0, 2)
    assert info["torn_lines"] == {"requests": 1, "feedback": 0}
    assert info["feedback_other_source"] == 1 and info["feedback_unknown_request"] == 1
    traj = {r["request_id"]: r for r in map(json.loads, Path(info["trajectories"]).read_text().splitlines())}
    assert traj["a"]["reward"] == 5.0 and traj["a"]["task_id"] == "t-1" and traj["b"]["reward"] == 4.0
    assert traj["b"]["task_id"].startswith("reverse-")  # the embedded task's id when the client sent none
    unrew = [json.loads(x)["request_id"] for x in Path(info["unrewarded_file"]).read_text().splitlines()]
    assert unrew == ["c", "d"]
    assert "5 requests = 1 errors + 4 answered" in gateway.describe_gateway(info)
    # another source configured: the reviewer's score counts, the system ones do not
    cfg2 = load_config(None, {"serve.feedback_source": "reviewer"})
    info2 = gateway.gateway_trajectories(log_dir, tmp_path / "out2", cfg2)
    assert info2["rewarded"] == 1 and info2["feedback_other_source"] == 4


def test_unrewarded_reach_grpo_data_only_when_judged(log_dir, tmp_path):
    cfg = load_config(None, {"serve.score_unrewarded": "judge", "reward.model": "local"})
    info = gateway.gateway_trajectories(log_dir, tmp_path / "out", cfg)
    # 'c' shares its prompt with the rewarded 'a' (its reference); 'd' has no reference and stays out
    assert (info["rewarded"], info["judged"], info["unrewarded"]) == (2, 1, 1)
    rows = {r["request_id"]: r for r in map(json.loads, Path(info["trajectories"]).read_text().splitlines())}
    assert rows["c"]["reward_source"] == "judge" and 0 < rows["c"]["reward"] < 5


def test_prep_reads_a_gateway_log_dir(log_dir, tmp_path):
    cfg = load_config(None, {"data.min_samples": 1, "data.max_bad_fraction": 1.0})
    res = run_prep([log_dir], tmp_path / "prep", cfg, make_plots=False)
    g = res.summary["gateway"][str(log_dir)]
    assert res.summary["counts"]["new_samples"] == g["rewarded"] == 2
    assert res.summary["inputs"] == [g["trajectories"]]


def test_tally_rebuilds_counts_and_rewards(log_dir):
    t = L.Tally.from_dir(log_dir)
    assert t.n == [4, 1] and t.errors == [1, 0] and t.feedback == [1, 1]
    assert t.torn["requests"] == 1
    cols = t.columns()
    assert len(cols["reward"]) == 5  # every request; c and d wait for feedback (NaN: guardrails only)
    r = cols["reward"]
    assert sorted(r[~np.isnan(r)].tolist()) == [0.0, 4.0, 5.0] and np.isnan(r).sum() == 2  # e failed: 0
    assert cols["error"].sum() == 1 and math.isnan(t.reward[t.index["c"]])


def test_tally_columns_know_what_a_look_could_know():
    """columns(known_by=T): requests complete by T, rewards whose first feedback came by T; time order."""
    t = L.Tally()
    t.add_request(req("late", "up a=", "A", t=5.0, t_done=9.0))  # answered after the look at 8
    t.add_request(req("x", "up b=", "B", t=2.0, t_done=3.0))
    t.add_request(req("y", "up c=", "C", arm="candidate", t=1.0, t_done=2.5))
    t.add_request(req("z", "up d=", "", arm="candidate", status="error", t=4.0, t_done=4.5))
    t.add_feedback({"request_id": "x", "reward": 5.0, "t": 7.0})
    t.add_feedback({"request_id": "y", "reward": 2.0, "t": 8.5})  # after the look
    t.add_feedback({"request_id": "x", "reward": 3.0, "t": 12.0})  # a re-score: the latest value, the first time
    cols = t.columns(stage=0, known_by=8.0)
    assert cols["t"].tolist() == [1.0, 2.0, 4.0]  # y, x, z in arrival order; 'late' was not complete yet
    assert cols["reward"][0] != cols["reward"][0] and cols["reward"][1:].tolist() == [3.0, 0.0]
    assert t.columns(known_by=9.0)["t"].tolist() == [1.0, 2.0, 4.0, 5.0]
    assert t.columns(known_by=8.5)["reward"][0] == 2.0 and t.feedback == [1, 1]


def test_tally_gives_the_covariates_of_ab_run_in_time_order(log_dir):
    """ab.covariates on live traffic: each request's cell (family:level, or a conversation's opening turn) and
    task codes, so the gateway's looks decide on the same regression-adjusted rule as ab-run."""
    from hermes_lab.ab import covariates

    t = L.Tally.from_dir(log_dir, covariates=covariates.KINDS)
    cols = t.columns()
    assert cols["cell"].tolist() == [0, 1, 0, -1, 0]  # up:1 (a, c, e share it), rev:1, then no embedded task
    assert cols["task"].tolist() == [0, 1, 0, 2, 3]  # the same prompt 'up cat=' is one task; d's prompt its own
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix it"}]
    t.add_request(req("f", "fix it", "ok", messages=conv, t=2.0))
    t.add_request(req("g", "run it", "ok", messages=[*conv, {"role": "assistant", "content": "ok"}], t=3.0))
    late = t.columns()
    assert late["cell"][-2] == late["cell"][-1] == 2 and late["task"][-2] == late["task"][-1] == 4  # opening turn
    assert "cell" not in L.Tally.from_dir(log_dir).columns()  # no covariates configured: the plain rule


def test_the_tally_keeps_no_conversation_messages_until_its_look():
    """A conversation turn's covariate keys are taken as it is added (the tally does not hold its messages until
    the next look, ab.look_every apart); a lone prompt's wait for the look, the tally holding its text alone. The
    codes are ab-run's either way."""
    from hermes_lab.ab import covariates

    system = {"role": "system", "content": "You are an agent. " * 200}
    recs = []
    for k in range(6):
        opening = [system, {"role": "user", "content": f"task {k % 3}"}]
        call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "t", "arguments": "{}"}}]}
        recs.append(req(f"o{k}", "", "ok", messages=opening))
        recs.append(req(f"n{k}", "", "ok", messages=[call, {"role": "tool", "content": "x" * 500}]))
        lone = f"up w{k % 2}="  # a single-turn request: its one user message is its prompt
        recs.append(req(f"p{k}", lone, "ok", messages=[{"role": "user", "content": lone}]))
    t = L.Tally(covariates=covariates.KINDS)
    for r in recs:
        t.add_request(r)
    held = [x for x in t._cov_todo if type(x) is not tuple]  # a lone prompt's text alone, not its messages
    assert held == [r["prompt"] for r in recs if r["request_id"][0] == "p"]
    enc = covariates.Encoder(covariates.KINDS)
    want = [enc.row({"prompt": r["prompt"], "messages": r.get("messages")})[:2] for r in recs]
    cols = t.columns()
    assert list(zip(cols["cell"].tolist(), cols["task"].tolist())) == want and not t._cov_todo
    assert len({c for c, _ in want}) >= 3 and len({k for _, k in want}) >= 5  # openings, later turns, prompts
    # a later turn of a conversation (its id on every turn, its record holding only its new messages) takes its
    # conversation's codes, its opening turn's, without reading its own messages
    t = L.Tally(covariates=covariates.KINDS)
    for k in range(2):
        opening = [system, {"role": "user", "content": f"job {k}"}]
        t.add_request(req(f"c{k}", "", "ok", messages=opening, conversation_id=f"conv-{k}"))
    later = [call, {"role": "tool", "content": "y" * 500}]
    for k in (0, 1, 0):
        t.add_request(req(f"c{k}-later", "", "ok", messages=later, conversation_id=f"conv-{k}", turn=1))
    cols = t.columns()
    codes = list(zip(cols["cell"].tolist(), cols["task"].tolist(), strict=True))
    assert codes[2] == codes[4] == codes[0] and codes[3] == codes[1] and codes[0] != codes[1]


@pytest.mark.parametrize("durability", ["fsync", "write"])
def test_log_writer_group_commit_and_torn_tail(tmp_path, durability):
    p = tmp_path / "requests.jsonl"
    p.write_bytes(b'{"ok": 1}\n{"torn": ')

    async def go() -> L.LogWriter:
        w = L.LogWriter(p, durability, fsync_ms=20)
        await asyncio.gather(*(w.append(json.dumps({"i": i}).encode() + b"\n") for i in range(500)))
        return w

    w = asyncio.run(go())
    w.close()
    lines = p.read_bytes().splitlines()
    assert lines[0] == b'{"ok": 1}' and lines[1] == b'{"torn": '  # never rewritten in place
    assert sorted(json.loads(x)["i"] for x in lines[2:]) == list(range(500))
    assert 1 <= w.stats["fsyncs"] < 500  # one fsync covers many lines
    assert [i for i, _ in L.read_jsonl(p)] == [1, *range(3, 503)]


def test_log_writer_writes_a_loop_pass_at_once_each_line_before_its_append_returns(tmp_path, caplog):
    """durability 'write': the records of one pass of the event loop go out in one os.write, and each append returns
    only once its line is in the file (what a kill -9 cannot lose); a cancelled append's line is written all the
    same, a line queued without a running loop is written at once, and a failed write fails its appends."""
    p = tmp_path / "requests.jsonl"
    w = L.LogWriter(p, "write", fsync_ms=20)
    seen: list[bool] = []

    async def one(i: int) -> None:
        line = json.dumps({"i": i}).encode() + b"\n"
        await w.append(line)
        seen.append(line in p.read_bytes())  # durable when append returns

    async def go() -> None:
        await asyncio.gather(*(one(i) for i in range(200)))  # one pass: one write
        assert (w.stats["lines"], w.stats["writes"]) == (200, 1)
        gone = asyncio.ensure_future(w.append(b'{"i": "cancelled"}\n'))
        await asyncio.sleep(0)  # its append is waiting for the pass's write
        gone.cancel()
        w.append_nowait(b'{"i": "nowait"}\n')
        await asyncio.sleep(0.01)
        assert gone.cancelled()

    asyncio.run(go())
    w.append_nowait(b'{"i": "no loop"}\n')  # no running loop: at once
    assert p.read_bytes().endswith(b'{"i": "no loop"}\n')
    w.close()
    lines = [json.loads(x)["i"] for x in p.read_bytes().splitlines()]
    assert lines == [*range(200), "cancelled", "nowait", "no loop"] and seen == [True] * 200
    assert w.stats["writes"] == 3  # the 200, the cancelled and the nowait lines' pass, the last one

    full = L.LogWriter("/dev/full", "write")  # every write fails: ENOSPC

    async def fails() -> None:
        with pytest.raises(OSError):
            await full.append(b'{"i": 0}\n')

    asyncio.run(fails())
    full.close()
    assert "lines not written" in caplog.text


def test_trace_sink_writes_traces_and_assessments(mlflow_store, tmp_path):
    from hermes_lab.live.traces import TraceSink

    cfg = load_config(None, {"round.runs_dir": str(tmp_path)})
    sink = TraceSink(cfg, "tiny-vs-tiny")
    rec = req(
        "r-1",
        "up cat=",
        "CAT",
        timestamp="2026-01-01T00:00:01+00:00",
        messages=[{"role": "user", "content": "up cat="}],
    )
    sink.request(rec)
    sink.feedback({"request_id": "r-1", "reward": 5.0, "source": "system", "detail": "tests pass", "arm": "baseline"})
    sink.close()
    assert sink.stats["traces"] == 1 and sink.stats["assessments"] == 1, sink.stats
    traces = mlflow_store.search_traces(filter_string="tags.`serve/request_id` = 'r-1'", return_type="list")
    assert len(traces) == 1
    t = mlflow_store.get_trace(traces[0].info.trace_id)
    assert t.info.tags["serve/arm"] == "baseline" and t.info.tags["serve/experiment"] == "tiny-vs-tiny"
    fb = [a for a in t.info.assessments if a.name == "system"]
    assert fb and fb[0].value == 5.0 and fb[0].rationale == "tests pass"
    # a restarted gateway finds the trace of an earlier request by its tag
    sink2 = TraceSink(cfg, "tiny-vs-tiny")
    sink2.feedback({"request_id": "r-1", "reward": 1.0, "source": "reviewer", "arm": "baseline"})
    sink2.close()
    assert sink2.stats["assessments"] == 1


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"serve.port": 70000}, "serve.port"),
        ({"serve.durability": "maybe"}, "serve.durability"),
        ({"serve.candidate": "https://api.example.test"}, "serve.candidate_model"),
        ({"serve.api_key_env": "sk-live 123"}, "serve.api_key_env"),
        ({"serve.score_unrewarded": "all"}, "serve.score_unrewarded"),
        ({"serve.max_body_bytes": 10}, "serve.max_body_bytes"),
        ({"serve.experiment": "a/b"}, "serve.experiment"),
    ],
)
def test_serve_config_checks_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, override)


def test_arm_specs_latest_round_urls_and_errors(tmp_path):
    from hermes_lab.live.arms import resolve_arm
    from hermes_lab.live.gateway import default_experiment

    cfg = load_config(None, {"round.runs_dir": str(tmp_path)})
    assert resolve_arm(cfg, "candidate").spec == "embedded:tiny"  # no round trained yet: an A/A
    for n in (1, 3, 2):
        (tmp_path / f"round-{n:02d}" / "train" / "adapter").mkdir(parents=True)
        (tmp_path / f"round-{n:02d}" / "train" / "adapter" / "adapter_config.json").write_text("{}")
    c = resolve_arm(cfg, "candidate")
    assert c.kind == "local" and c.adapter == str(tmp_path / "round-03" / "train" / "adapter")
    assert c.base == "embedded:tiny" and c.slug == "round-03"
    b = resolve_arm(cfg, "baseline", "https://api.example.test/v1/", "qwen-lora", "MY_KEY")
    assert b.url == "https://api.example.test/v1/chat/completions" and b.describe()["key_env"] == "MY_KEY"
    assert default_experiment({"baseline": b, "candidate": c}) == "qwen-lora-vs-round-03"
    with pytest.raises(ConfigError, match="--baseline-model"):
        resolve_arm(cfg, "baseline", "http://127.0.0.1:9", "", "")
    with pytest.raises(ConfigError, match="no such model"):
        resolve_arm(cfg, "candidate", "runs/round-99/train", None, None)
