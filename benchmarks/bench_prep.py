"""Benchmark: prep (ingest + validate + dedup + split + datasets on disk) on 1,000,000 trajectories.

Goal: at most 60 s on 2 cores. Reported against a bare ``datasets.load_dataset("json", ...)`` of the same
file, measured in the same run (a lower bound: it parses, but validates, dedups and splits nothing).
Plots are skipped (make_plots=False); the review sample is included. Not a test: run it by hand or via
``make bench``.

    .venv/bin/python benchmarks/bench_prep.py [--records 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 60.0


def write_records(path: Path, n: int, seed: int = 0) -> None:
    """n valid records: half on embedded tasks (family from the prompt; their few distinct wrong answers make
    ~40% of all lines exact duplicates), half on n/20 synthetic tasks with a "family" field; every 100th line
    is repeated. All lines are valid so that load_dataset can read the same file."""
    from hermes_lab import tasks

    rng = random.Random(seed)
    pool = tasks.generate_tasks(2000, split="any", seed=seed)
    words = ["ok", "done", "the printer", "billing", "refund issued", "login fixed", "escalated", "no answer"]
    n_syn = max(1, n // 20)
    lines: list[str] = []
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            if i % 100 == 99 and lines:
                lines.append(lines[-1])
                continue
            if i % 2:
                t = pool[rng.randrange(len(pool))]
                resp = t.answer if rng.random() < 0.4 else tasks.corrupt(t.answer, rng)
                rec = {
                    "prompt": t.prompt,
                    "response": resp,
                    "reward": tasks.verify(t.prompt, resp),
                    "task_id": t.task_id,
                }
            else:
                j = rng.randrange(n_syn)
                rec = {
                    "prompt": f"Summarise support ticket #{j} in one line and name the product.",
                    "response": f"{rng.choice(words)} {rng.choice(words)} #{rng.randrange(50)}",
                    "reward": round(rng.uniform(0, 5), 3),
                    "task_id": f"ticket-{j:07d}",
                    "family": "support",
                }
            rec["request_id"] = f"req-{i:08d}"
            lines.append(json.dumps(rec) + "\n")
            if len(lines) >= 100_000:
                f.writelines(lines)
                lines.clear()
        f.writelines(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keep", default=None, help="write into this dir instead of a temp dir")
    args = ap.parse_args(argv)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="bench-prep-")
    root = Path(args.keep) if args.keep else Path(tmp_ctx.name)
    root.mkdir(parents=True, exist_ok=True)
    data = root / "trajectories.jsonl"
    t = time.perf_counter()
    write_records(data, args.records)
    size = data.stat().st_size
    print(f"wrote {args.records:,} records, {size / 2**20:.1f} MiB in {time.perf_counter() - t:.1f} s")

    from hermes_lab.config import load_config
    from hermes_lab.prep import run_prep

    cfg = load_config(None, overrides={"data.min_samples": 1})
    t = time.perf_counter()
    res = run_prep([data], root / "prep", cfg, make_plots=False)
    t_prep = time.perf_counter() - t
    k = res.summary["counts"]
    print(
        f"prep: {t_prep:.1f} s ({res.summary['timing_s']}) -> {k['accepted']:,} accepted, "
        f"{k['rejected']:,} rejected, {k['duplicates']:,} duplicates, "
        f"{res.summary['split']['grpo_prompts']:,} GRPO / {res.summary['split']['heldout_prompts']:,} held-out "
        f"prompts; {args.records / t_prep / 1e3:.0f} k records/s, {size / t_prep / 2**20:.1f} MiB/s"
    )

    import datasets

    datasets.disable_progress_bars()
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(root / "hf-cache"))
    t_hf = time.perf_counter() - t
    print(f"datasets.load_dataset('json'): {t_hf:.1f} s for {len(ds):,} rows (cold cache)")
    print(
        f"ratio prep / load_dataset: {t_prep / t_hf:.2f}x; goal <= {GOAL_S:.0f} s: "
        f"{'met' if t_prep <= GOAL_S else 'MISSED'}"
    )
    tmp_ctx.cleanup()
    return 0 if t_prep <= GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
