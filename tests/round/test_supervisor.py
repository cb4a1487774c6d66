"""The live flywheel's watch (hermes_lab.round.supervisor) without a gateway: when a round is due, what it waits
for, the config a round runs with, the counting of conversations with feedback. The whole loop, kill -9
included, is tests/e2e/test_live_flywheel.py."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import datetime, timedelta, timezone

import yaml

from hermes_lab.config.schema import load_config
from hermes_lab.core.state import FlywheelState, state_path
from hermes_lab.round.live_rounds import FeedbackCounter, live_params
from hermes_lab.round.supervisor import Supervisor

from repo_paths import REPO


def test_feedback_counter_counts_conversations_once_and_waits_for_whole_lines(tmp_path):
    fb = tmp_path / "feedback.jsonl"
    c = FeedbackCounter(tmp_path)
    assert c.count() == 0  # no file yet
    fb.write_text("".join(json.dumps({"conversation_id": f"c{i % 3}", "reward": 1}) + "\n" for i in range(5)))
    assert c.count() == 3  # five rows, three conversations (a re-score is not a new conversation)
    with open(fb, "a") as f:
        f.write('{"conversation_id": "c9", "rew')  # a line being written: not counted yet, not lost
    assert c.count() == 3
    with open(fb, "a") as f:
        f.write('ard": 2}\nnot json\n{"conversation_id": "c4"}\n')
    assert c.count() == 5 and c.offset == fb.stat().st_size


def test_live_params_adds_the_live_keys_and_keeps_the_rest(tmp_path):
    out = live_params(REPO / "params" / "embedded.yaml", tmp_path / "r.yaml", 360.0, **{"execute.live_dir": "/x"})
    cfg = yaml.safe_load(out.read_text())
    assert cfg["execute"]["source"] == "live" and cfg["execute"]["live_dir"] == "/x"
    assert cfg["ab"]["mode"] == "live" and cfg["serve"]["time_scale"] == 360.0
    assert cfg["round"]["simulated_clock"] is True  # K != 1: the round's cooldown reads the flywheel's clock
    assert cfg["grpo"]["max_steps"] == 40  # the user's keys are kept
    real = yaml.safe_load(live_params(None, tmp_path / "p.yaml", 1.0).read_text())
    assert real["round"]["simulated_clock"] is False  # production: the wall clock
    assert cfg["grpo"]["turns"] == real["grpo"]["turns"] == "all"  # the traffic's conversations, turn by turn
    mine = tmp_path / "mine.yaml"
    mine.write_text("grpo:\n  turns: ''\n")
    assert yaml.safe_load(live_params(mine, tmp_path / "q.yaml", 1.0).read_text())["grpo"]["turns"] == ""  # as said
    load_config(out)  # a valid config


def test_agent_success_per_arm_and_the_round_line(tmp_path):
    """The agent family's live figures a decided round prints: its agent conversations (tools on the first turn) with
    feedback, per arm, the latest feedback of the source counting once; string tasks left out."""
    from hermes_lab.live.log import agent_success
    from hermes_lab.round.live_rounds import describe_agent

    reqs = [
        {"conversation_id": "a1", "turn": 0, "tools_hash": "h", "arm": "baseline"},
        {"conversation_id": "a1", "turn": 1, "tools_hash": "h", "arm": "baseline"},
        {"conversation_id": "a2", "turn": 0, "tools_hash": "h", "arm": "baseline"},
        {"conversation_id": "a3", "turn": 0, "tools_hash": "h", "arm": "candidate"},
        {"conversation_id": "a4", "turn": 0, "tools_hash": "h", "arm": "candidate"},  # no feedback
        {"conversation_id": "s1", "turn": 0, "tools_hash": None, "arm": "candidate"},  # a string task
    ]
    fb = [
        {"conversation_id": "a1", "reward": 0.0},
        {"conversation_id": "a1", "reward": 5.0},  # re-scored: the latest wins
        {"conversation_id": "a2", "reward": 1.0},
        {"conversation_id": "a3", "reward": 5.0},
        {"conversation_id": "a3", "reward": 0.0, "source": "judge"},  # another source: not the reward
        {"conversation_id": "s1", "reward": 5.0},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (tmp_path / "feedback.jsonl").write_text("".join(json.dumps(r) + "\n" for r in fb))
    got = agent_success(tmp_path, 3.0)
    assert got == {"baseline": {"n": 2, "success": 0.5}, "candidate": {"n": 1, "success": 1.0}}
    line = describe_agent({"heldout_before": 0.44, "heldout_after": 0.615, "live": got})
    assert line == "live success baseline 50.0% (n=2) vs candidate 100.0% (n=1); held-out episodes 44.0% -> 61.5%"
    # validate's held-out tasks played by the real Hermes Agent (agent.runner hermes), as the round's summary has them
    before, after = {"pass_rate": 0.573, "tasks": 96}, {"pass_rate": 0.646, "tasks": 96}
    played = {"runner": "hermes", "before": before, "after": after}
    line = describe_agent({"heldout_before": 0.44, "heldout_after": 0.615, "live": got, "played": played})
    assert line.endswith("held-out episodes 44.0% -> 61.5%; real Hermes on 96 held-out tasks 57.3% -> 64.6%")


def test_due_waits_for_volume_and_cooldown_on_the_scaled_clock(tmp_path):
    base = yaml.safe_load((REPO / "params" / "embedded.yaml").read_text())
    base["round"] = {"runs_dir": str(tmp_path / "runs")}
    base["data"].update(min_samples=4, cooldown_hours=2)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(base))
    sup = Supervisor(str(tmp_path / "p.yaml"), time_scale=3600.0)  # an hour a second
    log = tmp_path / "runs" / "live" / "collect-01"
    log.mkdir(parents=True)
    sup._serving(log)
    ok, reasons, kinds = sup.due()
    assert not ok and kinds == ["samples"] and reasons[0].startswith("4 more conversations with feedback")
    (log / "feedback.jsonl").write_text("".join(json.dumps({"conversation_id": f"c{i}"}) + "\n" for i in range(6)))
    assert sup.due()[0]  # 6 >= 4, never trained: due
    sup.state["consumed"] = 3  # a round already took three of them
    assert sup.due()[2] == ["samples"]
    sup.state["consumed"] = 0
    fw = FlywheelState.load(state_path(sup.runs))
    fw.last_train_time = sup.sim_now().isoformat()  # trained just now: 2 h of cooldown = 2 s of wall clock
    fw.save(state_path(sup.runs))
    ok, reasons, kinds = sup.due()
    assert not ok and kinds == ["cooldown"] and "h left" in reasons[0] and "of wall clock" in reasons[0]
    sup.state["clock"]["sim"] = (datetime.now(timezone.utc) + timedelta(hours=3)).isoformat()  # the clock ran on
    assert sup.due()[0]
    # a restart keeps what was served and counted
    sup._save()
    again = Supervisor(str(tmp_path / "p.yaml"), time_scale=3600.0)
    assert again.state["serving"] == str(log) and again.state["restarts"] == 1


def test_a_hosted_candidate_takes_the_model_id_of_the_config(tmp_path):
    """serve.candidate an API URL (TaoToken): the round's live experiment asks it for serve.candidate_model, the
    id the operator deployed the adapter under; a new id in the params file is the next experiment's."""
    from hermes_lab.live import round as live_round

    for n, model in ((1, "hermes-ft-001"), (2, "hermes-ft-002")):
        over = {
            "round.runs_dir": str(tmp_path / "runs"),
            "serve.candidate": "https://api.example.test/v1",
            "serve.candidate_model": model,
            "serve.candidate_key_env": "TAOTOKEN_API_KEY",
        }
        cfg = load_config(None, overrides=over)
        st = live_round.prepare(cfg, tmp_path / "runs" / f"round-{n:02d}", "embedded:tiny", str(tmp_path / "adapter"))
        cand = st["arms"]["candidate"]
        assert cand["kind"] == "upstream" and cand["model"] == model and cand["key_env"] == "TAOTOKEN_API_KEY"
        assert st["arm_specs"]["candidate"]["model"] == model


def test_a_round_awaiting_review_resumes_once_per_batch_of_new_labels(tmp_path, monkeypatch):
    from hermes_lab.round import supervisor as S

    base = yaml.safe_load((REPO / "params" / "embedded.yaml").read_text())
    base["round"] = {"runs_dir": str(tmp_path / "runs")}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(base))
    started: list[str] = []

    class Watch(Supervisor):
        async def start_worker(self, n: int, why: str) -> None:  # what the watch decides, not a real round
            started.append(why)

    sup = Watch(str(tmp_path / "p.yaml"))
    fw = FlywheelState.load(state_path(sup.runs))
    fw.progress = {"round": 1, "status": "awaiting review", "completed": ["execute", "prep"]}
    fw.save(state_path(sup.runs))
    labels = sup.runs / "review" / "labels.jsonl"
    labels.parent.mkdir(parents=True)
    labels.write_text('{"id": "old"}\n')  # labels from before: not a reason to resume
    monkeypatch.setattr(S, "LABELS_SETTLE_S", 0.0)

    def step() -> None:
        asyncio.run(sup.step())

    step()
    step()
    assert sup.phase == "review" and not started and "review labels" in sup.waiting[0]
    with open(labels, "a") as f:
        f.write('{"id": "new"}\n')
    t = labels.stat().st_mtime
    os.utime(labels, (t + 5, t + 5))  # a new mtime even on a coarse clock
    step()  # the change is seen: the settle timer starts
    step()  # settled: resumed once
    step()
    assert started == ["new review labels: the round resumes at its review gate"]
