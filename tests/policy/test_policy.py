"""The embedded tiny policy: tokenizer round trip, Qwen2 architecture, cached build, mid-range pass rate."""

import json

import pytest

from hermes_lab.policy import model as P
from hermes_lab.tasks import suite as T


def test_tokenizer_round_trip_through_autotokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = P.build_tokenizer()
    model = P._tiny_model(len(tok), seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)  # transformers 5 picks the class from the model config
    texts = ["tool weather  paris=", "up abc=ABC", "héllo 日本\n\tx  ", "rev   spaced  out=", "'quoted' ok."]
    for s in texts:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert back(s, add_special_tokens=False)["input_ids"] == ids, s
        assert back.decode(ids) == tok.decode(ids) == s
    assert (back.pad_token, back.eos_token) == (P.PAD, P.EOS)
    assert back.pad_token_id != back.eos_token_id
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.model_type == "qwen2"
    names = {n.rsplit(".", 1)[-1] for n, _ in reloaded.named_modules()}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= names


def test_build_is_deterministic_by_seed_and_kept_in_the_machine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_LAB_CACHE", str(tmp_path / "cache"))
    a = P.build_tiny_policy(tmp_path / "a", seed=3, steps=5, quiet=True)
    entry = tmp_path / "cache" / "policies" / f"{a.name}-{P.recipe_key()}"
    assert P.cached_build(a.name) == entry
    assert sorted(p.name for p in entry.iterdir()) == sorted(p.name for p in a.iterdir())
    kept = entry.stat().st_ino
    monkeypatch.setenv("HERMES_LAB_CACHE", "off")  # b is built, not copied: "off" neither reads nor writes
    assert P.cache_dir() is None and P.cached_build(a.name) is None
    b = P.build_tiny_policy(tmp_path / "b", seed=3, steps=5, quiet=True)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert entry.stat().st_ino == kept  # not written again (a write replaces the entry through a rename)
    # and the seed is what decides: another seed starts from other weights (a build per seed costs ~7 s)
    init = [P._tiny_model(len(P.build_tokenizer()), seed=s).state_dict() for s in (3, 4)]
    assert any(not init[0][k].equal(init[1][k]) for k in init[0])

    # another clone on the same machine: copied from the cache, byte for byte, never built
    monkeypatch.setenv("HERMES_LAB_CACHE", str(tmp_path / "cache"))

    def no_build(*args, **kwargs):
        raise AssertionError("built, though the cache had it")

    monkeypatch.setattr(P, "_tiny_model", no_build)
    d = P.build_tiny_policy(tmp_path / "d", seed=3, steps=5, quiet=True)
    for f in a.iterdir():
        assert (d / f.name).read_bytes() == f.read_bytes(), f.name
    assert not list(d.parent.glob("*.tmp*"))  # copied through a temp dir and a rename
    # an edited recipe (another key) or --force never gets the old copy
    with pytest.raises(AssertionError, match="built, though"):
        P.build_tiny_policy(tmp_path / "d", seed=3, steps=5, quiet=True, force=True)
    monkeypatch.setattr(P, "recipe_key", lambda: "edited")
    with pytest.raises(AssertionError, match="built, though"):
        P.build_tiny_policy(tmp_path / "e", seed=3, steps=5, quiet=True)


def test_packed_teacher_batch_has_the_padded_batch_loss():
    """Packing only saves compute: same examples, same loss, and no example attends to its row neighbours
    (a wrong mask would let answers leak across examples and lower the packed loss). The rows come in several
    widths (the episodes' wide rows, the strings' narrow ones): the loss is still the one batch's."""
    import random

    import torch

    from hermes_lab.policy import teacher

    tok = P.build_tokenizer()
    model = P._tiny_model(len(tok), seed=0).eval()
    parts = teacher.batch(random.Random("pack"), tok, 128)
    widths = [p["input_ids"].shape[1] for p in parts]
    assert widths == sorted(set(widths), reverse=True) and set(widths) <= set(teacher.PACK_WIDTHS) and len(widths) >= 2
    assert sum(p["input_ids"].shape[0] for p in parts) < 128 / 2.5  # several examples per row
    ids, labels = teacher.unpack(parts, tok.pad_token_id)
    assert len(ids) == 128  # every example is in exactly one block
    # every row holds at least one labelled example: no row is a forward pass for nothing
    for p in parts:
        assert ((p["labels"] != -100).any(dim=1)).all()
    with torch.no_grad():
        packed = teacher.loss(model, parts)
        padded = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=labels).loss
        # the same rows without position ids: one long causal sequence per row, examples see each other
        leaky = teacher.loss(model, [{k: v for k, v in p.items() if k != "position_ids"} for p in parts])
        # each part's own mean, unweighted: what a loss that ignored the parts' sizes would train on
        unweighted = sum(model(**p, use_cache=False).loss for p in parts) / len(parts)
    assert torch.allclose(packed, padded, atol=1e-5), (packed, padded)
    # an untrained model attends weakly: the leak moves the loss by ~6e-4 with v10's teacher mix, still 60x the
    # 1e-5 to which the packed and padded losses agree
    assert not torch.allclose(packed, leaky, atol=1e-4)
    assert not torch.allclose(packed, unweighted, atol=1e-4)


@pytest.fixture(scope="session")
def tiny():
    return P.build_tiny_policy("runs", seed=0)


def test_tiny_policy_is_cached_and_mid_range(tiny):
    import time

    t0 = time.time()
    assert P.build_tiny_policy("runs", seed=0) == tiny  # reused, not rebuilt
    assert time.time() - t0 < 5
    report = json.loads((tiny / "build.json").read_text())
    assert 0.30 <= report["pass_rate"] <= 0.60, report  # real headroom for GRPO
    # ... that GRPO can reach: the greedy policy knows the answers, the sampled one slips (the noisy teacher)
    assert report["greedy_pass_rate"] >= 0.85, report
    assert report["greedy_pass_rate"] - report["pass_rate"] >= 0.30, report
    assert set(report["per_family"]) == set(T.FAMILIES)
    assert report["parameters"] < 1_000_000
    # the agent family it learns is hermes (its episodes in build.json), in a 512-position context
    assert "agent" not in report and 0 < report["hermes"]["episode_success"] < 1, report.get("hermes")
    assert json.loads((tiny / "config.json").read_text())["max_position_embeddings"] == P.CONTEXT == 512


def test_load_policy_accepts_embedded_name_path_and_adapter(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model

    pol = P.load_policy("embedded:tiny")
    assert pol.model.config.model_type == "qwen2"
    prompts = [t.prompt for t in T.generate_tasks(12, split="heldout")]
    out1 = pol.generate(prompts, temperature=0.9, seed=7)
    out2 = P.load_policy(str(tiny)).generate(prompts, temperature=0.9, seed=7)
    assert out1 == out2 and len(out1) == 12  # deterministic by seed, same policy by name or path
    greedy = pol.generate(prompts, temperature=0)
    assert greedy == pol.generate(prompts, temperature=0, batch_size=5)  # left padding does not change answers
    # an adapter dir alone is enough: its base comes from adapter_config.json
    from hermes_lab.core.quiet import third_party_deprecations

    with third_party_deprecations():  # PEFT reads a property transformers 5 deprecated: not ours to fix
        peft_model = get_peft_model(
            P.load_policy(str(tiny)).model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        )
    peft_model.save_pretrained(tmp_path / "adapter")
    with_adapter = P.load_policy(str(tmp_path / "adapter"))
    assert with_adapter.adapter == str(tmp_path / "adapter")
    assert with_adapter.generate(prompts, temperature=0) == greedy  # fresh LoRA (B=0) is the identity


def test_evaluate_reports_per_family(tiny):
    pol = P.load_policy(str(tiny))
    tasks_ = T.generate_tasks(25, split="heldout")
    rep = P.evaluate(pol, tasks_, temperature=0.9, samples_per_task=2, seed=1)
    assert rep["n"] == 50
    assert set(rep["per_family"]) == set(T.FAMILIES)
    assert sum(f["n"] for f in rep["per_family"].values()) == 50
    assert 0 <= rep["pass_rate"] <= 1


def test_evaluate_keeps_every_outcome_and_paired_gain_uses_them(tiny):
    pol = P.load_policy(str(tiny))
    tasks_ = T.generate_tasks(100, split="heldout", seed=1)
    rep = P.evaluate(pol, tasks_, temperature=0.9, samples_per_task=2, seed=1)
    assert len(rep["passes"]) == 200 and set(rep["passes"]) <= {"0", "1"}
    assert rep["passes"].count("1") / 200 == rep["pass_rate"]
    assert rep["task_ids"] == [t.task_id for t in tasks_]
    assert sum(v["n"] for v in rep["per_level"].values()) == 200 and "add:3" in rep["per_level"]
    same = P.paired_gain(rep, rep)
    assert (same["gain"], same["gain_lo"], same["gain_hi"], same["changed_tasks"]) == (0, 0, 0, 0)
    # a candidate that fixes 20 of the failed tasks (both samples) and breaks 5 passed ones
    passes = list(rep["passes"])
    failed = [i for i in range(100) if passes[2 * i : 2 * i + 2] == ["0", "0"]][:20]
    passed = [i for i in range(100) if passes[2 * i : 2 * i + 2] == ["1", "1"]][:5]
    assert len(failed) == 20 and len(passed) == 5
    for i in failed:
        passes[2 * i : 2 * i + 2] = ["1", "1"]
    for i in passed:
        passes[2 * i : 2 * i + 2] = ["0", "0"]
    after = {**rep, "passes": "".join(passes), "pass_rate": "".join(passes).count("1") / 200}
    g = P.paired_gain(rep, after)
    assert g["gain"] == pytest.approx(0.15) and g["changed_tasks"] == 25
    # per-task differences: 20 x (+1), 5 x (-1), 75 x 0: mean 0.15, sd sqrt((25 - 100 * 0.15**2) / 99)
    se = ((25 - 100 * 0.15**2) / 99 / 100) ** 0.5
    assert g["gain_lo"] == pytest.approx(0.15 - 1.959964 * se, abs=1e-4) and g["gain_lo"] > 0
    assert g["gain_hi"] == pytest.approx(0.15 + 1.959964 * se, abs=1e-4)
    # pairing is what makes it decidable: an unpaired interval on the same counts includes 0
    from hermes_lab.round.compare import newcombe

    lo, _ = newcombe(rep["pass_rate"], 100, after["pass_rate"], 100)
    assert lo < g["gain_lo"]
    # other tasks (or no outcomes): no interval rather than a wrong one
    other = {**after, "task_ids": list(reversed(after["task_ids"]))}
    assert P.paired_gain(rep, other)["gain_lo"] is None
    assert "95% CI" in P.describe_gain({"gain": g}) and "CI" not in P.describe_gain({"gain": P.paired_gain(rep, other)})
