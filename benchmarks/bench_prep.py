"""Benchmark: prep (ingest + validate + dedup + split + datasets on disk) on 1,000,000 and 5,000,000 trajectories,
and on 100,000 Hermes-shaped agent conversations.

Goals: at most 60 s for 1M records on 2 cores; peak memory (RSS) at most 1.5 GiB for 5M records, whatever
the input size (prep streams within ``data.memory_budget_mb``). Each size runs prep in a fresh child process;
its peak RSS is the child's ``ru_maxrss`` (os.wait4), so the parent's generator and the other size do not
count. Time is reported against a bare ``datasets.load_dataset("json", ...)`` of the same file at the first
size, measured in the same run (a lower bound: it parses, but validates, dedups and splits nothing). Plots are
skipped (make_plots=False); the review sample is included. Not a test: run it by hand or via ``make bench``
(generating 5M lines takes a few minutes on a loaded machine).

Conversations (``--conversations``, default 100,000): Hermes Agent ShareGPT trajectories shaped like the real
ones (tests/fixtures/hermes/trajectory_samples.jsonl: the system turn with its <tools> schemas, the task, a
<think> + <tool_call> turn, a <tool_response>, the answer; ~10 KB a line, every one distinct but 1% repeated
lines), through the same prep in a child: conversations/s and peak RSS, beside ``datasets.load_dataset("json")``
of the same file (which parses it and nothing else). Peak RSS counts the pages of the memory-mapped Arrow files
datasets writes and reads (the kernel reclaims those); the heap (RssAnon, sampled in the child) is what
``data.memory_budget_mb`` bounds.

Issue 44's formats (``--formats``, default 20,000 each): a Hermes ``sessions export`` file, a Claude Code /
Agent Trace file, Atropos scored groups, made from the real fixtures' lines (``write_format``), one line each:
conversations/s and the ratio to ``datasets.load_dataset("json")`` of the same file.

    .venv/bin/python benchmarks/bench_prep.py [--records 1000000 5000000] [--conversations 100000] [--formats 20000]
                                             [--budget-mb 512] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_records(path: Path, n: int, seed: int = 0) -> None:
    """n valid records: half on embedded tasks (family from the prompt; their few distinct wrong answers make
    ~40% of all lines exact duplicates), half on n/20 synthetic tasks with a "family" field; every 100th line
    is repeated. All lines are valid so that load_dataset can read the same file."""
    from hermes_lab.tasks import suite as tasks

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


def write_conversations(path: Path, n: int, seed: int = 0) -> None:
    """n Hermes-shaped trajectory lines (~10 KB each) from the real fixture's first line: each with its own
    task, command, tool output and answer; every 100th line repeats the one before (an exact duplicate)."""
    rng = random.Random(seed)
    fixture = ROOT / "tests" / "fixtures" / "hermes" / "trajectory_samples.jsonl"
    base = json.loads(fixture.read_text().splitlines()[0])
    system = base["conversations"][0]["value"]
    words = ["disk", "kernel", "printer", "billing", "logs", "cache", "network", "backup", "cron", "users"]
    prev = ""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            if i % 100 == 99 and prev:
                f.write(prev)
                continue
            topic = " ".join(rng.choice(words) for _ in range(3))
            cmd = f"grep -c {rng.choice(words)} /var/log/{rng.choice(words)}-{i}.log"
            output = "\n".join(f"{rng.choice(words)}-{rng.randrange(10**6)}: ok" for _ in range(110))
            result = json.dumps({"tool_call_id": f"call_{i}", "name": "terminal", "content": {"output": output}})
            call = json.dumps({"name": "terminal", "arguments": {"command": cmd}})
            think = f"<think>\nI will look at the {topic} first.\n</think>\n"
            turns = [
                {"from": "system", "value": system},
                {"from": "human", "value": f"Task {i}: check the {topic} and report what you find."},
                {"from": "gpt", "value": f"{think}<tool_call>\n{call}\n</tool_call>"},
                {"from": "tool", "value": f"<tool_response>\n{result}\n</tool_response>"},
                {"from": "gpt", "value": f"<think>\n</think>\nThe {topic} look fine: {rng.randrange(1000)} lines."},
            ]
            stamp = f"2026-01-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}"
            rec = {"conversations": turns, "timestamp": stamp, "model": "bench", "completed": rng.random() < 0.85}
            prev = json.dumps(rec, ensure_ascii=False) + "\n"
            f.write(prev)


def write_format(path: Path, fmt: str, n: int) -> int:
    """n conversations in one of issue 44's formats, each from the real fixtures' lines (tests/fixtures/
    hermes_exports/, tests/fixtures/atropos/) with its own task, tool output and answer, so that none is a
    duplicate: ``hermes_export`` (a session a line), ``claude_code`` (a trace's lines a session, one file),
    ``atropos`` (n // 4 groups of 4 completions). Returns the number of conversations written."""
    fix = ROOT / "tests" / "fixtures"
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        if fmt == "hermes_export":
            base = [json.loads(x) for x in (fix / "hermes_exports" / "sessions.jsonl").read_text().splitlines()]
            base = [b for b in base if not b["parent_session_id"] and b["end_reason"] != "compression"]
            for i in range(n):
                r = json.loads(json.dumps(base[i % len(base)]))
                r["id"] = f"bench_{i:08d}"
                for m in r["messages"]:
                    m["session_id"] = r["id"]
                    if m["role"] in ("user", "tool") and isinstance(m["content"], str):
                        m["content"] = f"{m['content']} [{i}]"
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
            return n
        if fmt == "claude_code":
            traces = sorted((fix / "hermes_exports" / "traces").glob("*.jsonl"))
            base = [[json.loads(x) for x in t.read_text().splitlines()] for t in traces[:5]]
            for i in range(n):
                lines = json.loads(json.dumps(base[i % len(base)]))
                for k, r in enumerate(lines):
                    r["sessionId"], r["uuid"] = f"bench-{i:08d}", f"{i:08d}-{k:04d}"
                    r["parentUuid"] = f"{i:08d}-{k - 1:04d}" if k else None
                    c = r["message"]["content"]
                    if isinstance(c, str):
                        r["message"]["content"] = f"{c} [{i}]"
                    elif c and c[0].get("type") == "tool_result":
                        c[0]["content"] = f"{c[0]['content']} [{i}]"
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            return n
        base = [json.loads(x) for x in (fix / "atropos" / "groups.jsonl").read_text().splitlines()]
        base = [g for g in base if g["messages"] and len(g["messages"][0]) == 3]  # the single-turn groups
        for i in range(max(1, n // 4)):
            g = json.loads(json.dumps(base[i % len(base)]))
            for k, msgs in enumerate(g["messages"]):
                msgs[1]["content"] = f"{msgs[1]['content']} [{i}]"
                msgs[2]["content"] = f"{msgs[2]['content']} ({k})"
            f.write(json.dumps(g) + "\n")
            written += len(g["messages"])
    return written


ROOT = Path(__file__).resolve().parents[1]
GOAL_S = 60.0  # at 1M records
GOAL_RSS_GIB = 1.5  # at 5M records
CHILD = """
import json, sys, threading, time
from hermes_lab.config.schema import load_config
from hermes_lab.data.prep import run_prep
anon = [0]
def sample():  # the heap's peak (RssAnon); ru_maxrss also counts the pages of memory-mapped Arrow files
    while True:
        try:
            with open("/proc/self/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("RssAnon"))
        except (OSError, StopIteration):
            return
        anon[0] = max(anon[0], kb)
        time.sleep(0.1)
threading.Thread(target=sample, daemon=True).start()
cfg = load_config(None, overrides={"data.min_samples": 1, "data.memory_budget_mb": int(sys.argv[3])})
t = time.perf_counter()
res = run_prep([sys.argv[1]], sys.argv[2], cfg, make_plots=False)
print(json.dumps({"seconds": time.perf_counter() - t, "summary": res.summary, "anon_kb": anon[0]}, default=str))
"""


def run_child(data: Path, out: Path, budget_mb: int) -> tuple[dict, float]:
    """prep in a fresh interpreter: (its result, its peak RSS in GiB)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data), str(out), str(budget_mb)],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
    )
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"prep child failed with exit code {proc.returncode}")
    return json.loads(stdout.decode().strip().splitlines()[-1]), usage.ru_maxrss / 2**20  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="*", default=[1_000_000, 5_000_000], help="seed records (none: skip)")
    ap.add_argument("--conversations", type=int, default=100_000, help="Hermes conversations (0: skip)")
    ap.add_argument(
        "--formats",
        type=int,
        default=20_000,
        help="conversations per issue-44 format (hermes_export, claude_code, atropos; 0: skip)",
    )
    ap.add_argument("--budget-mb", type=int, default=512, help="data.memory_budget_mb for prep")
    ap.add_argument("--keep", default=None, help="write into this dir instead of a temp dir")
    args = ap.parse_args(argv)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="bench-prep-")
    root = Path(args.keep) if args.keep else Path(tmp_ctx.name)
    root.mkdir(parents=True, exist_ok=True)
    ok = True
    for i, n in enumerate(args.records or []):
        data = root / f"trajectories-{n}.jsonl"
        t = time.perf_counter()
        write_records(data, n)
        size = data.stat().st_size
        print(f"wrote {n:,} records, {size / 2**20:.1f} MiB in {time.perf_counter() - t:.1f} s", flush=True)
        res, rss = run_child(data, root / f"prep-{n}", args.budget_mb)
        t_prep, s = res["seconds"], res["summary"]
        k = s["counts"]
        print(
            f"prep {n:,}: {t_prep:.1f} s ({s['timing_s']}) -> {k['accepted']:,} accepted, "
            f"{k['rejected']:,} rejected, {k['duplicates']:,} duplicates, "
            f"{s['split']['grpo_prompts']:,} GRPO / {s['split']['heldout_prompts']:,} held-out prompts; "
            f"{n / t_prep / 1e3:.0f} k records/s; peak RSS {rss:.2f} GiB, heap {res['anon_kb'] / 2**20:.2f} GiB "
            f"({rss * 2**30 / size:.2f}x the input; "
            f"{s['memory']['partitions']} partitions, budget {args.budget_mb} MiB)",
            flush=True,
        )
        if n == 1_000_000:
            met = t_prep <= GOAL_S
            ok &= met
            print(f"goal <= {GOAL_S:.0f} s at 1M: {'met' if met else 'MISSED'}")
        if n == 5_000_000:
            met = rss <= GOAL_RSS_GIB
            ok &= met
            print(f"goal peak RSS <= {GOAL_RSS_GIB} GiB at 5M: {'met' if met else 'MISSED'}")
        if i == 0:
            import datasets

            datasets.disable_progress_bars()
            t = time.perf_counter()
            ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(root / "hf-cache"))
            t_hf = time.perf_counter() - t
            print(f"datasets.load_dataset('json'): {t_hf:.1f} s for {len(ds):,} rows (cold cache)")
            print(f"ratio prep / load_dataset: {t_prep / t_hf:.2f}x")
            del ds
        data.unlink()
    if args.conversations:
        bench_conversations(root, args.conversations, args.budget_mb)
    for fmt in ("hermes_export", "claude_code", "atropos") if args.formats else ():
        bench_format(root, fmt, args.formats, args.budget_mb)
    tmp_ctx.cleanup()
    return 0 if ok else 1


def bench_conversations(root: Path, n: int, budget_mb: int) -> None:
    """One line: prep on n Hermes conversations (conversations/s, peak RSS) beside load_dataset('json')."""
    data = root / f"hermes-{n}.jsonl"
    t = time.perf_counter()
    write_conversations(data, n)
    size = data.stat().st_size
    took = time.perf_counter() - t
    print(f"wrote {n:,} Hermes conversations, {size / 2**20:.1f} MiB ({size / n / 1024:.1f} KiB each) in {took:.1f} s")
    res, rss = run_child(data, root / f"prep-hermes-{n}", budget_mb)
    t_prep, s = res["seconds"], res["summary"]
    k, conv = s["counts"], s["conversations"]
    import datasets

    datasets.disable_progress_bars()
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(root / "hf-cache-conv"))
    t_hf = time.perf_counter() - t
    print(
        f"prep {n:,} Hermes conversations: {t_prep:.1f} s ({s['timing_s']}) -> {k['accepted']:,} accepted, "
        f"{k['duplicates']:,} duplicates, {k['rejected']:,} rejected; {n / t_prep:,.0f} conversations/s, "
        f"{conv['tool_calls']['total']:,} tool calls; peak RSS {rss:.2f} GiB, of it heap {res['anon_kb'] / 2**20:.2f} "
        f"GiB (the rest: mapped Arrow files; input {size / 2**30:.2f} GiB, {s['memory']['partitions']} partitions, "
        f"budget {budget_mb} MiB) | datasets.load_dataset('json'): "
        f"{t_hf:.1f} s for {len(ds):,} rows ({n / t_hf:,.0f}/s); ratio prep / load_dataset {t_prep / t_hf:.2f}x",
        flush=True,
    )
    del ds
    data.unlink()


def bench_format(root: Path, fmt: str, n: int, budget_mb: int) -> None:
    """One line: prep on n conversations of one format (conversations/s, peak RSS) beside load_dataset('json') of
    the same file (which may refuse a file whose lines differ in shape: said so)."""
    data = root / f"{fmt}-{n}.jsonl"
    n = write_format(data, fmt, n)
    size = data.stat().st_size
    res, rss = run_child(data, root / f"prep-{fmt}", budget_mb)
    t_prep, s = res["seconds"], res["summary"]
    k = s["counts"]
    import datasets

    datasets.disable_progress_bars()
    t = time.perf_counter()
    try:
        ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(root / f"hf-{fmt}"))
        t_hf = time.perf_counter() - t
        hf = f"{t_hf:.1f} s for {len(ds):,} rows; ratio prep / load_dataset {t_prep / t_hf:.2f}x"
        del ds
    except Exception as e:  # pyarrow's JSON reader may refuse mixed shapes: reported, not fatal
        hf = f"cannot read it ({type(e).__name__}: {str(e)[:80]})"
    print(
        f"prep {n:,} {fmt} conversations ({size / 2**20:.0f} MiB): {t_prep:.1f} s -> {k['accepted']:,} accepted, "
        f"{k['duplicates']:,} duplicates, {k['rejected']:,} rejected; {n / t_prep:,.0f} conversations/s; peak RSS "
        f"{rss:.2f} GiB | datasets.load_dataset('json'): {hf}",
        flush=True,
    )
    data.unlink()


if __name__ == "__main__":
    sys.exit(main())
