"""hermes_lab.prep.run: ingest/validate (every bad kind), counts, dedup, outliers, split, negatives, gates, review
sample, CLI exit codes, MLflow logging (real SQLite store), and the notebook through papermill."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.kernels import ForkingKernelManager
from hermes_lab.core.state import FlywheelState, SimulatedClock
from hermes_lab.prep.run import GateRefused, PrepError, _split_of, expand_by_weight, run_prep
from hermes_lab.tasks import suite as tasks

from conftest import mlflow_db
from repo_paths import FIXTURES, REPO

PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MIB = 1 << 20


def good_records(n: int = 600, seed: int = 0) -> list[dict]:
    """n distinct valid records: embedded tasks (family from the prompt) plus some 'unknown' user prompts."""
    rng = random.Random(seed)
    pool = tasks.generate_tasks(250, split="any", seed=seed)
    out, seen = [], set()
    while len(out) < n:
        i = len(out)
        if i % 10 == 9:
            prompt, answer, tid = f"Summarise ticket #{i} in one line.", "ok", f"ticket-{i}"
        else:
            t = pool[rng.randrange(len(pool))]
            prompt, answer, tid = t.prompt, t.answer, t.task_id
        resp = answer if rng.random() < 0.5 else f"{tasks.corrupt(answer, rng)}{rng.randrange(100)}"
        if (prompt, resp, tid) in seen:
            continue
        seen.add((prompt, resp, tid))
        reward = tasks.verify(prompt, resp) if tid != f"ticket-{i}" else round(rng.uniform(0, 5), 2)
        out.append(
            {
                "prompt": prompt,
                "response": resp,
                "reward": reward,
                "task_id": tid,
                "request_id": f"req-{i}",
                "timestamp": "2026-01-01T00:00:00Z",
                "policy": "base",
                "arm": "baseline",
            }
        )
    return out


def line(rec: dict) -> bytes:
    return json.dumps(rec).encode()


G = {"prompt": "up cat=", "response": "CAT", "task_id": "upper-x"}  # a template for bad lines
BAD: list[tuple[bytes, str]] = [
    (b'{"prompt": "up cat=", "response": "CAT", "reward": 5', "malformed JSON"),
    (b"[1, 2, 3]", "not a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON"),  # nested too deeply: no RecursionError escapes
    (b'"just a string"', "not a JSON object"),
    (line({"response": "CAT", "reward": 5, "task_id": "t"}), "missing field 'prompt'"),
    (line({"prompt": "up cat=", "reward": 5, "task_id": "t"}), "missing field 'response'"),
    (line({"prompt": "up cat=", "response": "CAT", "task_id": "t"}), "missing field 'reward'"),
    (line({"prompt": "up cat=", "response": "CAT", "reward": 5}), "missing field 'task_id'"),
    (line({**G, "prompt": "   ", "reward": 5}), "empty prompt"),
    (line({**G, "prompt": 42, "reward": 5}), "prompt not a string"),
    (line({**G, "reward": "4.2"}), "reward not a number"),
    (line({**G, "reward": True}), "reward not a number"),
    (b'{"prompt": "up cat=", "response": "CAT", "reward": NaN, "task_id": "t"}', "NaN/Infinity not allowed"),
    (b'{"prompt": "up cat=", "response": "CAT", "reward": Infinity, "task_id": "t"}', "NaN/Infinity not allowed"),
    (line({**G, "reward": 7.5}), "reward out of range"),
    (line({**G, "reward": -1}), "reward out of range"),
    (b'{"prompt": "caf\xe9 \xff", "response": "x", "reward": 1, "task_id": "t"}', "not valid UTF-8"),
    (b'{"prompt": "up \\ud800=", "response": "x", "reward": 1, "task_id": "t"}', "invalid Unicode"),
    (line({**G, "reward": 1, "task_id": None}), "bad task_id"),
    (line({**G, "reward": 1, "pad": "x" * (3 * MIB)}), "line too long"),
]


def write_mixed(path: Path, good: list[dict]) -> dict:
    """600 good records, every bad kind, a BOM, CRLF endings, blank lines, duplicates and a 1.5 MiB valid line.
    Returns what the file holds: bad line numbers -> reason, good keys, counts."""
    lines: list[bytes] = []
    bad_at: dict[int, str] = {}
    bad = list(BAD)
    dups = 0
    for i, rec in enumerate(good):
        raw = line(rec)
        if i == 0:
            raw = b"\xef\xbb\xbf" + raw  # a BOM on the first line
        if i % 7 == 0:
            raw += b"\r"  # CRLF line ending
        lines.append(raw)
        if i % 30 == 5 and bad:
            b, reason = bad.pop(0)
            lines.append(b)
            bad_at[len(lines)] = reason
        if i % 100 == 50:
            lines += [b"", b"   \t"]  # blank lines: skipped, counted
        if i % 150 == 10:
            lines.append(line(rec))  # an exact duplicate
            dups += 1
    assert not bad
    long_rec = {"prompt": "rev abc=", "response": "y" * (MIB + MIB // 2), "reward": 0.5, "task_id": "reverse-long"}
    lines.append(line(long_rec))  # 1.5 MiB: valid, accepted
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {
        "bad_at": bad_at,
        "dups": dups,
        "lines": len(lines),
        "blank": 2 * sum(1 for i in range(len(good)) if i % 100 == 50),
        "good": good + [long_rec],
    }


@pytest.fixture
def cfg():
    return load_config(None, overrides={"data.max_line_bytes": 2 * MIB})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    info = write_mixed(d / "traj.jsonl", good_records())
    c = load_config(None, overrides={"data.max_line_bytes": 2 * MIB})
    res = run_prep([d / "traj.jsonl"], d / "out", c, make_plots=True)
    return d, info, res


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def test_rejects_name_each_bad_line_and_good_records_are_kept(mixed):
    d, info, _res = mixed
    rejects = read_jsonl(d / "out" / "rejects.jsonl")
    assert {r["line"]: r["reason"] for r in rejects} == info["bad_at"]
    assert all(r["file"] == str(d / "traj.jsonl") for r in rejects)
    by_line = {r["line"]: r for r in rejects}
    utf8 = next(r for r in rejects if r["reason"] == "not valid UTF-8")
    assert "\\xe9" in utf8["raw"] and "\\xff" in utf8["raw"]  # nothing lost: the bytes are visible
    long = next(r for r in rejects if r["reason"] == "line too long")
    assert long["raw_truncated"] and len(long["raw"]) <= 4096 and "bytes" in long["detail"]
    assert by_line[min(by_line)]["detail"]  # a detail explains the reason
    accepted = read_jsonl(d / "out" / "accepted.jsonl")
    assert {(r["prompt"], r["response"], r["task_id"]) for r in accepted} == {
        (r["prompt"], r["response"], r["task_id"]) for r in info["good"]
    }
    assert len(accepted) == len(info["good"])
    assert accepted[0]["request_id"] == "req-0" and accepted[0]["arm"] == "baseline"  # extra fields kept; BOM gone
    assert any(len(r["response"]) > MIB for r in accepted)  # the 1.5 MiB line is accepted


def test_summary_counts_add_up(mixed):
    d, info, res = mixed
    s = json.loads((d / "out" / "summary.json").read_text())
    k = s["counts"]
    assert k["lines"] == info["lines"] and k["blank"] == info["blank"]
    assert k["lines"] == k["blank"] + k["read"]
    assert k["read"] == k["accepted"] + k["rejected"] + k["duplicates"]
    assert k["rejected"] == len(BAD) and k["duplicates"] == info["dups"] and k["accepted"] == len(info["good"])
    assert k["new_samples"] == k["accepted"] and sum(s["by_reason"].values()) == k["rejected"]
    (f,) = s["per_file"]
    assert f["read"] == f["accepted"] + f["rejected"] + f["duplicates"] and f["by_reason"]["line too long"] == 1
    assert len(read_jsonl(d / "out" / "duplicates.jsonl")) == info["dups"]
    assert s["status"] == "ok" and s["gates_passed"] and res.gates_passed
    assert [g["name"] for g in s["gates"]] == ["min_samples", "cooldown", "learning_signal"]
    assert s["gates"][2]["passed"] and s["gates"][2]["detail"].startswith("no conversations")  # seed lines only
    for p in ("plot_rewards", "plot_rejects"):
        assert Path(s["paths"][p]).stat().st_size > 1000


def test_split_has_no_leakage_and_grpo_schema(mixed):
    import datasets

    d, info, _res = mixed
    grpo = datasets.load_from_disk(str(d / "out" / "grpo_dataset"))
    held = datasets.load_from_disk(str(d / "out" / "heldout_dataset"))
    for col in (
        "prompt",
        "task_id",
        "family",
        "reference",
        "ref_reward",
        "n_logged",
        "mean_logged_reward",
        "is_negative",
        "weight",
    ):
        assert col in grpo.column_names and col in held.column_names
    assert len(held) > 0 and len(grpo) > 5 * len(held)
    assert not set(grpo["task_id"]) & set(held["task_id"]) and not set(grpo["prompt"]) & set(held["prompt"])
    assert all(_split_of(t, 0.1, {}) for t in held["task_id"])
    assert len(set(grpo["prompt"])) == len(grpo)  # one row per unique prompt
    assert sum(grpo["n_logged"]) + sum(held["n_logged"]) == len(info["good"])
    # the reference is the best logged response; family from the prompt, else "unknown"
    best: dict[str, float] = {}
    for r in info["good"]:
        best[r["prompt"]] = max(best.get(r["prompt"], -1), r["reward"])
    for row in grpo:
        assert row["ref_reward"] == best[row["prompt"]] and row["family"] == (
            tasks.family_of(row["prompt"]) or "unknown"
        )


def test_shared_prompt_across_splits_goes_to_heldout(tmp_path, cfg):
    held_id = next(f"t{i}" for i in range(1000) if _split_of(f"t{i}", 0.1, {}))
    train_id = next(f"t{i}" for i in range(1000) if not _split_of(f"t{i}", 0.1, {}))
    recs = [
        {"prompt": "up cat=", "response": r, "reward": 1.0, "task_id": tid}
        for tid, r in ((train_id, "A"), (held_id, "B"), (train_id, "C"))
    ]
    recs += [{"prompt": f"p{i}", "response": "x", "reward": 1.0, "task_id": train_id} for i in range(5)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = load_config(None, overrides={"data.min_samples": 1})
    res = run_prep([tmp_path / "t.jsonl"], tmp_path / "out", c, make_plots=False)
    import datasets

    held = datasets.load_from_disk(str(tmp_path / "out" / "heldout_dataset"))
    grpo = datasets.load_from_disk(str(tmp_path / "out" / "grpo_dataset"))
    assert held["prompt"] == ["up cat="] and held["task_id"] == [held_id] and held["n_logged"] == [3]
    assert "up cat=" not in grpo["prompt"] and set(grpo["task_id"]) == {train_id}
    assert res.summary["split"]["records_moved_to_heldout"] == 2


def test_too_many_bad_lines_stop_with_the_file_named(tmp_path, cfg):
    p = tmp_path / "noisy.jsonl"
    good = good_records(50)
    p.write_bytes(b"\n".join([line(r) for r in good] + [b"{oops"] * 30) + b"\n")
    with pytest.raises(PrepError) as e:
        run_prep([p], tmp_path / "out", cfg, make_plots=False)
    msg = str(e.value)
    assert str(p) in msg and "line 51: malformed JSON" in msg and "30 of 80" in msg and "rejects.jsonl" in msg
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["status"] == "bad_input" and s["counts"]["rejected"] == 30
    assert len(read_jsonl(tmp_path / "out" / "rejects.jsonl")) == 30
    assert len(read_jsonl(tmp_path / "out" / "accepted.jsonl")) == 50  # nothing lost


def test_outliers_flagged_and_kept(tmp_path):
    rng = random.Random(1)
    recs = [
        {"prompt": f"q{i}", "response": "a", "reward": round(4 + rng.uniform(-0.2, 0.2), 3), "task_id": f"t{i}"}
        for i in range(200)
    ]
    recs[17]["reward"] = 0.0
    recs[90]["reward"] = 0.3
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = load_config(None, overrides={"data.min_samples": 1})
    res = run_prep([tmp_path / "t.jsonl"], tmp_path / "out", c, make_plots=False)
    flagged = read_jsonl(tmp_path / "out" / "outliers.jsonl")
    assert sorted(r["line"] for r in flagged) == [18, 91] and all(r["z"] < -4 for r in flagged)
    assert res.summary["outliers"]["count"] == 2 and res.summary["counts"]["accepted"] == 200  # kept
    import datasets

    rows = {
        r["prompt"]: r
        for ds in ("grpo_dataset", "heldout_dataset")
        for r in datasets.load_from_disk(str(tmp_path / "out" / ds))
    }
    assert rows["q17"]["n_outliers"] == 1 and rows["q17"]["ref_reward"] == 0.0 and rows["q18"]["n_outliers"] == 0


def test_negatives_carried_with_provenance_and_weight(tmp_path):
    import datasets

    new = good_records(300, seed=3)
    neg_dir = tmp_path / "runs" / "round-02"
    neg_dir.mkdir(parents=True)
    neg = [
        {"prompt": f"hard {i}=", "response": "bad", "reward": 0.5, "task_id": f"hard-{i}", "arm": "candidate"}
        for i in range(40)
    ]
    neg.append(new[0])  # also in the new data: a duplicate, counted once
    (neg_dir / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in neg))
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))
    extra = tmp_path / "extra_neg.jsonl"
    extra.write_text(json.dumps({"prompt": "hard x=", "response": "no", "reward": 0.0, "task_id": "hard-x"}) + "\n")
    state = FlywheelState(negative_rounds=[2], negative_files=[str(neg_dir / "trajectories.jsonl")])
    c = load_config(None, overrides={"data.min_samples": 300, "data.negative_weight": 3})
    res = run_prep([tmp_path / "new.jsonl"], tmp_path / "out", c, state=state, negatives=[extra], make_plots=False)
    k = res.summary["counts"]
    assert k["new_samples"] == 300 and k["negative_records"] == 41 and k["duplicates"] == 1
    carried = read_jsonl(tmp_path / "out" / "negatives.jsonl")
    assert carried[0]["_negative"] == {"file": str(neg_dir / "trajectories.jsonl"), "round": 2}
    assert carried[0]["arm"] == "candidate" and carried[-1]["_negative"]["round"] is None
    rows = [
        r for ds in ("grpo_dataset", "heldout_dataset") for r in datasets.load_from_disk(str(tmp_path / "out" / ds))
    ]
    hard = [r for r in rows if r["prompt"].startswith("hard")]
    assert len(hard) == 41 and all(r["is_negative"] and r["weight"] == 3 for r in hard)
    assert {r["negative_round"] for r in hard} == {2, None}
    assert not any(r["is_negative"] for r in rows if not r["prompt"].startswith("hard"))
    grpo = datasets.load_from_disk(str(tmp_path / "out" / "grpo_dataset"))
    n_hard = sum(grpo["is_negative"])
    assert sum(w for w, neg in zip(grpo["weight"], grpo["is_negative"]) if neg) == 3 * n_hard
    assert len(expand_by_weight(grpo)) == sum(grpo["weight"]) == res.summary["split"]["grpo_rows_weighted"]
    sel = json.loads((tmp_path / "out" / "selection.json").read_text())
    assert sel["by_source"]["negative"]["available"] == n_hard == sel["by_source"]["negative"]["selected"]
    review = read_jsonl(tmp_path / "out" / "review_queue.jsonl")
    assert not any(r["prompt"].startswith("hard") for r in review)  # the review sample is of new records only


def test_min_samples_gate(tmp_path, cfg):
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good_records(120)))
    with pytest.raises(GateRefused) as e:
        run_prep([tmp_path / "t.jsonl"], tmp_path / "out", cfg, make_plots=False)
    assert "120 new samples (need >= 500)" in str(e.value)
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["status"] == "gates_refused" and not s["gates_passed"]
    assert {g["name"]: g["passed"] for g in s["gates"]} == {
        "min_samples": False,
        "cooldown": True,
        "learning_signal": True,
    }
    assert (tmp_path / "out" / "grpo_dataset").is_dir()  # the data is still written for the next round


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("small") / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in good_records(520, seed=5)))
    return p


def test_cooldown_gate_with_simulated_clock(tmp_path, cfg, small_file):
    state = FlywheelState(last_train_time=T0.isoformat())
    with pytest.raises(GateRefused) as e:
        run_prep([small_file], tmp_path / "a", cfg, state, SimulatedClock(T0 + timedelta(hours=23)), make_plots=False)
    assert "cooldown: 1h 0m left (last training 2026-01-01T00:00Z)" in str(e.value)
    with pytest.raises(GateRefused) as e:
        run_prep(
            [small_file],
            tmp_path / "b",
            cfg,
            state,
            SimulatedClock(T0 + timedelta(hours=18, minutes=48)),
            make_plots=False,
        )
    assert "cooldown: 5h 12m left" in str(e.value)
    assert e.value.result.gates[1] == {
        "name": "cooldown",
        "passed": False,
        "detail": "cooldown: 5h 12m left (last training 2026-01-01T00:00Z)",
    }
    res = run_prep([small_file], tmp_path / "c", cfg, state, SimulatedClock(T0 + timedelta(hours=25)), make_plots=False)
    assert res.gates_passed and "25h 0m since last training" in res.gates[1]["detail"]


def test_cooldown_override_is_recorded_in_summary_and_mlflow(tmp_path, cfg, small_file, monkeypatch):
    import mlflow

    from hermes_lab.core import tracking

    uri = mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment("hermes-lab", artifact_location=(tmp_path / "art").as_uri())
    state = FlywheelState(last_train_time=T0.isoformat())
    clock = SimulatedClock(T0 + timedelta(hours=23))
    with pytest.raises(PrepError, match="needs a --reason"):
        run_prep([small_file], tmp_path / "x", cfg, state, clock, override_cooldown=True)
    with tracking.stage_run("prep", runs_dir=tmp_path) as run:
        res = run_prep(
            [small_file],
            tmp_path / "out",
            cfg,
            state,
            clock,
            override_cooldown=True,
            override_reason="hotfix for incident 42",
        )
    assert res.gates_passed and res.summary["override"] == {"cooldown": True, "reason": "hotfix for incident 42"}
    assert res.gates[1]["overridden"] and "OVERRIDDEN: hotfix for incident 42" in res.gates[1]["detail"]
    r = mlflow.MlflowClient().get_run(run.info.run_id)
    assert r.data.tags["cooldown_override"] == "true" and r.data.tags["prep.gates_passed"] == "true"
    assert r.data.params["prep.override_reason"] == "hotfix for incident 42"
    assert r.data.metrics["prep/accepted"] == 520
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert arts == {"plots/reward_by_family.png", "plots/rejects_by_reason.png", "plots/selection_by_family.png"}
    prep_arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "prep")}
    assert prep_arts >= {"prep/summary.json", "prep/selection.json"}
    sel = res.summary["selection"]  # the selection's key numbers, as prep/select_* metrics
    assert r.data.metrics["prep/select_left_out"] == sel["select_left_out"]
    assert r.data.metrics["prep/select_share_mixed"] == sel["select_share_mixed"]


def test_review_queue_stratified_deterministic(mixed, tmp_path):
    d, info, res = mixed
    q = read_jsonl(d / "out" / "review_queue.jsonl")
    n_new = res.summary["counts"]["new_samples"]
    strata = res.summary["review"]["strata"]
    assert abs(len(q) - 0.1 * n_new) <= len(strata) / 2 + 1  # ~10%, rounding per stratum
    assert {f"{r['family']}|{r['reward_band']}" for r in q} == set(strata)  # >= 1 from every non-empty stratum
    for r in q:
        assert set(r) == {
            "review_id",
            "task_id",
            "family",
            "prompt",
            "response",
            "reward",
            "reward_band",
            "simulated_label",
        }
        assert r["review_id"] == hashlib.sha1((r["task_id"] + r["prompt"] + r["response"]).encode()).hexdigest()[:12]
        band = "low" if r["reward"] < 1.5 else "high" if r["reward"] >= 3 else "mid"
        assert r["reward_band"] == band
        if r["family"] in ("unknown", "code"):  # a code task's tests run in the gate, when it simulates
            assert r["simulated_label"] is None
        else:
            assert r["simulated_label"] == tasks.verify(r["prompt"], r["response"])
    # deterministic: the same data (even reordered) and seed give the same sample; another seed another one
    p = tmp_path / "shuffled.jsonl"
    good = list(info["good"][:-1])
    random.Random(9).shuffle(good)
    p.write_text("".join(json.dumps(r) + "\n" for r in good + [info["good"][-1]]))
    c = load_config(None, overrides={"data.max_line_bytes": 2 * MIB})
    run_prep([p], tmp_path / "again", c, make_plots=False)
    assert {r["review_id"] for r in read_jsonl(tmp_path / "again" / "review_queue.jsonl")} == {
        r["review_id"] for r in q
    }
    c2 = load_config(None, overrides={"data.max_line_bytes": 2 * MIB, "data.seed": 1})
    run_prep([p], tmp_path / "seed1", c2, make_plots=False)
    assert {r["review_id"] for r in read_jsonl(tmp_path / "seed1" / "review_queue.jsonl")} != {
        r["review_id"] for r in q
    }


def test_cli_exit_codes(tmp_path, small_file):
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PY, "-m", "hermes_lab.prep", *args], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )

    ok = cli("--input", str(small_file), "--output", "out0")
    assert ok.returncode == 0, ok.stderr
    assert "520 accepted" in ok.stdout and (tmp_path / "out0" / "summary.json").exists()
    noisy = tmp_path / "noisy.jsonl"
    noisy.write_text("not json\n" * 10 + json.dumps(good_records(1)[0]) + "\n")
    bad = cli("--input", str(noisy), "--output", "out2")
    assert bad.returncode == 2 and str(noisy) in bad.stderr and "line 1: malformed JSON" in bad.stderr
    missing = cli("--input", str(tmp_path / "nope.jsonl"), "--output", "out2b")
    assert missing.returncode == 2 and "input file not found" in missing.stderr
    state = tmp_path / "state.json"
    FlywheelState(last_train_time=T0.isoformat()).save(state)
    refused = cli(
        "--input", str(small_file), "--output", "out3", "--state", str(state), "--simulated-now", "2026-01-01T23:00:00Z"
    )
    assert refused.returncode == 3 and "cooldown: 1h 0m left" in refused.stderr
    s = json.loads((tmp_path / "out3" / "summary.json").read_text())
    assert [g["passed"] for g in s["gates"]] == [True, False, True]
    forced = cli(
        "--input",
        str(small_file),
        "--output",
        "out4",
        "--state",
        str(state),
        "--set",
        "data.seed=1",
        "--simulated-now",
        "2026-01-01T23:00:00Z",
        "--override-cooldown",
        "--reason",
        "demo",
    )
    assert forced.returncode == 0, forced.stderr
    assert json.loads((tmp_path / "out4" / "summary.json").read_text())["override"]["reason"] == "demo"
    no_reason = cli("--input", str(small_file), "--output", "out5", "--override-cooldown")
    assert no_reason.returncode == 2 and "needs a --reason" in no_reason.stderr


@pytest.mark.slow
def test_notebook_runs_with_papermill(tmp_path, monkeypatch):
    import mlflow
    import papermill as pm

    uri = mlflow_db(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.create_experiment("hermes-lab", artifact_location=(tmp_path / "art").as_uri())
    runs = tmp_path / "runs"
    (runs / "round-01").mkdir(parents=True)
    (runs / "round-01" / "trajectories.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in good_records(520, seed=7)) + "{broken\n"
    )
    cfg_path = tmp_path / "params.yaml"
    cfg_path.write_text(f"round:\n  runs_dir: {runs}\ndata:\n  min_samples: 500\n")
    params = {"config_path": str(cfg_path), "round_dir": str(runs / "round-01"), "state_path": str(runs / "state.json")}
    pm.execute_notebook(
        str(REPO / "notebooks" / "10_data_prep.ipynb"),
        str(tmp_path / "ok.ipynb"),
        parameters=params,
        kernel_name="python3",
        kernel_manager_class=ForkingKernelManager,  # forked, as the round runner starts its kernels
        cwd=str(REPO),
        progress_bar=False,
    )
    s = json.loads((runs / "round-01" / "prep" / "summary.json").read_text())
    assert s["gates_passed"] and s["counts"]["accepted"] == 520 and s["counts"]["rejected"] == 1
    (run,) = mlflow.search_runs(experiment_names=["hermes-lab"], output_format="list")
    assert run.info.run_name == "prep" and run.data.metrics["prep/rejected"] == 1
    # a refused gate fails the notebook after writing the verdicts
    FlywheelState(last_train_time=T0.isoformat()).save(runs / "state.json")
    with pytest.raises(pm.PapermillExecutionError, match="cooldown"):
        pm.execute_notebook(
            str(REPO / "notebooks" / "10_data_prep.ipynb"),
            str(tmp_path / "refused.ipynb"),
            parameters={**params, "simulated_now": "2026-01-01T20:00:00+00:00"},
            kernel_name="python3",
            kernel_manager_class=ForkingKernelManager,  # forked, as the round runner starts its kernels
            cwd=str(REPO),
            progress_bar=False,
        )
    s = json.loads((runs / "round-01" / "prep" / "summary.json").read_text())
    assert s["status"] == "gates_refused" and "cooldown: 4h 0m left" in s["gates"][1]["detail"]


# --------------------------------------------------------------------------------- hardening (issue 16)
def test_an_input_that_is_one_of_prep_s_outputs_is_refused_before_anything_is_opened(tmp_path, cfg):
    """`prep --input D/accepted.jsonl --output D` used to empty the input, then refuse for lack of samples."""
    d = tmp_path / "D"
    d.mkdir()
    data = "".join(json.dumps(r) + "\n" for r in good_records(50))
    for name in ("accepted.jsonl", "review_queue.jsonl"):
        (d / name).write_text(data)
    (d / "grpo_dataset").mkdir()
    (d / "grpo_dataset" / "x.jsonl").write_text(data)
    linked = tmp_path / "elsewhere.jsonl"
    os.link(d / "accepted.jsonl", linked)  # the same file under another name
    for bad in (d / "accepted.jsonl", d / "review_queue.jsonl", d / "grpo_dataset" / "x.jsonl", linked):
        before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()}
        with pytest.raises(PrepError, match="one of prep's own outputs") as e:
            run_prep([bad], d, cfg, make_plots=False)
        assert str(bad) in str(e.value)
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in d.rglob("*") if p.is_file()} == before
        assert not (d / "summary.json").exists() and not list(d.glob(".prep-*"))
    # an input that merely lives in the output dir is read and processed, and left as it was
    own = d / "trajectories.jsonl"
    own.write_text(data)
    c = load_config(None, overrides={"data.min_samples": 1})
    res = run_prep([own], d, c, make_plots=False)
    assert res.summary["counts"]["accepted"] == 50 and own.read_text() == data


HOSTILE: list[tuple[bytes, str]] = [
    (b'{"prompt": "p", "response": "r", "reward": 1' + b"0" * 5000 + b', "task_id": "t"}', "number out of range"),
    (
        b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "n": 1' + b"0" * 5000 + b"}",
        "number out of range",
    ),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "x": 1e400}', "number out of range"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "family": "a\\udc80"}', "invalid Unicode"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "meta": {"k": ["\\ud83d"]}}', "invalid Unicode"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "\\udfff": 1}', "invalid Unicode"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "reward": 5}', "duplicate key"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "m": {"a": 1, "a": 2}}', "duplicate key"),
    (b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "family": 7}', "bad family"),
    (
        b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "deep": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}",
        "malformed JSON",
    ),
]


def test_values_python_cannot_convert_or_represent_are_rejected_with_their_line(tmp_path):
    """Huge integers, overflowing floats, lone surrogates anywhere, duplicate keys: rejects, never a traceback."""
    good = [line(r) for r in good_records(100)]
    lines = good[:50] + [b for b, _ in HOSTILE] + good[50:]
    lines.append(b'{"prompt": "p", "response": "r", "reward": 1, "task_id": "t", "e": "\\ud83d\\ude00 ok"}')  # a pair
    p = tmp_path / "hostile.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    c = load_config(None, overrides={"data.min_samples": 1})
    res = run_prep([p], tmp_path / "out", c, make_plots=True)
    rejects = read_jsonl(tmp_path / "out" / "rejects.jsonl")
    assert {r["line"]: r["reason"] for r in rejects} == {51 + i: reason for i, (_, reason) in enumerate(HOSTILE)}
    assert all(r["detail"] for r in rejects)
    k = res.summary["counts"]
    assert k["read"] == k["accepted"] + k["rejected"] + k["duplicates"] and k["accepted"] == 101
    for name in ("accepted.jsonl", "review_queue.jsonl", "outliers.jsonl"):
        for x in (tmp_path / "out" / name).read_text(encoding="utf-8").splitlines():
            json.loads(x)  # every written line reads back as strict JSON
            assert "Infinity" not in x and "NaN" not in x


def test_family_text_that_breaks_plots_or_metric_names_is_kept_in_the_data(tmp_path, mlflow_store):
    """'$\\foo$' broke the mathtext of the plots and 'c++' the MLflow metric names later in the round."""
    import datasets

    from hermes_lab.core import tracking
    from hermes_lab.review import gate as review

    fams = ["c++", r"$\notacommand$", "$x^2$", "a/b", "..", "_hidden", "x" * 300]
    recs = [
        {"prompt": f"q{i}", "response": "a", "reward": float(i % 6), "task_id": f"t{i}", "family": fams[i % len(fams)]}
        for i in range(140)
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = load_config(None, overrides={"data.min_samples": 1, "data.review_fraction": 0.5})
    with tracking.stage_run("prep", runs_dir=tmp_path):
        res = run_prep([tmp_path / "t.jsonl"], tmp_path / "out", c, make_plots=True)
    assert Path(res.paths["plot_rewards"]).stat().st_size > 1000
    rows = datasets.load_from_disk(str(tmp_path / "out" / "grpo_dataset"))["family"]
    assert set(rows) <= set(fams) and r"$\notacommand$" in rows  # the data keeps the original text
    assert set(res.summary["families"]) == set(fams)
    queue, labels = tmp_path / "out" / "review_queue.jsonl", review.LabelStore(tmp_path / "labels.jsonl")
    labels.append_many(
        [labels.make_record(it["review_id"], "alice", round(it["reward"])) for it in review.load_queue(queue)]
    )
    with tracking.stage_run("review", runs_dir=tmp_path) as run:  # the review gate logs a metric per family
        gate = review.review_gate(queue, labels.path, c, simulate=False)
    assert set(gate.per_family) <= set(fams)
    metrics = mlflow_store.MlflowClient().get_run(run.info.run_id).data.metrics
    assert len([m for m in metrics if m.startswith("review/agreement_")]) == len(gate.per_family) >= 3


def test_gzip_inputs_are_read_transparently(tmp_path):
    import gzip

    recs = good_records(80)
    plain = b"".join(line(r) + b"\n" for r in recs)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(plain))
    c = load_config(None, overrides={"data.min_samples": 1})
    res = run_prep([tmp_path / "t.jsonl.gz"], tmp_path / "out", c, make_plots=False)
    assert res.summary["counts"]["accepted"] == 80
    assert (tmp_path / "out" / "accepted.jsonl").read_bytes() == plain
    cut = gzip.compress(plain)[:-300]  # a logger killed mid-write: what was compressed is kept, the rest named
    (tmp_path / "cut.jsonl.gz").write_bytes(cut)
    res = run_prep([tmp_path / "cut.jsonl.gz"], tmp_path / "out2", c, make_plots=False)
    k = res.summary["counts"]
    assert k["lines"] == k["blank"] + k["read"] and k["read"] == k["accepted"] + k["rejected"] + k["duplicates"]
    assert "corrupt gzip stream" in res.summary["by_reason"] and 0 < k["accepted"] < 80


def _synthetic(path: Path, n: int) -> None:
    """n records, ~150 bytes each: many prompts, repeats, negatives of the same prompts, outliers, families."""
    rng = random.Random(4)
    with open(path, "w") as f:
        for i in range(n):
            j = rng.randrange(n // 3)
            reward = 0.0 if i % 97 == 0 else round(3 + rng.random(), 2)
            rec = {"prompt": f"Summarise ticket #{j} in one line.", "response": f"ok {rng.randrange(9)}"}
            rec |= {"reward": reward, "task_id": f"ticket-{j % 5000}", "family": ["a", "b", "c++"][j % 3]}
            f.write(json.dumps(rec) + "\n")


@pytest.mark.slow
def test_prep_in_partitions_gives_the_same_outputs(tmp_path):
    """data.memory_budget_mb small enough to split the prompts into partitions: the outputs do not change."""
    import datasets

    _synthetic(tmp_path / "t.jsonl", 90_000)
    (tmp_path / "round-02").mkdir()
    _synthetic(tmp_path / "round-02" / "neg.jsonl", 3000)
    outs = {}
    for budget in (512, 64):
        c = load_config(None, overrides={"data.min_samples": 1, "data.memory_budget_mb": budget})
        res = run_prep(
            [tmp_path / "t.jsonl"], tmp_path / f"out{budget}", c, negatives=[tmp_path / "round-02" / "neg.jsonl"]
        )
        outs[budget] = res.summary
    assert outs[512]["memory"]["partitions"] == 1 and outs[64]["memory"]["partitions"] > 1
    for name in ("accepted", "negatives", "duplicates", "rejects", "outliers", "review_queue", "left_out"):
        a, b = (tmp_path / f"out{x}" / f"{name}.jsonl" for x in (512, 64))
        assert a.read_bytes() == b.read_bytes(), name
    for name in ("grpo_dataset", "heldout_dataset"):
        a, b = (datasets.load_from_disk(str(tmp_path / f"out{x}" / name)) for x in (512, 64))
        assert a.to_list() == b.to_list() and a.features == b.features, name
    for key in ("counts", "split", "review", "outliers", "families", "by_reason", "selection"):
        assert outs[512][key] == outs[64][key], key
    assert outs[64]["selection"]["select_left_out"] > 0  # the cap's threshold holds across partitions
    assert outs[64]["counts"]["negative_records"] > 0 and outs[64]["outliers"]["count"] > 0


def test_sorted_spill_writes_every_line_in_key_order_across_buckets(tmp_path):
    from hermes_lab.prep.distill import SortedSpill

    rng = random.Random(0)
    keys = rng.sample(range(1 << 50), 5000)
    spill = SortedSpill(tmp_path, "s", 1 << 50, est_bytes=5000 * 20, budget_bytes=4000)
    assert spill.n > 8
    for k in keys:
        spill.add(k, json.dumps({"k": k, "t": "tab\there\nnewline"}))
    assert spill.write_sorted(tmp_path / "out.jsonl") == 5000
    got = [json.loads(x)["k"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got == sorted(keys) and not list(tmp_path.glob("s-*"))


def test_memory_budget_and_line_cap_are_checked_in_the_config():
    from hermes_lab.config.schema import ConfigError

    with pytest.raises(ConfigError, match="data.memory_budget_mb"):
        load_config(None, overrides={"data.memory_budget_mb": 8})
    with pytest.raises(ConfigError, match="data.max_line_bytes"):
        load_config(None, overrides={"data.max_line_bytes": 100})


# ------------------------------------------------------------------------------------------ selection
def _grouped_records(seed: int = 0) -> list[dict]:
    """Embedded prompts logged several times each: mixed, all-pass (equal rewards: zero std), all-fail
    (partial credit: rewards differ) and one-sample prompts, in shuffled order."""
    rng = random.Random(seed)
    pool = tasks.generate_tasks(400, split="any", seed=seed + 11)
    uniq = list({t.prompt: t for t in pool}.values())
    kinds = ["mixed"] * 40 + ["all_pass"] * 60 + ["all_fail"] * 60 + ["single"] * 50
    out = []
    for t, kind in zip(uniq, kinds):
        n = 1 if kind == "single" else rng.choice([2, 3, 4])
        passes = {"mixed": rng.randrange(1, n) if n > 1 else 0, "all_pass": n, "all_fail": 0}.get(
            kind, rng.randrange(2)
        )
        for k in range(n):
            resp = t.answer if k < passes else f"{tasks.corrupt(t.answer, rng)}{k}"
            out.append(
                {"prompt": t.prompt, "response": resp, "reward": tasks.verify(t.prompt, resp), "task_id": t.task_id}
            )
    rng.shuffle(out)
    return out


def _outcome_of(rewards: list[float]) -> str:
    p = sum(r >= 3 for r in rewards)
    return "single" if len(rewards) == 1 else "all_pass" if p == len(rewards) else "all_fail" if p == 0 else "mixed"


def test_selection_weights_mixed_groups_caps_uniform_ones_and_lists_what_it_left_out(tmp_path):
    import datasets

    recs = _grouped_records()
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = load_config(None, {"data.min_samples": 1, "data.uniform_share": 0.2, "data.mixed_weight": 3})
    res = run_prep([tmp_path / "t.jsonl"], tmp_path / "out", c)
    grpo = datasets.load_from_disk(str(tmp_path / "out" / "grpo_dataset")).to_list()
    by_prompt: dict[str, list[float]] = {}
    for r in recs:
        by_prompt.setdefault(r["prompt"], []).append(r["reward"])
    for row in grpo:  # the outcome columns, recomputed from the raw file (duplicate lines are samples too)
        rw = by_prompt[row["prompt"]]
        assert row["n_samples"] == len(rw) >= row["n_logged"]
        assert row["outcome"] == _outcome_of(rw) and row["n_pass"] == sum(r >= 3 for r in rw)
        assert row["zero_std"] == (len(rw) > 1 and len(set(rw)) == 1)
        assert abs(row["reward_std"] - float(np_std(rw))) < 1e-9
    w = {o: sum(r["weight"] for r in grpo if r["outcome"] == o) for o in ("mixed", "single", "all_pass", "all_fail")}
    n_mixed = sum(r["outcome"] == "mixed" for r in grpo)
    assert w["mixed"] == 3 * n_mixed and w["single"] == sum(r["outcome"] == "single" for r in grpo)
    uniform = [r for r in grpo if r["outcome"] in ("all_pass", "all_fail")]
    kept = [r for r in uniform if r["selected"]]
    other = w["mixed"] + w["single"]
    assert len(kept) == int(0.2 / 0.8 * other) < len(uniform)  # the cap binds here
    assert (w["all_pass"] + w["all_fail"]) / sum(r["weight"] for r in grpo) <= 0.2
    left = read_jsonl(tmp_path / "out" / "left_out.jsonl")  # nothing lost: every left-out prompt, with why
    assert sorted(x["prompt"] for x in left) == sorted(r["prompt"] for r in uniform if not r["selected"])
    assert all(r["weight"] == 0 and r["selection"] == "left_out" for r in uniform if not r["selected"])
    assert all("zero-signal" in x["reason"] and x["outcome"] in ("all_pass", "all_fail") for x in left)
    ds = datasets.load_from_disk(str(tmp_path / "out" / "grpo_dataset"))
    assert len(expand_by_weight(ds)) == sum(ds["weight"]) == res.summary["split"]["grpo_rows_weighted"]
    rep = json.loads((tmp_path / "out" / "selection.json").read_text())
    t = rep["totals"]
    assert (t["mixed"], t["left_out"], t["available"]) == (n_mixed, len(left), len(grpo))
    grouped = [r for r in grpo if r["n_samples"] > 1]
    assert t["frac_reward_zero_std"] == round(sum(r["zero_std"] for r in grouped) / len(grouped), 4)
    assert sum(f["available"] for f in rep["by_family"].values()) == len(grpo)
    for fam, f in rep["by_family"].items():
        rows = [r for r in grpo if r["family"] == fam]
        assert f["mixed"] == sum(r["outcome"] == "mixed" for r in rows) and f["weight"] == sum(
            r["weight"] for r in rows
        )
    assert abs(sum(t["weight_share"].values()) - 1) < 1e-3 and t["weight_share"]["mixed"] > 0.4
    assert (tmp_path / "out" / "plots" / "selection_by_family.png").stat().st_size > 5000
    # the same records in another order select the same prompts (a seeded hash, not the input order)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(recs)))
    run_prep([tmp_path / "r.jsonl"], tmp_path / "out2", c, make_plots=False)
    again = datasets.load_from_disk(str(tmp_path / "out2" / "grpo_dataset")).to_list()
    assert {r["prompt"] for r in again if r["selected"]} == {r["prompt"] for r in grpo if r["selected"]}
    # select: all is every prompt once
    c_all = load_config(None, {"data.min_samples": 1, "data.select": "all"})
    res = run_prep([tmp_path / "t.jsonl"], tmp_path / "out3", c_all, make_plots=False)
    every = datasets.load_from_disk(str(tmp_path / "out3" / "grpo_dataset"))
    assert set(every["weight"]) == {1} and all(every["selected"]) and res.summary["selection"]["select_left_out"] == 0
    assert not (tmp_path / "out3" / "left_out.jsonl").read_text()
    # the held-out set is the regression set: no selection there, the same rows under either mode
    held = datasets.load_from_disk(str(tmp_path / "out" / "heldout_dataset")).to_list()
    assert held == datasets.load_from_disk(str(tmp_path / "out3" / "heldout_dataset")).to_list()
    assert any(r["outcome"] in ("all_pass", "all_fail") for r in held)  # uniform groups kept there
    assert all(r["weight"] == 1 and r["selected"] and r["selection"] == "heldout" for r in held)
    assert not {r["prompt"] for r in held} & {x["prompt"] for x in left}
    assert rep["heldout_prompts"] == len(held) > 0


def np_std(x: list[float]) -> float:
    import numpy as np

    return float(np.std(np.asarray(x)))


def test_selection_groups_gateway_traffic_by_prompt_text(tmp_path):
    """A real user's traffic: a gateway log dir, rewards from the feedback log, no task_id from the client."""
    from hermes_lab.live import log as L

    d = tmp_path / "live" / "exp"
    d.mkdir(parents=True)
    base = {"unit": "u", "arm": "baseline", "model": "m", "stage": 0, "ratio": 0.5, "t": 1.0, "status": "ok"}
    # a repeated answer is a duplicate line (one accepted record), and a sample of its prompt's group
    asks = [("Translate 'chat' to English.", ["cat", "Cat", "dog"]), ("Capital of France?", ["Paris"] * 3)]
    asks += [("Spell 'necessary'.", ["neccessary", "necesary"]), ("2+2?", ["4"])]
    reqs, fb, i = [], [], 0
    for prompt, answers in asks:
        for a in answers:
            i += 1
            ok = a.lower() in ("cat", "paris", "4", "necessary")
            reqs.append(
                base | {"request_id": f"r{i}", "prompt": prompt, "response": a, "latency_ms": 3.0, "messages": []}
            )
            fb.append({"request_id": f"r{i}", "reward": 5.0 if ok else 1.0, "source": "system"})
    (d / L.REQUESTS).write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (d / L.FEEDBACK).write_text("".join(json.dumps(r) + "\n" for r in fb))
    c = load_config(None, {"data.min_samples": 1, "data.holdout_fraction": 0.0, "data.uniform_share": 1.0})
    run_prep([d], tmp_path / "prep", c, make_plots=False)
    import datasets

    rows = {r["prompt"]: r for r in datasets.load_from_disk(str(tmp_path / "prep" / "grpo_dataset")).to_list()}
    assert {p: (r["outcome"], r["n_samples"], r["weight"]) for p, r in rows.items()} == {
        "Translate 'chat' to English.": ("mixed", 3, 2),
        "Capital of France?": ("all_pass", 3, 1),
        "Spell 'necessary'.": ("all_fail", 2, 1),
        "2+2?": ("single", 1, 1),
    }
    assert rows["Capital of France?"]["zero_std"] and not rows["Translate 'chat' to English."]["zero_std"]
    assert rows["Capital of France?"]["n_logged"] == 1  # one record (two duplicate lines), three samples
    rep = json.loads((tmp_path / "prep" / "selection.json").read_text())
    assert rep["by_family"]["unknown"]["available"] == 4 and rep["totals"]["frac_reward_zero_std"] == round(2 / 3, 4)


def test_gain_by_family_joins_training_weight_with_the_held_out_gain():
    from hermes_lab.prep.selection import gain_by_family

    rep = {
        "by_family": {
            "add": {"weight_share": 0.6, "mixed": 30, "left_out": 2, "weight": 60},
            "upper": {"weight_share": 0.4, "mixed": 5, "left_out": 9, "weight": 40},
            "unknown": {"weight_share": 0.0, "mixed": 0, "left_out": 0, "weight": 0},
        }
    }
    pf = lambda **kv: {"per_family": {f: {"pass_rate": v} for f, v in kv.items()}}  # noqa: E731
    ev = {"before": pf(add=0.30, upper=0.50, reverse=0.2), "after": pf(add=0.45, upper=0.49, reverse=0.3)}
    g = gain_by_family(rep, ev)
    assert list(g) == ["add", "upper", "unknown", "reverse"]  # by training weight, families only eval knows last
    assert g["add"] == {"weight_share": 0.6, "mixed": 30, "left_out": 2, "before": 0.3, "after": 0.45, "gain": 15.0}
    assert g["upper"]["gain"] == -1.0 and g["unknown"]["gain"] is None  # a user's own family: no held-out eval
    assert g["reverse"]["weight_share"] is None and g["reverse"]["gain"] == 10.0


# ----------------------------------------------------------------- columns and workers (issue 45) = line by line
def _outputs(out: Path) -> dict:
    import datasets

    files = {n: (out / f"{n}.jsonl").read_bytes() for n in ("accepted", "duplicates", "rejects", "outliers")}
    files["review"] = sorted((out / "review_queue.jsonl").read_text().splitlines())
    for name in ("grpo_dataset", "heldout_dataset", "conversations"):
        if any((out / name).glob("*.arrow")):
            files[name] = datasets.load_from_disk(str(out / name)).to_list()
    s = json.loads((out / "summary.json").read_text())
    files["counts"] = s["counts"], s["by_reason"], s["families"], s["split"], s["conversations"]["reward_sources"]
    return files


def test_seed_lines_in_columns_give_what_line_by_line_gives(tmp_path, monkeypatch):
    """The column path (hermes_lab.prep.seed: Arrow's reader, checks in columns) against the per-line path on the
    same hostile mix (the fuzz test's lines between valid records, a lone `null` line: Arrow's reader crashes on
    one, so none reaches it): every output byte for byte, every count."""
    from hermes_lab.prep import seed

    from test_prep_fuzz import make_line

    rng = random.Random(45)
    good = good_records(400, seed=45)
    raw = []
    for i, rec in enumerate(good):
        raw.append(line(rec) + (b"\r" if i % 9 == 0 else b""))
        if i % 3 == 0:
            raw.append(make_line(rng.randrange(2**32)))
        if i % 40 == 0:
            raw += [line(rec), b"null", line({**rec, "task_id": 1000 + i}), line({**rec, "family": ""})]
    p = tmp_path / "mix.jsonl"
    p.write_bytes(b"\n".join(raw) + b"\n")
    c = load_config(None, overrides={"data.min_samples": 1, "data.max_bad_fraction": 1.0, "data.max_line_bytes": 16384})
    run_prep([p], tmp_path / "cols", c, make_plots=False)
    monkeypatch.setattr(seed, "fast_block", lambda data: False)  # every line through lines.decode / check_record
    run_prep([p], tmp_path / "lines", c, make_plots=False)
    a, b = _outputs(tmp_path / "cols"), _outputs(tmp_path / "lines")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    k = a["counts"][0]
    assert k["read"] == k["accepted"] + k["rejected"] + k["duplicates"] and k["rejected"] > 50 and k["accepted"] > 400


def test_conversation_lines_in_worker_processes_give_what_one_process_gives(tmp_path, monkeypatch):
    """A conversation file past PARALLEL_MIN is converted by worker processes (fork, each reading its byte range,
    results taken in order): the same outputs as one process, rejects and duplicates included; a line over
    data.max_line_bytes inside a range, one longer than a task's bytes (the block reader from there on), a BOM,
    a CR and a last line without its newline."""
    from hermes_lab.prep import conversations

    fix = FIXTURES / "hermes"
    good = [x for x in (fix / "batch_trajectories.jsonl").read_bytes().splitlines() if x.strip()]
    hostile = __import__("gzip").decompress((fix / "hostile.jsonl.gz").read_bytes()).splitlines()
    raw = []
    for i in range(300):
        rec = json.loads(good[i % len(good)])
        rec["conversations"][1]["value"] += f" (run {i})"
        raw.append(json.dumps(rec).encode())
        if i % 25 == 0:
            raw += [hostile[(i // 25) % 4], raw[-1], b""]  # a hostile line, an exact duplicate, a blank line
        if i in (40, 250):  # over data.max_line_bytes, within a task's 64 KiB and past them
            rec["conversations"][1]["value"] += "x" * (30_000 if i == 40 else 90_000)
            raw.append(json.dumps(rec).encode())
    raw[0], raw[5] = b"\xef\xbb\xbf" + raw[0], raw[5] + b"\r"
    p = tmp_path / "traj.jsonl"
    p.write_bytes(b"\n".join(raw))
    over = {"data.min_samples": 1, "data.max_bad_fraction": 1.0, "data.max_line_bytes": 40_000}
    c = load_config(None, overrides={**over, "conversations.no_signal": "warn"})  # outcome rewards only: it warns
    monkeypatch.setattr(conversations, "PARALLEL_MIN", 1)
    monkeypatch.setattr(conversations, "TASK_BYTES", 64 << 10)  # many tasks in flight
    res = run_prep([p], tmp_path / "workers", c, make_plots=False)
    monkeypatch.setattr(conversations, "PARALLEL_MIN", 1 << 60)
    run_prep([p], tmp_path / "one", c, make_plots=False)
    a, b = _outputs(tmp_path / "workers"), _outputs(tmp_path / "one")
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]]
    k = res.summary["counts"]
    assert (k["accepted"], k["duplicates"], k["rejected"], k["blank"]) == (300, 12, 14, 12)
    assert res.summary["by_reason"]["line too long"] == 2


def test_fast_decode_reads_what_the_exact_decoder_reads():
    """lines.decode reads a line with orjson and its checks on the bytes (key count, nesting, a float where a
    long integer may hide) and gives the rest to the exact decoder: on the fuzz test's hostile lines and
    conversation-shaped ones (nesting around the limit, shallow lines with many brackets, a key twice deep down,
    integers past 64 bits beside floats, an escaped colon), the same value (its JSON, ints and floats apart) or
    the same reject as the exact decoder alone."""
    from hermes_lab.logs.lines import EXACT, Bad, decode, decode_exact, fast_decode

    from test_prep_fuzz import make_line

    turn = '{"from": "gpt", "value": "a: b"}'
    lines = [make_line(seed) for seed in range(3000)]
    lines += [('{"a": ' * d + "1" + "}" * d).encode() for d in (498, 499, 500, 501, 990, 1023)] + [
        ("[" * d + "]" * d).encode() for d in (500, 501, 1024)
    ]
    lines += [
        ('{"conversations": [' + ", ".join([turn] * 300) + "]}").encode(),  # 600+ brackets, shallow
        ('{"c": [' + ", ".join(["[1, 2.5]"] * 400) + "]}").encode(),
        b'{"a": {"b": [{"c": 1, "c": 2}]}, "d": "x:y"}',
        b'{"a": {"b": [{"c": 1, "d\\u003a": 2, "c": 3}]}}',
        b'{"a": [1.5, 123456789012345678901234]}',
        b'{"a": [1, 123456789012345678901234]}',
        b'{"a": 18446744073709551615, "b": 18446744073709551616, "c": 0.5}',
        b'{"a": -9223372036854775809}',
        b'{"a": "' + b"1" * 30 + b'", "b": 2.0}',
        b'{"a": 1e400}',
        b'{"k": "\\ud800"}',
        '{"k": "é:日本", "é": {"x": "\u2028"}}'.encode(),
    ]

    def read(fn, text):
        try:
            return "ok", json.dumps(fn(text))
        except Bad as e:
            return "bad", e.reason, e.detail

    exact_paths = 0
    for raw in lines:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert fast_decode(raw) is EXACT  # orjson refuses it too: the reject names the bytes
            continue
        exact_paths += fast_decode(raw) is EXACT
        assert read(lambda t, raw=raw: decode(t, raw), text) == read(decode_exact, text), raw[:200]
    assert 200 < exact_paths < len(lines) - 800


def test_fast_decode_around_a_known_text_answers_as_on_the_whole_line():
    """A worker scans a Hermes line around its run's system turn (``fast_decode``'s ``known``, the bytes it found
    in an earlier line): the same answer as on the whole line, for known texts that hold colons, an escaped colon,
    a run of 19 digits or neither, around the fuzz test's hostile lines and keys twice before and after it, and
    the whole line's checks where the text is not at its offset."""
    from hermes_lab.logs.lines import EXACT, fast_decode, known_text

    from test_prep_fuzz import make_line

    texts = [b'"plain system prompt"', b'"a: b: c"', b'"x\\u003ay"', b'"id 1234567890123456789012"', b'"\\u003c b"']
    hostile = [make_line(seed) for seed in range(400)] + [b'{"a": 1, "a": 2}', b'{"a": 123456789012345678901.5}']
    checked = exact = 0
    for text in texts:
        known = known_text(text)
        assert known is not None and known[1] == 0
        head = b'{"conversations": [{"from": "system", "value": '
        known = (text, len(head), *known[2:])
        for k, rest in enumerate(hostile):
            for line in (
                head + text + b'}], "x": ' + rest + b"}",
                head + text + b'}], "x": 1, "x": ' + rest + b"}",
                b'{"conversations": [{"from": "system", "value": ' + text + b', "from": "gpt"}]}',
                b'{"conversations": [{"from": "human", "value": ' + text + b"}]}",  # not at the offset
                head[:-1] + b"  " + text + b"}]}",
            ):
                plain, around = fast_decode(line), fast_decode(line, known)
                assert (plain is EXACT) == (around is EXACT), (text, k, line[:300])
                assert plain is EXACT or plain == around
                checked += 1
                exact += plain is EXACT
    assert checked == 5 * 5 * len(hostile) and 0 < exact < checked
    assert known_text(b"no quotes") is None and known_text(b'"') is None


def test_conversation_rows_from_dicts_are_the_rows_from_text():
    """A worker builds its conversations/ rows with pa.array from the row dicts, one process with Arrow's JSON
    reader from their text: the same table on Hermes trajectories, OpenAI lines (tool calls, reasoning, odd but
    accepted numbers, U+2028), and a value pa.array refuses (then the text path)."""
    from hermes_lab.prep.conversation_worker import LineWork, convert, dict_rows, row_table

    c = load_config(None)
    fix = FIXTURES / "hermes"
    out = []
    for name, fmt in (("batch_trajectories.jsonl", "hermes_trajectory"), ("trajectory_samples.jsonl",
                      "hermes_trajectory"), ("compressed_trajectories.jsonl", "hermes_trajectory"),
                      ("openai_messages.jsonl", "openai")):  # fmt: skip
        w = LineWork(fmt=fmt, file=name, role="input", round_no=None, scale=5.0, feedback={},
                     max_chars=c.conversations.max_message_chars, rules=c.conversations)  # fmt: skip
        lines = [x for x in (fix / name).read_bytes().splitlines() if x.strip()]
        base = {"messages": [{"role": "user", "content": "hi\u2028"}, {"role": "assistant", "content": "yo"}]}
        odd = [dict(base, id=f"odd-{i}", **x) for i, x in enumerate([{"api_calls": 1.0}, {"reward": 3},
               {"end_reason": "stop", "completed": False}, {"model": "m", "meta": {"n": 2**70}}])]  # fmt: skip
        lines += [json.dumps(o).encode() for o in odd] if fmt == "openai" else []
        for k, line in enumerate(lines):
            w.as_dict = True
            res = convert(w, k + 1, line)
            w.as_dict = False
            if res[0] == "item":
                out.append((res[1][9], convert(w, k + 1, line)[1][9]))
    dicts, texts = [d for d, _ in out], [t for _, t in out]
    assert len(out) >= 15 and any(b"\\u2028" in t for t in texts)
    assert dict_rows(dicts).equals(row_table(texts))
    refused = [dict(dicts[0], outcome=dict(dicts[0]["outcome"], api_calls="3"))]  # pa.array refuses a text int
    with pytest.raises(Exception, match="int64"):
        dict_rows(refused)


def test_prompt_rows_are_the_sums_of_their_records(tmp_path):
    """The prompt sets' numbers, summed in columns (distill), against a plain loop over accepted.jsonl and the
    duplicates: per prompt its logged records, samples (duplicates counted), passes, mean, reference, task_id."""
    from datasets import load_from_disk

    rng = random.Random(7)
    recs = []
    for _ in range(900):
        p = f"Summarise ticket #{rng.randrange(60)} in one line."
        recs.append({"prompt": p, "response": f"r{rng.randrange(6)}", "reward": float(rng.randrange(6)),
                     "task_id": f"t{rng.randrange(80)}"})  # fmt: skip
    f = tmp_path / "g.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = load_config(None, overrides={"data.min_samples": 1, "data.holdout_fraction": 0.3})
    run_prep([f], tmp_path / "out", c, make_plots=False)
    out = tmp_path / "out"
    rows = {r["prompt"]: r for n in ("grpo_dataset", "heldout_dataset") for r in load_from_disk(str(out / n)).to_list()}
    acc = [json.loads(x) for x in (out / "accepted.jsonl").read_text().splitlines()]
    copies = {}
    for d in (json.loads(x) for x in (out / "duplicates.jsonl").read_text().splitlines()):
        copies[d["duplicate_of"]] = copies.get(d["duplicate_of"], 0) + 1
    seen = {}
    for r in acc:
        origin = f"{f}:{recs.index(r) + 1}"
        g = seen.setdefault(r["prompt"], {"n": 0, "ns": 0, "pass": 0, "total": 0.0, "ref": None, "rmax": -1})
        k = 1 + copies.get(origin, 0)
        g["n"] += 1
        g["ns"] += k
        g["pass"] += k * (r["reward"] >= c.reward.success_threshold)
        g["total"] += r["reward"]
        if r["reward"] > g["rmax"]:
            g["ref"], g["rmax"] = r["response"], r["reward"]
    assert set(rows) == set(seen)
    for p, g in seen.items():
        row = rows[p]
        assert (row["n_logged"], row["n_samples"], row["n_pass"]) == (g["n"], g["ns"], g["pass"])
        assert row["mean_logged_reward"] == g["total"] / g["n"] and (row["reference"], row["ref_reward"]) == (
            g["ref"],
            g["rmax"],
        )
