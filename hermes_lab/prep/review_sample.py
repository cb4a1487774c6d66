"""Distill stage, the human review sample (``hermes_lab.prep.distill``): which records go to review and their
items as lines of ``review_queue.jsonl``.

Reads the ingest's columns (``review_selection``: each family's share of the sample, by the records' seeded
review rank) and the picked records' text; writes nothing itself: ``hermes_lab.prep.distill.Distill`` writes the
lines it builds (``review_lines`` for a partition's picks, a conversation with its messages and tools;
``seed_review_lines`` for seed records, in columns) through its sorted spill. The review stage reads them
(``notebooks/15_review_gate.ipynb``).

    hermes-lab prep --input runs/round-01/trajectories.jsonl --output runs/round-01/prep --params params/embedded.yaml
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from hermes_lab.logs.record import record_of, review_key
from hermes_lab.prep.ingest import review_id
from hermes_lab.tasks import suite as tasks


def review_selection(cols: dict[str, Any], fam_names: list[str], cfg: Any) -> tuple[Any, dict[str, Any]]:
    """Stratified (family x reward band) share of the new records, at least one per non-empty stratum,
    ranked by a seeded hash of the review id: the same records give the same sample in any order.
    Returns the picked mask (by seq) and the summary's review section."""
    import numpy as np

    scale = float(cfg.reward.scale)
    low, high = 0.3 * scale, cfg.reward.success_threshold  # on the 5 scale: low < 1.5, high >= 3
    rf = cfg.data.review_fraction
    rewards, new = cols["reward"], ~cols["negative"]
    band = np.where(rewards < low, 1, np.where(rewards >= high, 0, 2))  # 0 high, 1 low, 2 mid
    stratum = cols["family"].astype(np.int64) * 3 + band
    seqs = np.flatnonzero(new)
    counts = np.bincount(stratum[seqs], minlength=3 * max(1, len(fam_names)))
    picked = np.zeros(len(rewards), dtype=bool)
    if rf > 0 and len(seqs):
        order = seqs[np.lexsort((seqs, cols["rank"][seqs], stratum[seqs]))]  # by stratum, then rank, then seq
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        k = np.maximum(1, (rf * counts + 0.5).astype(np.int64))
        for s in np.flatnonzero(counts).tolist():
            picked[order[starts[s] : starts[s] + k[s]]] = True
    names = ("high", "low", "mid")
    strata = {(fam_names[s // 3], names[s % 3]): int(c) for s, c in enumerate(counts.tolist()) if c}
    info = {
        "fraction": rf,
        "seed": cfg.data.seed,
        "population": int(len(seqs)),
        "size": int(picked.sum()),
        "strata": {f"{fa}|{b}": n for (fa, b), n in sorted(strata.items())},
    }
    return picked, info


def _review_line(
    prompt: str,
    response: str,
    task_id: str,
    family: str,
    reward: float,
    scale: float,
    thr: float,
    conv: dict[str, Any] | None = None,
    label: float | None = None,
) -> str:
    """A review item; for a conversation (``conv``) its id is the conversation's and it carries the
    messages, tools, conversation_id and reward_source the widget shows. ``label``: the simulated label of an
    embedded task's record (``review_lines`` scores them together; None: not one of them)."""
    band = "low" if reward < 0.3 * scale else "high" if reward >= thr else "mid"
    if conv is not None:  # a conversation: its id names the review item, the person labels it whole
        from hermes_lab.policy.episodes import score_messages  # the agent family's verifier (None: not one)

        rid = hashlib.sha1(review_key(task_id, conv["conversation_id"])).hexdigest()[:12]
        label = score_messages(conv["messages"], scale)
    else:
        rid = review_id(task_id, prompt, response)
    rec = {
        "review_id": rid,
        "task_id": task_id,
        "family": family,
        "prompt": prompt,
        "response": response,
        "reward": reward,
        "reward_band": band,
        "simulated_label": label,
    }
    if conv is not None:
        rec.update({k: conv[k] for k in ("conversation_id", "reward_source", "messages", "tools", "outcome")})
    return json.dumps(rec)  # ASCII escapes: readers that splitlines() must not split on U+2028


def review_lines(
    items: list[tuple[Any, ...]], c: dict[str, Any], seq: Any, fam_names: list[str], scale: float, thr: float
) -> list[str]:
    """The review items of a partition's picks ((row, prompt, response, task_id, conversation text)), with the
    embedded tasks' simulated labels (their verifiers, scored together). A code task's label is left to the
    review gate's simulated reviewer (``review.gate.simulate_labels`` runs its tests when ``review.simulate`` is
    on): prep runs no sandbox for a label nobody may read."""
    known: dict[str, Any] = {}
    todo = []
    for k, (_, p, _resp, _, conv) in enumerate(items):
        if conv is None:
            if p not in known:
                known[p] = tasks.parse_prompt(p)
            if known[p] is not None and known[p].family != "code":
                todo.append(k)
    labels: dict[int, float] = {}
    if todo:
        scores = tasks.score_tasks([known[items[k][1]] for k in todo], [items[k][2] for k in todo], scale)
        labels = dict(zip(todo, scores))
    out = []
    for k, (i, p, resp, tid, conv) in enumerate(items):
        s = int(seq[i])
        fam, r = fam_names[int(c["family"][s])], float(c["reward"][s])
        rec = record_of(conv) if conv is not None else None
        out.append(_review_line(p, resp, tid, fam, r, scale, thr, rec, labels.get(k)))
    return out


JOB: list[Any] = []  # (columns, family names, scale, threshold, the accepted sink): distill's, a forked worker's


def conversation_review_lines(items: list[tuple[Any, ...]], seqs: Any) -> list[str]:
    """``review_lines`` of conversation picks ((prompt, response, task_id, the record's offset in the accepted
    sink), their seqs), each record read back from the sink here: in the worker distill forks, beside its
    partitions (``JOB`` holds what the fork inherits)."""
    c, fam_names, scale, thr, sink = JOB[0]
    rows = []
    with open(sink, "rb") as f:
        for k, (p, resp, tid, at) in enumerate(items):
            f.seek(at)
            rows.append((k, p, resp, tid, f.readline()))
    return review_lines(rows, c, seqs, fam_names, scale, thr)


def _json_strings(col: Any) -> Any:
    """Each value of an Arrow string array as ``json.dumps`` writes it (ASCII escapes): quotes and backslashes
    escaped in Arrow, a value with any other character JSON escapes (control, DEL, non-ASCII) in Python."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    esc = pc.replace_substring(pc.replace_substring(col, "\\", "\\\\"), '"', '\\"')
    esc = pc.binary_join_element_wise('"', esc, '"', "")
    odd = pc.match_substring_regex(col, "[^ -~]")
    if pc.any(odd).as_py():
        enc = json.encoder.encode_basestring_ascii
        esc = pc.replace_with_mask(esc, odd, pa.array([enc(x) for x in col.filter(odd).to_pylist()], pa.string()))
    return esc


def _texts(values: list[str], idx: Any) -> Any:
    """An Arrow string array: ``values[idx[i]]`` at row i (a few distinct texts, many rows)."""
    import numpy as np
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(
        pa.array(np.asarray(idx, dtype=np.int32)), pa.array(values, pa.string())
    ).cast(pa.string())


def seed_review_lines(
    prompt: Any, response: Any, task_id: Any, fam: Any, reward: Any, fam_names: list[str], scale: float, thr: float
) -> Any:
    """The review items of seed records (``_review_line``'s JSON lines, an Arrow string array), built in columns:
    per row only the review id (sha1) in Python, and the embedded tasks' simulated labels (their verifiers)."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    enc = json.encoder.encode_basestring_ascii
    joined = pc.cast(pc.binary_join_element_wise(task_id, prompt, response, ""), pa.binary()).to_pylist()
    rid = pa.array([hashlib.sha1(x).hexdigest()[:12] for x in joined], pa.string())  # lines.review_id
    values, at = np.unique(reward, return_inverse=True)
    rewards = _texts([float.__repr__(float(x)) for x in values], at)
    band = _texts(["high", "low", "mid"], np.where(reward < 0.3 * scale, 1, np.where(reward >= thr, 0, 2)))
    # the simulated label of an embedded task's record (not code: the review gate's reviewer runs its tests)
    ps = pc.dictionary_encode(prompt)
    known = [tasks.parse_prompt(p) for p in ps.dictionary.to_pylist()]
    ok = np.asarray([t is not None and t.family != "code" for t in known] or [False], dtype=bool)
    rows = np.flatnonzero(ok[ps.indices.to_numpy()]).tolist()
    label = ["null"] * len(rid)
    if rows:
        pi = ps.indices.to_numpy()
        resp = response.take(pa.array(rows)).to_pylist()
        scores = tasks.score_tasks([known[pi[i]] for i in rows], resp, scale)
        for i, v in zip(rows, scores):
            label[i] = float.__repr__(float(v))
    cols = ['{"review_id": "', rid, '", "task_id": ', _json_strings(task_id), ', "family": ']
    cols += [_texts([enc(f) for f in fam_names], fam), ', "prompt": ', _json_strings(prompt), ', "response": ']
    cols += [_json_strings(response), ', "reward": ', rewards, ', "reward_band": "', band, '", "simulated_label": ']
    cols += [pa.array(label, pa.string()), "}", ""]
    return pc.binary_join_element_wise(*cols)
