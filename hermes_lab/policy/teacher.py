"""The tiny policy's noisy teacher: its training examples, packed into rows, and the loss the build trains on.

Stage: foundation, the embedded policy's one-time build (``hermes_lab.policy.model.build_tiny_policy`` draws a
``batch`` a step and trains on its ``loss``). Reads and writes nothing but a hermes episode's temporary workspace
(``tasks.hermes.teacher_conversation`` runs the tools on disk). ``unpack`` gives the same examples one per row, for
the equivalence test (tests/policy/test_policy.py) and benchmarks/bench_build.py:

    .venv/bin/python benchmarks/bench_build.py --no-full      # rows of several widths, of one, and padded
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from hermes_lab.policy.chat import assistant_spans
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T

NOISE = 0.65  # share of teacher answers that are corrupted (9 in 10 of them format slips)
HERMES_NOISE = 0.5  # of the hermes family's episodes: its copies are harder to learn (tasks.hermes.SLIPS)
# teacher examples per family per draw: the families of longer answers (reverse, add, tool, code) twice; hermes: the
# embedded agent family's whole episodes (hermes_lab.tasks.hermes: workspace tasks on Hermes's own tools, rendered
# with the chat template, policy.chat). v12, measured: twice as many hermes episodes did not learn the family better
# (greedy 30% against 46% on held-out tasks, one build each) and cost a third more build time
TEACHER_MIX = {"upper": 1, "reverse": 2, "sort": 1, "tool": 2, "add": 2, "code": 2, "hermes": 1}
# tokens per packed row, by width (batch): an agent episode is ~170 tokens (up to 320), a string example 17.5
PACK_WIDTHS = (320, 192, 64)


def batch(rng: random.Random, tok: Any, n: int, widths: tuple[int, ...] = PACK_WIDTHS) -> list[dict[str, Any]]:
    """Model inputs for n noisy-teacher examples, packed into rows of a few ``widths``: one batch per width in use,
    widest first. ``loss`` trains on them as one batch.

    Padding every example to the batch's longest (36 tokens, against 17.5 on average) spent half of each
    step on padding. Packing several examples into one row with ``position_ids`` restarting at 0 and no
    attention_mask makes transformers build a block-diagonal causal mask (masking_utils'
    ``find_packed_sequence_indices``): each example attends only to itself, so the loss is the padded
    batch's loss (mean over the same answer tokens) at about half the compute. Labels are -100 on
    prompts and on the row's tail padding, which is its own block.

    Several widths, not one (v14): a row's attention costs its width squared whatever it holds (the mask is
    dense), and with every row 320 wide it was 40% of a step. Now an episode (~170 tokens, up to 320) opens a row
    just wide enough for it, the strings fill the gaps the episodes leave (free) and then rows of 64, a 25th of a
    wide row's attention each: a step costs ~10% less for the same examples and the same loss (bench_build.py).
    """
    fams = tuple(f for f, k in TEACHER_MIX.items() for _ in range(k))
    prompts, answers, episodes = [], [], []
    for _ in range(n):
        fam = rng.choice(fams)
        if fam == H.FAMILY:  # a whole episode: the assistant turns are the labels, the rest context
            episodes.append(assistant_spans(tok, H.teacher_conversation(rng, HERMES_NOISE), None))
            continue
        while True:
            t = T.make_task(fam, T._make_input(fam, rng))
            if T.split_of(t.prompt) == "train":
                break
        prompts.append(t.prompt)
        # code: the teacher writes any correct form (x*x or x**2), so only the tests can tell right from wrong
        answer = T.teacher_answer(t, rng)
        answers.append(T.corrupt(answer, rng) if rng.random() < NOISE else answer)
    # one batched call each: the fast tokenizer's per-call overhead was a tenth of a step; the Rust tokenizer's own
    # ids (transformers' wrapper converts every encoding to Python first: half the tokenizing time)
    p_all, a_all = _ids(tok, prompts), [a + [tok.eos_token_id] for a in _ids(tok, answers)]
    examples = [(p + a, [-100] * len(p) + a) for p, a in zip(p_all, a_all)]  # labels on the answer
    if episodes:
        # each piece's tokens (the tokenizer is per character, so the pieces' tokens are the whole's)
        piece_ids = iter(_ids(tok, [t for ep in episodes for t, _ in ep]))
        for ep in episodes:
            ids, lab = [], []
            for _, trained in ep:
                x = next(piece_ids)
                ids += x
                lab += x if trained else [-100] * len(x)
            examples.append((ids, lab))  # an episode: the assistant turns labelled
    ws = sorted(widths, reverse=True)
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    row_width: list[int] = []
    # first fit decreasing: the longest first, each into the first open row with room (the wide rows' gaps cost
    # nothing), else a new row of the narrowest width that holds it
    for ex in sorted(examples, key=lambda e: -len(e[0])):
        k = len(ex[0])
        r = next((i for i, left in enumerate(room) if k <= left), None)
        if r is None:
            fits = [w for w in ws if w >= k]
            if not fits:
                raise ValueError(f"a teacher example of {k} tokens does not fit a packed row of {ws[0]}")
            rows.append([])
            room.append(fits[-1])
            row_width.append(fits[-1])
            r = len(rows) - 1
        rows[r].append(ex)
        room[r] -= k
    return [
        _pack_rows([row for row, rw in zip(rows, row_width) if rw == w], w, tok.pad_token_id)
        for w in ws
        if w in row_width
    ]


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` without special tokens (``tok(texts)["input_ids"]``), from the Rust tokenizer."""
    return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)] if texts else []


def _pack_rows(rows: list[list[tuple[list[int], list[int]]]], width: int, pad_id: int) -> dict[str, Any]:
    """Rows of examples as tensors: ids, labels (-100 on the tail padding) and positions restarting at each
    example (the tail padding one more block). Built as lists, one tensor each: per-slice writes cost a tenth of
    the batch."""
    import torch

    ids, labels, pos = [], [], []
    for row in rows:
        r_ids, r_lab, r_pos = [], [], []
        for seq, lab in row:
            r_ids += seq
            r_lab += lab
            r_pos += range(len(seq))
        pad = width - len(r_ids)
        ids.append(r_ids + [pad_id] * pad)
        labels.append(r_lab + [-100] * pad)
        pos.append(r_pos + list(range(pad)))
    return {
        k: torch.tensor(v, dtype=torch.long) for k, v in (("input_ids", ids), ("labels", labels), ("position_ids", pos))
    }


def loss(model: Any, parts: list[dict[str, Any]]) -> Any:
    """The mean cross-entropy over every answer token of a ``batch``, its wide and narrow rows together:
    each part's mean weighted by its count of predicted tokens (a label after the shift, as transformers counts)."""
    counts = [(p["labels"][:, 1:] != -100).sum() for p in parts]
    total = sum(counts)
    return sum(model(**p, use_cache=False).loss * (c / total) for p, c in zip(parts, counts))  # no cache: packed mask


def unpack(parts: list[dict[str, Any]], pad_id: int = 0) -> tuple[Any, Any]:
    """The packed rows' examples one per row, right-padded to the longest: the batch the build used before
    packing (v5). For the equivalence test and benchmarks/bench_build.py."""
    import torch

    seqs = []
    for batch in parts:
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            starts = [j for j, x in enumerate(pos.tolist()) if x == 0] + [len(pos)]
            seqs += [(ids[a:b], labels[a:b]) for a, b in itertools.pairwise(starts) if (labels[a:b] != -100).any()]
    width = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (x, lab) in enumerate(seqs):
        ids[i, : len(x)], labels[i, : len(x)] = x, lab
    return ids, labels
