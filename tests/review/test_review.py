"""Review stage: the label store, the ipywidgets labeller (driven with Button.click(), no browser), the
agreement statistics, the gate, MLflow logging (real SQLite store) and the gate notebook (real papermill).

A headless-browser render of the labeller in JupyterLab is not part of this suite.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hermes_lab.config.schema import load_config
from hermes_lab.core.kernels import ForkingKernelManager
from hermes_lab.review import gate as review
from hermes_lab.review.app import ReviewApp
from hermes_lab.tasks.suite import corrupt, generate_tasks, verify

from repo_paths import REPO


def make_queue(
    path: Path, n: int = 12, seed: int = 0, response_override: dict[int, str] | None = None, reward_fn=None
) -> list[dict]:
    """A prep-style queue over real embedded tasks: every other response is a corrupted answer."""
    import random

    rng = random.Random(seed)
    recs = []
    for i, t in enumerate(generate_tasks(n, seed=seed)):
        resp = t.answer if i % 2 == 0 else corrupt(t.answer, rng)
        resp = (response_override or {}).get(i, resp)
        reward = verify(t.prompt, resp) if reward_fn is None else reward_fn(i, t, resp)
        rid = hashlib.sha1(f"{t.task_id}{t.prompt}{resp}".encode()).hexdigest()[:12]
        recs.append(
            {
                "review_id": rid,
                "task_id": t.task_id,
                "family": t.family,
                "prompt": t.prompt,
                "response": resp,
                "reward": reward,
                "reward_band": "high" if reward >= 3 else "low",
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return recs


@pytest.fixture
def queue(tmp_path):
    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    return q, make_queue(q)


def live(store_path) -> dict:
    return review.current_labels(review.read_labels(store_path).records)


# ---------------------------------------------------------------------------------------- the labeller
def test_click_writes_fsynced_line_and_reopen_resumes(queue, tmp_path):
    q, recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="alice")
    assert app.index == 0 and app.buttons[0].tooltip and "0" in app.buttons[0].description
    app.buttons[5].click()
    app.note.value = "near miss"
    app.buttons[2].click()
    lines = store.read_text().splitlines()
    assert len(lines) == 2  # on disk at once: one line per click
    second = json.loads(lines[1])
    assert (second["review_id"], second["label"], second["note"], second["simulated"]) == (
        recs[1]["review_id"],
        2.0,
        "near miss",
        False,
    )
    assert app.progress.value == 2 and app.index == 2

    # "kernel restart": a new app over the same store resumes at alice's next unlabelled item
    app2 = ReviewApp(q, store, reviewer="alice")
    assert app2.index == 2 and app2.progress.value == 2
    assert recs[2]["prompt"] in app2.prompt_html.value
    # another reviewer starts from the top
    assert ReviewApp(q, store, reviewer="bob").index == 0


def test_truncated_last_line_is_reported_and_repaired(queue, tmp_path):
    q, _recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="alice")
    app.buttons[5].click()
    app.buttons[1].click()
    with open(store, "ab") as f:  # the kernel died in the middle of the third write
        f.write(b'{"label_id": "abc", "review_id": "x", "revi')
    with pytest.warns(UserWarning, match="truncated last line"):
        loaded = review.read_labels(store)
    assert loaded.truncated and len(loaded.records) == 2

    with pytest.warns(UserWarning):
        app2 = ReviewApp(q, store, reviewer="alice")
    assert "truncated" in app2.message and app2.index == 2
    app2.buttons[4].click()  # the next write starts on a clean line
    loaded = review.read_labels(store)
    assert not loaded.truncated and [r["label"] for r in loaded.records] == [5.0, 1.0, 4.0]
    assert (tmp_path / "labels.jsonl.torn").read_bytes().startswith(b'{"label_id": "abc"')


def test_corrupt_middle_line_is_quarantined_and_the_store_keeps_working(queue, tmp_path):
    """A corrupt line in the middle (a bad merge, a hand edit) no longer makes the whole store unreadable."""
    q, recs = queue
    store = tmp_path / "labels.jsonl"
    s = review.LabelStore(store)
    s.append(recs[0]["review_id"], "alice", 5)
    with open(store, "ab") as f:
        f.write(b'garbage \xff{"label_id"\n{"not": "a label"}\n')
    s.append(recs[1]["review_id"], "alice", 1)
    before = store.read_bytes()
    with pytest.warns(UserWarning, match=r"labels.jsonl:2 \(not valid JSON\).*labels.jsonl:3 \(not a label record"):
        loaded = review.read_labels(store)
    assert [r["label"] for r in loaded.records] == [5.0, 1.0] and not loaded.truncated
    assert [b["line"] for b in loaded.quarantined] == [2, 3]
    quarantine = tmp_path / "labels.jsonl.quarantine"
    rows = [json.loads(x) for x in quarantine.read_text().splitlines()]
    assert [(r["file"], r["line"]) for r in rows] == [(str(store), 2), (str(store), 3)]
    assert "\\xff" in rows[0]["raw"] and rows[1]["raw"] == '{"not": "a label"}'  # the raw bytes, visible
    assert store.read_bytes() == before  # the store is not rewritten
    with pytest.warns(UserWarning, match="corrupt"):
        s2 = review.LabelStore(store)  # loading again does not quarantine the same lines twice
    assert len(quarantine.read_text().splitlines()) == 2 and "labels.jsonl:2" in s2.recovered
    s2.append(recs[2]["review_id"], "alice", 4)  # and appends go on
    with pytest.warns(UserWarning):
        assert [r["label"] for r in review.read_labels(store).records] == [5.0, 1.0, 4.0]
    with pytest.warns(UserWarning):
        app = ReviewApp(q, store, reviewer="alice")
    assert app.index == 3 and "corrupt" in app.message


def test_undo_appends_tombstone_and_goes_back(queue, tmp_path):
    q, recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="alice")
    app.buttons[5].click()
    app.buttons[0].click()
    before = store.read_bytes()
    app.undo_button.click()
    undone = review.read_labels(store).records[-1]
    assert store.read_bytes().startswith(before)  # nothing rewritten
    assert undone["undo_of"] and undone["label"] is None
    assert app.index == 1 and app.progress.value == 1
    assert set(live(store)) == {(recs[0]["review_id"], "alice")}
    app.buttons[3].click()  # relabel the undone item
    assert live(store)[(recs[1]["review_id"], "alice")]["label"] == 3.0
    # undo again twice walks back through the history, across "restarts"
    app2 = ReviewApp(q, store, reviewer="alice")
    app2.undo()
    app2.undo()
    assert live(store) == {} and app2.index == 0 and app2.undo() is None
    assert len(store.read_text().splitlines()) == 6


def test_skip_comes_back_later(queue, tmp_path):
    q, recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="alice")
    app.skip_button.click()
    assert app.index == 1 and not store.exists()  # a skip is not a label
    for _ in range(len(recs) - 1):
        app.buttons[4].click()
    assert app.index == 0  # the skipped item comes back once the rest is done
    app.buttons[4].click()
    assert app.index is None and "All 12 items" in app.header.value
    assert all(b.disabled for b in app.buttons.values())


def test_untrusted_output_is_escaped_and_reward_hidden(tmp_path):
    q = tmp_path / "prep" / "review_queue.jsonl"
    evil = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    make_queue(q, n=3, response_override={0: evil}, reward_fn=lambda i, t, r: 4.321)
    app = ReviewApp(q, tmp_path / "l.jsonl", reviewer="alice")
    shown = " ".join(
        str(getattr(w, "value", ""))
        for w in [app.header, app.prompt_html, app.response_html, app.progress_label, app.status]
    )
    assert "<script>" not in shown and "<img" not in shown
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in app.response_html.value
    assert "4.321" not in shown and "reward" not in shown.lower()


def test_reviewer_required_and_keys_box(queue, tmp_path):
    q, _recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="")
    assert app.buttons[3].disabled and app.index is None
    app.buttons[3].click()
    assert not store.exists()
    app.reviewer_box.value = "carol"
    assert not app.buttons[3].disabled and app.index == 0
    app.keys.value = "3"  # digit + Enter
    app.keys.value = "s"
    app.keys.value = "u"  # undoes the 3 and returns to item 0
    app.keys.value = "9"
    assert "Unknown key" in app.message and app.keys.value == ""
    recs_on_disk = review.read_labels(store).records
    assert [r["label"] for r in recs_on_disk] == [3.0, None] and app.index == 0


def test_passfail_mode(queue, tmp_path):
    q, _recs = queue
    store = tmp_path / "labels.jsonl"
    app = ReviewApp(q, store, reviewer="dave", mode="passfail")
    assert set(app.buttons) == {"pass", "fail"}
    app.buttons["pass"].click()
    app.keys.value = "f"
    on_disk = review.read_labels(store).records
    assert [(r["label"], r["mode"]) for r in on_disk] == [(5.0, "passfail"), (0.0, "passfail")]
    with pytest.raises(ValueError, match="pass/fail"):
        review.LabelStore(store).append("x", "dave", 3, mode="passfail")


# ---------------------------------------------------------------------------------------- statistics
def test_agreement_definitions_on_a_hand_case():
    rewards = [5, 4, 2, 0, 3.5]
    labels = [4, 2, 2, 2, 5]
    st = review.agreement_stats(rewards, labels)
    # threshold: reward pass T T F F T vs label pass T F F F T -> 4/5
    assert st.agreement == pytest.approx(0.8)
    assert st.confusion == [[2, 0], [1, 2]]
    # within1: |diffs| 1 2 0 2 1.5 -> 2/5
    assert st.within1 == pytest.approx(0.4)
    # unweighted pass/fail kappa: po 0.8, pe 0.6*0.4 + 0.4*0.6 = 0.48 -> 0.32/0.52
    assert st.kappa == pytest.approx(0.32 / 0.52)
    # quadratic-weighted kappa on binned scores (3.5 -> 4), by hand from the confusion matrix
    r_bin, h_bin = [5, 4, 2, 0, 4], [4, 2, 2, 2, 5]
    m = np.zeros((6, 6))
    for a, b in zip(r_bin, h_bin):
        m[a, b] += 1
    w = np.subtract.outer(np.arange(6), np.arange(6)) ** 2
    p = m / m.sum()
    expect = 1 - (w * p).sum() / (w * np.outer(p.sum(1), p.sum(0))).sum()
    assert st.kappa_weighted == pytest.approx(expect) and st.confusion_scores == m.astype(int).tolist()
    assert review.agreement_stats(rewards, labels, weights="linear").kappa_weighted != pytest.approx(expect)
    # Wilson 95% interval for 9/10 (textbook value)
    ci = review.agreement_stats([5] * 9 + [0], [5] * 10).ci
    assert ci == pytest.approx((0.5958, 0.9821), abs=1e-4)
    # pass/fail labels (0/5) are left out of within1 and the score kappa
    pf = review.agreement_stats([4.2, 1.0], [5, 0], scored=[False, False])
    assert pf.agreement == 1.0 and pf.within1 is None and pf.kappa_weighted is None and pf.within1_ci is None
    # the interval of within1 is within1's own (issue #14: it was the threshold agreement's)
    w = review.agreement_stats([5, 5, 5, 5], [4, 4, 3, 3])  # threshold 4/4, within1 2/4
    assert w.ci == review.wilson(4, 4) and w.within1_ci == review.wilson(2, 4) and w.within1_ci != w.ci


def test_binning_never_crosses_the_success_threshold():
    # issue #14: a 2.5 label counted as a fail but was binned as 3, a success bin
    st = review.agreement_stats([2.5, 2.9, 3.0, 3.4, 0.4], [2.5, 2.6, 3.2, 4.5, 0.5])
    r_bins = [i for i, row in enumerate(st.confusion_scores) for _ in range(sum(row))]
    assert r_bins == [0, 2, 2, 3, 3]  # rewards 0.4 -> 0; 2.5, 2.9 -> 2 (fails); 3.0, 3.4 -> 3
    h_bins = [j for row in zip(*st.confusion_scores) for j in [row]]
    cols = [j for j, col in enumerate(zip(*st.confusion_scores)) for _ in range(sum(col))]
    assert cols == [1, 2, 2, 3, 5] and h_bins  # labels 0.5 -> 1 (half up), 2.5, 2.6 -> 2, 3.2 -> 3, 4.5 -> 5
    # every success-bin cell agrees with the pass/fail confusion: bins >= 3 hold exactly the passes
    m = np.asarray(st.confusion_scores)
    assert m[3:, :].sum() == sum(st.confusion[1]) and m[:, 3:].sum() == st.confusion[0][1] + st.confusion[1][1]


def test_labels_needed_follow_the_wilson_interval():
    assert review.labels_for_halfwidth(0.9, 0.07) == 73 and review.labels_for_halfwidth(0.5, 0.07) == 193
    lo, hi = review.wilson(0.9 * 73, 73)
    assert (hi - lo) / 2 <= 0.07 < (lambda c: (c[1] - c[0]) / 2)(review.wilson(0.9 * 72, 72))
    assert review.wilson(27, 30)[0] < 0.75  # 27/30: "90%" whose lower bound is 74%
    assert review.labels_to_settle(27, 30, 0.9) is None  # exactly at the bar: never settles
    m = review.labels_to_settle(29, 30, 0.9)
    assert review.wilson(29 / 30 * (30 + m), 30 + m)[0] >= 0.9 > review.wilson(29 / 30 * (29 + m), 29 + m)[0]
    assert review.labels_to_settle(20, 30, 0.9) == 0  # already settled (entirely below)


def test_skewed_case_high_raw_agreement_low_kappa():
    # 100 items, 95% pass on both sides, but the 5 failures never coincide
    rewards = [0.0] * 5 + [5.0] * 95
    labels = [5.0] * 5 + [0.0] * 5 + [5.0] * 90
    st = review.agreement_stats(rewards, labels)
    assert st.agreement == pytest.approx(0.90)
    assert st.kappa == pytest.approx(-1 / 19)  # (0.90 - 0.905) / (1 - 0.905)
    assert review.agreement_stats([5.0] * 10, [5.0] * 10).kappa is None  # undefined, not NaN


# --------------------------------------------------------------------------------------------- gate
def _cfg(**kw):
    return load_config(None, {f"review.{k}": v for k, v in kw.items()})


def _label_all(q, store, recs, flip: int, reviewer="alice"):
    """Label every item with the reward model's verdict, except ``flip`` items on the other side."""
    s = review.LabelStore(store)
    s.append_many(
        [
            s.make_record(
                r["review_id"], reviewer, (0.0 if r["reward"] >= 3 else 5.0) if i < flip else round(r["reward"])
            )
            for i, r in enumerate(recs)
        ]
    )


def test_gate_awaiting_blocked_pass(tmp_path, capsys):
    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    recs = make_queue(q, n=40)
    store = tmp_path / "labels.jsonl"
    cfg = _cfg(min_labels=30)
    gate_json = tmp_path / "round-01" / "review" / "gate.json"

    res = review.review_gate(q, store, cfg)
    assert res.status == "awaiting review" and res.n_labels == 0 and "notebooks/review.ipynb" in res.message
    assert json.loads(gate_json.read_text())["status"] == "awaiting review"
    with pytest.raises(review.ReviewGateStop, match="awaiting review"):
        res.raise_for_status()
    assert review.main(["--queue", str(q), "--labels", str(store)]) == 3

    _label_all(q, store, recs, flip=12)  # 28/40 = 70% agreement: the interval lies entirely below 90%
    res = review.review_gate(q, store, cfg)
    assert res.status == "blocked" and res.agreement == pytest.approx(0.7) and res.n_labels == 40
    assert "fix the reward model before training the policy" in res.message.lower()
    assert set(res.per_family) == {"upper", "reverse", "sort", "tool", "add", "code"}
    assert sum(f["n"] for f in res.per_family.values()) == 40
    assert res.ci[0] < 0.7 < res.ci[1] < 0.9 and not res.simulated and "Wilson 95% CI" in res.message
    assert review.main(["--queue", str(q), "--labels", str(store)]) == 4
    assert "BLOCKED" in capsys.readouterr().out

    # alice's later relabels win over her earlier labels: 38/40 = 95%, but its interval reaches below 90%
    s = review.LabelStore(store)
    for r in recs[:10]:
        s.append(r["review_id"], "alice", round(r["reward"]))
    res = review.review_gate(q, store, cfg)
    assert res.status == "inconclusive" and res.agreement == pytest.approx(38 / 40)
    assert res.ci[0] < 0.9 < res.ci[1] and res.labels_more > 0 and f"label {res.labels_more} more" in res.message
    assert "unlabelled items are left" in res.message  # the 40-item queue cannot settle it
    assert review.main(["--queue", str(q), "--labels", str(store)]) == 3  # the round waits, as for review
    capsys.readouterr()
    for r in recs[10:12]:
        s.append(r["review_id"], "alice", round(r["reward"]))
    res = review.review_gate(q, store, cfg)
    assert res.status == "pass" and res.agreement == 1.0 and res.kappa > 0.8 and res.ci[0] >= 0.9
    assert review.main(["--queue", str(q), "--labels", str(store), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "pass"
    # stricter metric from the config: the same labels measured within +-1
    res = review.review_gate(q, store, _cfg(min_labels=30, agreement_metric="within1"))
    assert res.metric == "within1" and res.within1 == 1.0 and res.status == "pass"
    assert res.ci == review.wilson(40, 40) and res.n_gated == 40


def test_gate_min_kappa_catches_the_skewed_case(tmp_path):
    q = tmp_path / "prep" / "review_queue.jsonl"
    recs = make_queue(q, n=200, reward_fn=lambda i, t, r: 0.0 if i < 3 else 5.0)  # reward model: 98.5% pass
    s = review.LabelStore(tmp_path / "labels.jsonl")
    s.append_many([s.make_record(r["review_id"], "alice", 0.0 if i in (3, 4) else 5.0) for i, r in enumerate(recs)])
    res = review.review_gate(q, s.path, _cfg(max_items=200), write=False)  # 195/200: passes the raw bar...
    assert res.status == "pass" and 0.97 < res.agreement < 0.98 and res.ci[0] > 0.9 and res.kappa < 0
    assert "chance" in res.message
    res = review.review_gate(q, s.path, _cfg(min_kappa=0.4, max_items=200), write=False)  # ...not the kappa bar
    assert res.status == "blocked" and "min_kappa" in res.message


def test_gate_with_fewer_items_than_min_labels_and_labels_of_other_queues(tmp_path):
    q = tmp_path / "prep" / "review_queue.jsonl"
    recs = make_queue(q, n=5)
    store = tmp_path / "labels.jsonl"
    s = review.LabelStore(store)
    s.append("some-other-round-item", "alice", 5.0)  # ignored: not in this queue
    _label_all(q, store, recs, flip=0)
    res = review.review_gate(q, store, _cfg(min_labels=30), write=False)
    # 5 of 5 agree, yet the Wilson interval [57%, 100%] cannot show 90%: the queue is too small to pass
    assert res.status == "inconclusive" and res.n_labels == 5 and res.n_required == 5
    assert "only 0 unlabelled items are left" in res.message and "data.review_fraction" in res.message


def test_queue_is_capped_by_max_items(tmp_path):
    q = tmp_path / "prep" / "review_queue.jsonl"
    recs = make_queue(q, n=260)
    cfg = _cfg(simulate=True)
    assert review.gate_sizes(cfg) == (73, 193)  # sized by the +-7 point interval
    res = review.review_gate(q, tmp_path / "l.jsonl", cfg, write=False)
    assert res.n_queue == 193 and res.n_labels == 193 and res.max_items == 193 and res.status == "pass"
    assert [it["review_id"] for it in review.load_queue(q, 5)] == [r["review_id"] for r in recs[:5]]


def test_simulated_reviewer_is_marked_everywhere(tmp_path):
    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    # reward model = verifier except 8 of 40 items where it flips the verdict -> 80% agreement
    recs = make_queue(
        q, n=40, reward_fn=lambda i, t, r: (1.0 if verify(t.prompt, r) >= 3 else 4.5) if i < 8 else verify(t.prompt, r)
    )
    store = tmp_path / "labels.jsonl"
    res = review.review_gate(q, store, _cfg(simulate=True))
    assert res.status == "blocked" and res.simulated and res.n_simulated == 40
    assert res.reviewers == [review.SIMULATED_REVIEWER] and res.message.startswith("[SIMULATED")
    on_disk = review.read_labels(store).records
    assert len(on_disk) == 40 and all(r["simulated"] for r in on_disk)
    gate = json.loads((tmp_path / "round-01" / "review" / "gate.json").read_text())
    assert gate["simulated"] is True and gate["status"] == "blocked"

    review.review_gate(q, store, _cfg(simulate=True))
    assert len(review.read_labels(store).records) == 40  # idempotent: no second set of simulated labels

    # without simulation, simulated labels are not human judgement
    res = review.review_gate(q, store, _cfg(simulate=False))
    assert res.status == "awaiting review" and "40 simulated labels ignored" in res.message
    # a human label overrides the simulated one on its item
    review.LabelStore(store).append(recs[0]["review_id"], "alice", round(recs[0]["reward"]))
    res = review.review_gate(q, store, _cfg(simulate=True))
    assert res.n_simulated == 39 and "alice" in res.reviewers
    # the record's own simulated_label wins over the verifier
    q2 = tmp_path / "r2" / "prep" / "review_queue.jsonl"
    rows = [dict(r, simulated_label=r["reward"]) for r in recs]
    q2.parent.mkdir(parents=True)
    q2.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = review.review_gate(q2, tmp_path / "l2.jsonl", _cfg(simulate=True))
    assert res.status == "pass" and res.agreement == 1.0


def test_bad_queue_names_file_and_line(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text(
        '{"review_id": "a", "task_id": "t", "prompt": "p", "response": "r", "reward": 1}\n'
        '{"review_id": "b", "task_id": "t", "prompt": "p", "response": "r"}\n'
    )
    with pytest.raises(ValueError, match=r"q.jsonl:2: missing key 'reward'"):
        review.load_queue(q)
    assert review.main(["--queue", str(tmp_path / "nope.jsonl")]) == 2


def test_gate_logs_to_mlflow(tmp_path, mlflow_store):
    from hermes_lab.core import tracking

    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    make_queue(q, n=40)  # 40 of 40: the Wilson interval's lower end (91%) clears 90%
    with tracking.stage_run("review_gate", runs_dir=tmp_path) as run:
        res = review.review_gate(q, tmp_path / "labels.jsonl", _cfg(simulate=True))
        tracking.log_figure(review.plot_agreement(res), tmp_path / "agreement.png")
    got = mlflow_store.MlflowClient().get_run(run.info.run_id).data
    assert got.tags["review.status"] == "pass" and got.tags["review.simulated"] == "true"
    assert got.params["review.simulate"] == "True" and got.params["review.min_agreement"] == "0.9"
    assert got.metrics["review/agreement"] == 1.0 and got.metrics["review/n_simulated"] == 40
    assert "review/agreement_add" in got.metrics and got.metrics["review/ci_low"] > 0.9
    arts = {a.path for a in mlflow_store.MlflowClient().list_artifacts(run.info.run_id, "review")}
    assert "review/gate.json" in arts


def test_python_m_entry_point(tmp_path):
    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    make_queue(q, n=40)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "hermes_lab.review.gate",
            "--queue",
            str(q),
            "--labels",
            str(tmp_path / "l.jsonl"),
            "--simulate",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    assert "PASS" in p.stdout and "SIMULATED" in p.stdout


# ------------------------------------------------------------------------------------------ notebook
@pytest.mark.slow
def test_gate_notebook_stops_the_round_cleanly(tmp_path, mlflow_store):
    import papermill as pm

    round_dir = tmp_path / "round-01"
    q = round_dir / "prep" / "review_queue.jsonl"
    # the reward model flips 12 of 40 verdicts: 70% agreement, its Wilson interval entirely below 90%
    make_queue(
        q, n=40, reward_fn=lambda i, t, r: (0.0 if verify(t.prompt, r) >= 3 else 5.0) if i < 12 else verify(t.prompt, r)
    )
    cfg_path = tmp_path / "params.yaml"
    cfg_path.write_text("review:\n  simulate: true\n  min_labels: 30\n")
    with mlflow_store.start_run(run_name="round") as parent:
        parent_id = parent.info.run_id
    out = tmp_path / "15_review_gate.out.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(
            str(REPO / "notebooks" / "15_review_gate.ipynb"),
            str(out),
            cwd=str(REPO),
            kernel_name="python3",
            kernel_manager_class=ForkingKernelManager,  # forked, as the round runner starts its kernels
            progress_bar=False,
            parameters={
                "config_path": str(cfg_path),
                "round_dir": str(round_dir),
                "parent_run_id": parent_id,
                "labels_path": str(tmp_path / "l.jsonl"),
            },
        )
    assert err.value.ename == "ReviewGateStop" and "blocked" in err.value.evalue
    gate = json.loads((round_dir / "review" / "gate.json").read_text())
    assert gate["status"] == "blocked" and gate["simulated"] is True
    assert (round_dir / "review" / "agreement.png").stat().st_size > 0
    client = mlflow_store.MlflowClient()
    child = [
        r
        for r in client.search_runs([client.get_experiment_by_name("hermes-lab").experiment_id])
        if r.data.tags.get("mlflow.parentRunId") == parent_id
    ]
    assert len(child) == 1 and child[0].data.tags["review.status"] == "blocked"
    assert child[0].info.status == "FINISHED"  # the stop comes after the stage run closed


@pytest.mark.slow
def test_labeller_notebook_runs_headless(tmp_path):
    import nbformat
    import papermill as pm

    q = tmp_path / "round-01" / "prep" / "review_queue.jsonl"
    make_queue(q, n=4)
    out = tmp_path / "review.out.ipynb"
    pm.execute_notebook(
        str(REPO / "notebooks" / "review.ipynb"),
        str(out),
        cwd=str(REPO),
        kernel_name="python3",
        kernel_manager_class=ForkingKernelManager,  # forked, as the round runner starts its kernels
        progress_bar=False,
        parameters={
            "config_path": "",
            "round_dir": str(tmp_path / "round-01"),
            "store_path": str(tmp_path / "l.jsonl"),
            "reviewer": "eve",
        },
    )
    outputs = [o for c in nbformat.read(out, 4).cells if c.cell_type == "code" for o in c.outputs]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert any("AWAITING REVIEW" in "".join(o.get("text", "")) for o in outputs)
