"""Benchmark: a round's three costs on a real-architecture model with random weights, beside bare TRL and vLLM.

For when a GPU is lent (docs/gpu.md); ``--device cpu`` is a smoke run that proves the script works (its figures say
nothing about a GPU). Nothing is downloaded: the model is one of tests/families.py's families (the family's real
architecture, its real chat template and special tokens) built at the size asked (``--hidden``, ``--layers``),
random weights, no forcing (``forced.json`` empty: the network's own tokens). Times, each as the loop's figure,
the bare one and their ratio (the loop's / bare):

- generation: ``policy.turn.sample`` on the conversations' prompts (rendered by ``policy.turn``, the family's
  reader prepared) against ``model.generate`` on the same ids;
- a GRPO step: TRL's GRPOTrainer with the tools, the tokenizer prepared by ``policy.formats.prepare`` (what
  ``train.grpo`` adds before it) against the same trainer on the bare tokenizer, ``--steps`` steps each;
- a served request: the gateway's in-process arm (``live.local.LocalArm`` through ``GenerationWorker``) against
  bare vLLM's ``LLM.chat`` when vLLM is installed (else that line says it was skipped).

    .venv/bin/python benchmarks/bench_family.py --family qwen2_5 --device cuda --hidden 896 --layers 24
    .venv/bin/python benchmarks/bench_family.py --family llama3_1 --device cpu      # smoke run, seconds

Writes the model under ``--work`` (default: a temp dir) and prints one line per cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))


def build(family: str, work: Path, hidden: int, layers: int) -> Path:
    """The family's model at the size asked (its tokenizer and template as tests/families.py builds them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from families import FAMILIES, build_family

    src = build_family(family, work / "cache")
    out = work / f"{family}-{hidden}x{layers}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    conf = json.loads((out / "config.json").read_text())
    heads = max(1, hidden // 64)
    conf.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 4)
    conf.update(num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads)
    conf.pop("auto_map", None)  # the bare architecture: no forcing
    if "layer_types" in conf:
        kinds = conf["layer_types"]  # the family's own pattern, repeated to the depth asked
        conf["layer_types"] = [kinds[k % len(kinds)] for k in range(layers)]
    (out / "config.json").write_text(json.dumps(conf))
    for f in out.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(0)
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    model.save_pretrained(out)
    assert family in FAMILIES
    return out


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen2_5", help="one of tests/families.py's FAMILIES")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--work", default=None)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hermes_lab.policy import formats, turn

    from families import FAMILIES, TOOL_FUNCS, conversation, tool_schemas

    work = Path(a.work or tempfile.mkdtemp(prefix="bench-family-"))
    fam = FAMILIES[a.family]
    path = build(a.family, work, a.hidden, a.layers)
    tok = AutoTokenizer.from_pretrained(path)
    reader = formats.prepare(tok, fam.tool_parser)
    model = AutoModelForCausalLM.from_pretrained(path).to(a.device).eval()
    users = [[{"role": "user", "content": conversation(i, fam.multi_call)["user"]}] for i in range(a.prompts)]
    prompts = [turn.prompt_ids(tok, u, tool_schemas()) for u in users]
    print(
        f"{a.family}: {sum(x.numel() for x in model.parameters()) / 1e6:.1f}M parameters on {a.device}, "
        f"reader {reader.source}, template {formats.template_name(tok)}, "
        f"vllm serve flags {' '.join(formats.vllm_flags(tok, fam.tool_parser))}"
    )

    # generation
    def loop_gen():
        turn.sample(model, tok, prompts, 0.9, a.new_tokens)

    def bare_gen():
        width = max(len(x) for x in prompts)
        ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in prompts], device=a.device)
        mask = (
            torch.arange(width, device=a.device)[None]
            >= torch.tensor([width - len(x) for x in prompts], device=a.device)[:, None]
        ).long()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=a.new_tokens,
                do_sample=True,
                temperature=0.9,
                top_k=0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id,
                eos_token_id=formats.stop_ids(model, tok),
            )

    torch.manual_seed(0)
    bare_gen()  # warm-up (kernels, allocator), not timed
    g_loop, g_bare = timed(loop_gen, a.repeat), timed(bare_gen, a.repeat)
    print(
        f"generation  {a.prompts} prompts x {a.new_tokens} tokens: loop {g_loop:.3f} s, bare transformers "
        f"{g_bare:.3f} s, ratio {g_loop / g_bare:.3f}"
    )

    # a GRPO step
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def grpo(prepared: bool) -> float:
        t = AutoTokenizer.from_pretrained(path)
        if prepared:
            formats.prepare(t, fam.tool_parser)
        elif fam.tool_parser:  # TRL alone cannot read this family: given the same reader by hand
            t.response_template = formats.parser_template(t, fam.tool_parser)
        m = AutoModelForCausalLM.from_pretrained(path)
        args = GRPOConfig(
            output_dir=str(work / "trl"),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=a.new_tokens,
            max_steps=a.steps,
            report_to=[],
            logging_steps=1,
            use_cpu=a.device == "cpu",
            bf16=a.device != "cpu",
            save_strategy="no",
        )
        tr = GRPOTrainer(
            model=m,
            reward_funcs=[lambda completions, **kw: [float(len(str(c))) for c in completions]],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": u} for u in users]),
            processing_class=t,
            tools=TOOL_FUNCS,
        )
        t0 = time.perf_counter()
        tr.train()
        return (time.perf_counter() - t0) / a.steps

    s_loop, s_bare = grpo(True), grpo(False)
    print(
        f"GRPO step   {a.steps} steps: loop {s_loop:.3f} s/step, bare TRL {s_bare:.3f} s/step, "
        f"ratio {s_loop / s_bare:.3f}"
    )

    # a served request
    from types import SimpleNamespace

    from hermes_lab.config.schema import load_config
    from hermes_lab.live.local import GenerationWorker, LocalArm

    cfg = load_config(None, {"model.tool_parser": fam.tool_parser} if fam.tool_parser else None)
    worker = GenerationWorker(cfg.serve.batch_wait_ms / 1000, cfg.serve.max_batch)
    spec = SimpleNamespace(name="baseline", served_model="m", base=str(path), adapter=None)
    arm = LocalArm(spec, SimpleNamespace(model=model, tokenizer=tok), worker, cfg)

    async def serve_all():
        payloads = [{"messages": u, "tools": tool_schemas(), "max_tokens": a.new_tokens} for u in users]
        await asyncio.gather(*(arm._generate(pl, f"r{i}") for i, pl in enumerate(payloads)))

    r_loop = timed(lambda: asyncio.run(serve_all()), a.repeat) / a.prompts
    worker.close()
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        print(
            f"served      {a.prompts} requests: gateway arm {r_loop * 1000:.1f} ms/request; "
            "bare vLLM skipped (not installed)"
        )
        return 0
    llm = LLM(model=str(path), enable_lora=True, max_loras=4)
    sp = SamplingParams(temperature=0.9, max_tokens=a.new_tokens)
    r_bare = timed(lambda: llm.chat(users, sp, tools=tool_schemas()), a.repeat) / a.prompts
    print(
        f"served      {a.prompts} requests: gateway arm {r_loop * 1000:.1f} ms/request, bare vLLM "
        f"{r_bare * 1000:.1f} ms/request, ratio {r_loop / r_bare:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
