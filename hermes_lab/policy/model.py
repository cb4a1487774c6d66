"""The policy: load any causal LM (hub id, local path, LoRA adapter) or build the embedded tiny one.

Stage: foundation. Writes ``runs/policies/tiny-s<seed>-v<version>/`` (model, tokenizer, build.json with
the base policy's sampled pass rate) once per seed, then reuses it. The build is deterministic, so a copy is
also kept in the machine's cache (``$HERMES_LAB_CACHE``, default ``~/.cache/hermes-lab/policies/``, keyed by
the recipe's source and the torch/transformers versions, the way the hub cache keys a model by revision):
another clone or worktree on the same machine copies it in seconds instead of building for minutes.

    hermes-lab build-policy --runs-dir runs --seed 0

The embedded default needs no hub download. It is a Qwen2-style causal LM (so LoRA's q_proj/k_proj/
v_proj/o_proj exist) of about 0.3M parameters with a character-level tokenizer built with the
``tokenizers`` library, trained for about three and a half minutes on a deliberately *noisy teacher*: on a share of the
training examples the teacher's answer is corrupted (a swapped, dropped, doubled or replaced
character, or a format slip: a trailing period, quotes, chatter). The policy therefore learns the right
answer as its main mode with plausible wrong answers beside it: its *greedy* pass rate on held-out tasks is
~90% (it knows the answers) while its *sampled* one at temperature 0.9 lands mid-range (~36%, it slips).
That gap is the headroom GRPO is for, and it is reachable: sharpening what a policy knows is what GRPO on
its own samples does, learning what it does not know is not (build.json records both rates).

Everything is loaded through ``AutoModelForCausalLM`` / ``AutoTokenizer``, so ``load_policy`` takes a
Qwen2.5-0.5B id or path just as well. The tokenizer is saved with ``tokenizer_class:
PreTrainedTokenizerFast`` because AutoTokenizer would otherwise pick Qwen2's tokenizer class from the
model config and re-tokenize differently (tests/policy/test_policy.py checks the round trip).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hermes_lab.policy import teacher
from hermes_lab.policy.chat import MARKERS, add_chat_template
from hermes_lab.tasks import hermes as H
from hermes_lab.tasks import suite as T

# bump when the recipe changes: a new cache dir (6: packed batches, 8: graded levels, 10: code, 11: agent + chat,
# 13: 8 attention heads, 14: rows of several widths)
TINY_VERSION = 14
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# v14, one build each: 840 steps built in 206 s but learnt the hermes family worse (39% of held-out episodes sampled,
# 69% greedy, against 59% and 83% at 900), and 800 steps too (40%, 59%)
TINY_STEPS = 900
TINY_BATCH = 128
# v9: peak lr 3e-3, not 1e-2. At 1e-2 the policy under-learnt its content (greedy 67% on held-out tasks, copy
# slips such as 'up ham=' -> 'HAA'), and GRPO only sharpens what the greedy policy knows: the flywheel
# stalled near that ceiling by round 3. At 3e-3 greedy is ~92%, so the headroom above the sampled pass rate
# is the noisy teacher's slips, which GRPO can unlearn round after round.
TINY_LR = 3e-3
HERMES_EVAL = 70  # held-out hermes tasks the build plays (10 of each kind), sampled and greedy
# v13: 8 heads of 12 dimensions (4 key/value heads), not 4 of 24: the same 330,720 parameters, and the policy learns
# to copy from a tool's result (read: greedy 0% -> 93%; the hermes family's held-out episodes 27% -> 56% sampled,
# 44% -> 81% greedy) for ~20% more build time (236 s on 2 quiet cores, against 202 s). v14: the same recipe in rows of
# several widths (policy.teacher): 189-219 s in five builds, median 212 s (v13: 213 s and 236 s)
HEADS, KV_HEADS = 8, 4
CONTEXT = 512  # positions: a hermes episode (two calls and their results) is up to 320 tokens
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- tokenizer
def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-unicode table, in byte order (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def build_tokenizer() -> Any:
    """A byte-level tokenizer with no merges: one token per byte, i.e. per character for ASCII.

    It *is* a Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) with an empty merge list. That is
    deliberate: for a qwen2 config, transformers 5's AutoTokenizer rebuilds Qwen2Tokenizer from the
    saved vocab whatever class was saved, so any other tokenizer would not survive the round trip.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *_byte_alphabet()])}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        eos_token=EOS,
        pad_token=PAD,
        padding_side="left",
        model_max_length=CONTEXT,
    )
    # v12: the template's markers are one token each (as a real family's <tool_call> is): a hermes episode's two calls
    # and their results fit 320 positions instead of 448, and the build's step costs less
    tok.add_tokens(list(MARKERS))
    return add_chat_template(tok)  # v11: Hermes-style tool calls (policy.chat)


def _tiny_model(vocab_size: int, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(cfg)


# --------------------------------------------------------------------------------------------- building
def tiny_dir(runs_dir: str | os.PathLike[str], seed: int) -> Path:
    from hermes_lab.core.paths import resolve

    return resolve(runs_dir) / "policies" / f"tiny-s{seed}-v{TINY_VERSION}"  # relative: the project's runs/


def cache_dir() -> Path | None:
    """The machine's policy cache (``hermes_lab.core.paths.machine_cache``): its ``policies/``, or None (off)."""
    from hermes_lab.core.paths import machine_cache

    return machine_cache("policies")


def recipe_key() -> str:
    """What a build's bytes depend on besides its seed and steps: this module, its teacher's batches
    (policy.teacher), the chat template it renders the agent family with (policy.chat) and the task suite it is
    taught (their source, so an edit without a version bump is never served a stale copy) and the torch and
    transformers versions (their kernels round differently)."""
    from importlib.metadata import version

    h = hashlib.sha256()
    here = Path(__file__)
    for f in [
        here,
        here.with_name("teacher.py"),
        here.with_name("chat.py"),
        *sorted(Path(T.__file__).parent.glob("*.py")),
    ]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for dist in ("torch", "transformers", "tokenizers"):
        h.update(f"{dist}=={version(dist)}".encode())
    return h.hexdigest()[:16]


def _copy_in(src: Path, out: Path) -> None:
    """Copy a complete policy dir to ``out`` through a temp dir and a rename: a reader never sees half a copy."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def cached_build(name: str) -> Path | None:
    """The machine cache's complete copy of the policy dir ``name`` (``tiny-s0-v11``) for this recipe, if any."""
    root = cache_dir()
    entry = None if root is None else root / f"{name}-{recipe_key()}"
    return entry if entry is not None and (entry / "build.json").is_file() else None


def _store(out: Path) -> None:
    """Keep a copy of a fresh build in the machine's cache; a cache that cannot be written costs nothing."""
    root = cache_dir()
    if root is None:
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _lock(root / f".{out.name}.lock"):
            _copy_in(out, root / f"{out.name}-{recipe_key()}")
    except OSError as e:
        log.debug("policy cache %s not written: %s", root, e)


@contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two processes building the same policy: the second waits
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_tiny_policy(
    runs_dir: str | os.PathLike[str] = "runs",
    seed: int = 0,
    force: bool = False,
    quiet: bool = False,
    steps: int = TINY_STEPS,
) -> Path:
    """Build (or reuse) the embedded tiny base policy; returns its directory.

    Reuses ``runs/policies/`` first, then the machine's cache (``cache_dir``); ``force`` builds anew either
    way. ``steps`` other than the recipe's builds a separate, smaller policy (tests of determinism)."""
    out = tiny_dir(runs_dir, seed)
    if steps != TINY_STEPS:
        out = out.with_name(out.name + f"-steps{steps}")
    with _lock(out.parent / f".{out.name}.lock"):
        if (out / "build.json").exists() and not force:
            return out
        hit = None if force else cached_build(out.name)
        if hit is not None:
            _copy_in(hit, out)
            log.info("tiny policy: %s copied from the cache %s", out.name, hit)
            return out
        import torch
        from tqdm.auto import tqdm

        t0 = time.time()
        torch.manual_seed(seed)
        tok = build_tokenizer()
        model = _tiny_model(len(tok), seed)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=TINY_LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=TINY_LR, total_steps=steps, pct_start=0.1)
        rng = random.Random(f"tiny-teacher:{seed}")
        bar = tqdm(range(steps), desc="build tiny policy", disable=quiet, mininterval=2)
        # the next batch is made in a thread while this one trains (a hermes teacher episode runs its tools on a
        # workspace on disk; torch's kernels release the GIL); one worker keeps the draws in order: deterministic
        pool = ThreadPoolExecutor(1)
        ahead = pool.submit(teacher.batch, rng, tok, TINY_BATCH)
        for k in bar:
            batch = ahead.result()
            if k + 1 < steps:
                ahead = pool.submit(teacher.batch, rng, tok, TINY_BATCH)
            loss = teacher.loss(model, batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        pool.shutdown()
        model.eval()
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # evaluate the saved copy, loaded the way every user loads it
        policy = load_policy(str(tmp))
        held = T.generate_tasks(200, split="heldout", seed=seed)
        report = evaluate(policy, held, temperature=0.9, samples_per_task=2, seed=seed)
        # greedy: what the policy knows, the ceiling GRPO can sharpen the sampled pass rate towards
        report["greedy_pass_rate"] = evaluate(policy, held, temperature=0, seed=seed)["pass_rate"]
        from hermes_lab.policy import episodes as E

        # the hermes family: workspace tasks on Hermes's own tools, verified on the workspace
        hermes_held = H.generate_tasks(HERMES_EVAL, split="heldout", seed=seed)
        sampled = E.evaluate_episodes(policy, hermes_held, temperature=0.9, seed=seed)
        greedy = E.evaluate_episodes(policy, hermes_held, temperature=0, seed=seed)
        report["hermes"] = {
            "episode_success": sampled["episode_success"],
            "greedy_episode_success": greedy["episode_success"],
            "sampled": {k: v for k, v in sampled.items() if k not in ("passes", "task_ids")},
        }
        report.update(
            seed=seed,
            version=TINY_VERSION,
            noise=teacher.NOISE,
            hermes_noise=teacher.HERMES_NOISE,
            steps=steps,
            build_seconds=round(time.time() - t0, 1),
            parameters=sum(p.numel() for p in model.parameters()),
        )
        (tmp / "build.json").write_text(json.dumps(report, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        _store(out)
        return out


# ---------------------------------------------------------------------------------------------- loading
class Policy:
    """A causal LM (optionally with a LoRA adapter) and its tokenizer, ready to sample."""

    def __init__(self, model: Any, tokenizer: Any, name: str, adapter: str | None = None):
        self.model, self.tokenizer, self.name, self.adapter = model, tokenizer, name, adapter

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, adapter={self.adapter!r})"

    def generate(
        self,
        prompts: list[str],
        temperature: float = 0.9,
        max_new_tokens: int = 16,
        seed: int = 0,
        batch_size: int = 64,
        progress: bool = False,
    ) -> list[str]:
        """One completion per prompt (temperature 0: greedy). Deterministic for a given seed."""
        import torch
        from tqdm.auto import tqdm

        tok, out = self.tokenizer, []
        tok.padding_side = "left"
        starts = range(0, len(prompts), batch_size)
        for i in tqdm(starts, desc=f"generate {self.name}", disable=not progress, mininterval=2):
            chunk = prompts[i : i + batch_size]
            enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(self.model.device) for k, v in enc.items()}
            torch.manual_seed(seed * 1_000_003 + i)
            kw: dict[str, Any] = dict(
                max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
            )
            if temperature > 0:
                kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            else:
                kw.update(do_sample=False)
            with torch.no_grad():
                gen = self.model.generate(**enc, **kw)
            new = gen[:, enc["input_ids"].shape[1] :]
            out.extend(tok.batch_decode(new, skip_special_tokens=True))
        return out


def _is_adapter(path: str) -> bool:
    return Path(path, "adapter_config.json").is_file()


def resolve_model_name(name: str, runs_dir: str | os.PathLike[str] = "runs", seed: int = 0) -> str:
    """'embedded:tiny' -> the built tiny policy's dir; anything else unchanged (hub id or path)."""
    if name == "embedded:tiny":
        return str(build_tiny_policy(runs_dir, seed))
    return name


def load_policy(
    name_or_path: str,
    adapter: str | None = None,
    runs_dir: str | os.PathLike[str] = "runs",
    seed: int = 0,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    device: str | None = None,
) -> Policy:
    """Load a policy from a hub id, a local dir, 'embedded:tiny', or a LoRA adapter dir (its base is read
    from adapter_config.json). ``adapter`` stacks a LoRA adapter on the base."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = resolve_model_name(name_or_path, runs_dir, seed)
    if _is_adapter(name) and adapter is None:
        adapter = name
        name = json.loads(Path(name, "adapter_config.json").read_text())["base_model_name_or_path"]
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    tok_src = adapter if adapter and Path(adapter, "tokenizer_config.json").is_file() else name
    tok = AutoTokenizer.from_pretrained(tok_src, trust_remote_code=trust_remote_code)
    if tok.pad_token is None:  # many hub models ship without one; generation needs it
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if adapter:
        from peft import PeftModel

        from hermes_lab.core.quiet import third_party_deprecations

        with third_party_deprecations():  # PEFT reads a deprecated transformers property: not ours
            model = PeftModel.from_pretrained(model, adapter)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    return Policy(model, tok, name=str(name_or_path), adapter=adapter)


# ------------------------------------------------------------------------------------------- evaluation
def evaluate(
    policy: Policy,
    tasks: list[T.Task],
    temperature: float = 0.9,
    samples_per_task: int = 1,
    seed: int = 0,
    max_new_tokens: int = 16,
    threshold: float = 3.0,
) -> dict[str, Any]:
    """Sampled pass rate and mean reward, overall, per family and per level (pass: verifier score >=
    threshold; the code family: its hidden tests all pass, run in the sandbox); ``passes``: every sample's
    outcome ("1"/"0", task by task), for paired comparisons of two policies on the same tasks (``paired_gain``)."""
    prompts = [t.prompt for t in tasks for _ in range(samples_per_task)]
    answers = [t for t in tasks for _ in range(samples_per_task)]
    responses = policy.generate(prompts, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    per: dict[str, list[float]] = {}
    per_level: dict[str, list[float]] = {}
    scores = T.score_tasks(answers, responses)
    for t, v in zip(answers, scores):
        per.setdefault(t.family, []).append(v)
        per_level.setdefault(f"{t.family}:{t.level}", []).append(v)
    allv = [v for vs in per.values() for v in vs]

    def stats(vs: list[float]) -> dict[str, Any]:
        return {
            "pass_rate": round(sum(v >= threshold for v in vs) / len(vs), 4),
            "mean_reward": round(sum(vs) / len(vs), 4),
            "n": len(vs),
        }

    return {
        **stats(allv),
        "temperature": temperature,
        "samples_per_task": samples_per_task,
        "per_family": {f: stats(vs) for f, vs in sorted(per.items())},
        "per_level": {k: stats(vs) for k, vs in sorted(per_level.items())},
        "task_ids": [t.task_id for t in tasks],
        "passes": "".join("1" if v >= threshold else "0" for v in scores),
    }


def paired_gain(before: dict[str, Any], after: dict[str, Any], z: float = 1.959964) -> dict[str, Any]:
    """The pass-rate gain of ``after`` over ``before`` (two ``evaluate`` reports on the same tasks, seed and
    samples) with its 95% interval, paired by task: the per-task difference of pass shares, its mean and
    standard error. Pairing is what makes a few points' gain decidable on a few hundred tasks: most tasks
    come out the same for both policies, and an unpaired interval (Newcombe's) would count that agreement
    as noise. Samples of one task are not independent, so the task (not the sample) is the unit. Reports
    without per-sample outcomes, or on different tasks, give no interval."""
    k = int(before.get("samples_per_task") or 1)
    b, a = before.get("passes"), after.get("passes")
    if not b or not a or len(a) != len(b) or before.get("task_ids") != after.get("task_ids") or len(b) % k:
        return {"gain": round(after["pass_rate"] - before["pass_rate"], 4), "gain_lo": None, "gain_hi": None}
    n = len(b) // k
    d = [(a[i * k : (i + 1) * k].count("1") - b[i * k : (i + 1) * k].count("1")) / k for i in range(n)]
    mean = sum(d) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else math.inf
    return {
        "gain": round(mean, 4),
        "gain_lo": round(mean - z * se, 4),
        "gain_hi": round(mean + z * se, 4),
        "gain_tasks": n,
        "changed_tasks": sum(x != 0 for x in d),
    }


def describe_gain(ev: dict[str, Any]) -> str:
    """'+6.2 points (95% CI +2.9 to +9.5, paired over 300 tasks)' for an eval.json (train's before/after)."""
    g = ev.get("gain") or {}
    pts = 100 * g["gain"] if "gain" in g else ev.get("gain_points", 0.0)
    if g.get("gain_lo") is None:
        return f"{pts:+.1f} points"
    ci = f"{100 * g['gain_lo']:+.1f} to {100 * g['gain_hi']:+.1f}"
    return f"{pts:+.1f} points (95% CI {ci}, paired over {g['gain_tasks']} tasks)"


# ------------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs-dir", default=None, help="where runs/policies/ lives (default: the project's runs/)")
    p.add_argument("--seed", type=int, default=0, help="build seed (the build is deterministic by seed)")
    p.add_argument("--force", action="store_true", help="rebuild even if built (runs/policies/ or the machine's cache)")


def run_cli(args: argparse.Namespace) -> int:
    from hermes_lab.core.paths import resolve

    # typed on a command line: relative to the cwd, like any shell path; the default: the project's runs/
    runs_dir = os.path.abspath(args.runs_dir) if args.runs_dir else resolve("runs")
    path = build_tiny_policy(runs_dir, args.seed, force=args.force)
    report = json.loads((path / "build.json").read_text())
    print(f"tiny policy: {path}  ({report['parameters']:,} parameters, built in {report['build_seconds']} s)")
    print(f"sampled pass rate at T=0.9 on held-out tasks: {report['pass_rate']:.1%}")
    for fam, s in report["per_family"].items():
        print(f"  {fam:8s} {s['pass_rate']:.1%}  (mean reward {s['mean_reward']:.2f}, n={s['n']})")
    if "agent" in report:
        a = report["agent"]
        print(f"  agent    {a['episode_success']:.1%}  episode success (greedy {a['greedy_episode_success']:.1%})")
    if "hermes" in report:
        h = report["hermes"]
        print(f"  hermes   {h['episode_success']:.1%}  episode success (greedy {h['greedy_episode_success']:.1%})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module(
        "hermes_lab.policy.model", add_arguments, run_cli, argv, description="Build the embedded tiny policy."
    )


if __name__ == "__main__":
    sys.exit(main())
