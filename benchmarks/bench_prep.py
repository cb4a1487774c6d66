"""Benchmark: prep (ingest + validate + dedup + split + datasets on disk) on 1,000,000 seed records, 100,000
Hermes-shaped agent conversations and issue 44's formats, each beside ``datasets.load_dataset("json")`` of the same
file, and before / after in one run.

Goals (issue 45, on 2 cores): 1,000,000 seed records in <= 2.5x ``load_dataset`` with peak RSS <= 0.26 GiB;
100,000 Hermes conversations (~10 KB each) in <= 4x with peak RSS <= 1.22 GiB; and at 5,000,000 records (``--records
1000000 5000000``) peak RSS <= 1.5 GiB (prep streams within ``data.memory_budget_mb``). Each measurement runs prep in
a fresh child process; its peak RSS is the child's own (VmHWM, which it reads at its end) or the largest of the
worker processes it reaped (their ``ru_maxrss``), so the parent's generator and ``load_dataset`` do not count (the
``ru_maxrss`` os.wait4 gives for the child also counts the parent's pages, shared by the spawn until exec).
``load_dataset`` of each file is timed once, in the same run, with a cold cache (a lower bound: it parses, but
validates, dedups and splits nothing). Plots are skipped (make_plots=False); the review sample is included. Not a
test: run it by hand or via ``make bench``.

``--before DIR``: the same measurements with another checkout of the package (its ``hermes_lab`` first on the
child's path), alternating with this one's on the same files, so that before / after are measured in one run
(``git worktree add /tmp/prep-before feed864~1``: the code before issue 45). ``--profile``: this checkout's prep
under cProfile once per input kind, in one process (a separate child, not the timed one; the conversions the
worker processes make are then in it): where the remaining time goes, own time and cumulative. Each timed line
also gives the CPU time of prep's process (its threads: Arrow's too) and of its worker processes. The run ends
with issue 45's "done when" lines: the two ratios and the two peak RSS figures against their goals (exit 1 when
one is missed).

Seed records (``write_records``): half embedded tasks (family from the prompt; a few distinct wrong answers make
~40% of lines exact duplicates), half synthetic support tickets with a family field; every 100th line repeated.
Conversations (``write_conversations``): Hermes Agent ShareGPT trajectories shaped like the real ones
(tests/fixtures/hermes/trajectory_samples.jsonl: the system turn with its <tools> schemas, the task, a <think> +
<tool_call> turn, a <tool_response>, the answer; ~10 KB a line, 1% repeated lines). Issue 44's formats
(``--formats``, default 20,000 each; ``write_format``): a Hermes ``sessions export`` file, a Claude Code / Agent
Trace file, Atropos scored groups, made from the real fixtures' lines. Peak RSS counts the pages of the
memory-mapped Arrow files datasets writes and reads (the kernel reclaims those); the heap (RssAnon, sampled in the
child) is what ``data.memory_budget_mb`` bounds.

    .venv/bin/python benchmarks/bench_prep.py [--records 1000000] [--conversations 100000] [--formats 20000]
                                             [--before DIR] [--profile] [--budget-mb 512] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


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
                    "reward": tasks.score(t.answer, resp),  # the verifier's formula; no sandbox for the code family
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
GOALS = {"records": (2.5, 0.26), "conversations": (4.0, 1.22)}  # (x load_dataset, peak RSS GiB) at 1M / 100k
GOAL_RSS_GIB_5M = 1.5
PROFILE_CONVERSATIONS = 10_000  # --profile: a conversation file's first lines (one process: ~1.5 ms a line)
CHILD = """
import json, os, resource, sys, threading, time
import datasets, pyarrow.json  # imported before the clock starts, as in a warm process (a notebook's)
from hermes_lab.config.schema import load_config
from hermes_lab.prep.run import run_prep
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
prof = None
if sys.argv[4] == "1":  # one process: the conversions the workers make are in the profile
    import cProfile
    from hermes_lab.prep import conversations
    conversations.PARALLEL_MIN = 1 << 62
    prof = cProfile.Profile()
    prof.enable()
t, cpu = time.perf_counter(), time.process_time()
res = run_prep([sys.argv[1]], sys.argv[2], cfg, make_plots=False)
took, cpu = time.perf_counter() - t, time.process_time() - cpu
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
top = []
if prof is not None:
    import pstats
    prof.disable()
    st = pstats.Stats(prof).stats
    for key in ("tottime", "cumtime"):
        k = 2 if key == "tottime" else 3
        rows = sorted(st.items(), key=lambda kv: -kv[1][k])
        if key == "cumtime":  # the package's own steps, not the interpreter's wrappers
            rows = [kv for kv in rows if "hermes_lab" in kv[0][0]]
        top.append([key, [[f"{f.split('hermes_lab/')[-1].split('site-packages/')[-1]}:{l}({n})", round(v[k], 3), v[1]]
                          for (f, l, n), v in rows[:14]]])
print(json.dumps({"seconds": took, "summary": res.summary, "anon_kb": anon[0], "profile": top, "cpu": cpu,
                  "workers_cpu": kids.ru_utime + kids.ru_stime, "workers_maxrss_kb": kids.ru_maxrss,
                  "hwm_kb": int(next(x.split()[1] for x in open("/proc/self/status") if x.startswith("VmHWM")))},
                 default=str))
"""


def run_child(data: Path, out: Path, budget_mb: int, root: Path = ROOT, profile: bool = False) -> tuple[dict, float]:
    """prep in a fresh interpreter on ``root``'s package: (its result, its peak RSS in GiB)."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(  # -P: the cwd's package (a checkout run from) does not shadow ``root``'s
        [sys.executable, "-P", "-c", CHILD, str(data), str(out), str(budget_mb), "1" if profile else "0"],
        stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=path),
    )
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    _, status, _ = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"prep child ({root}) failed with exit code {proc.returncode}")
    shutil.rmtree(out, ignore_errors=True)
    res = json.loads(stdout.decode().strip().splitlines()[-1])
    # the child's own peak (VmHWM) or its workers': wait4's ru_maxrss also counts the parent's pages that the
    # spawn shared before exec (~0.31 GiB once load_dataset has read 1,000,000 records), not prep's
    return res, max(res["hwm_kb"], res["workers_maxrss_kb"]) / 2**20  # KiB on Linux


def load_dataset_seconds(data: Path, cache: Path) -> tuple[float | None, str]:
    """``datasets.load_dataset('json')`` of the file, cold cache: (seconds, what it read), or (None, why not)."""
    import datasets

    datasets.disable_progress_bars()
    t, cpu = time.perf_counter(), time.process_time()
    try:
        ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    except Exception as e:  # pyarrow's JSON reader may refuse mixed shapes: reported, not fatal
        return None, f"cannot read it ({type(e).__name__}: {str(e)[:80]})"
    took, cpu = time.perf_counter() - t, time.process_time() - cpu
    n = len(ds)
    del ds
    shutil.rmtree(cache, ignore_errors=True)
    return took, f"{took:.1f} s (CPU {cpu:.1f} s) for {n:,} rows"


def measure(
    name: str, data: Path, n: int, args: Any, root_dir: Path, goal: tuple[float, float] | None, before: bool = True
) -> str | None:
    """One input: load_dataset once, then prep per variant (this checkout, and --before's), a line each; the goal
    checked on this checkout's; its profile with --profile. The done-when line of a goal's input (None: none)."""
    size = data.stat().st_size
    t_hf, hf = load_dataset_seconds(data, root_dir / f"hf-{data.stem}")
    print(f"{name}: {n:,} ({size / 2**20:.0f} MiB); datasets.load_dataset('json'): {hf}", flush=True)
    variants = [("after", ROOT)] + ([("before", Path(args.before))] if args.before and before else [])
    verdict = None
    for label, root in variants:
        res, rss = run_child(data, root_dir / f"prep-{data.stem}", args.budget_mb, root)
        t, s = res["seconds"], res["summary"]
        k = s["counts"]
        ratio = f"{t / t_hf:.2f}x load_dataset" if t_hf else "no load_dataset figure"
        print(
            f"  {label:6s} prep {t:6.1f} s ({ratio}; {s['timing_s']}), {n / t:,.0f}/s -> {k['accepted']:,} accepted, "
            f"{k['duplicates']:,} duplicates, {k['rejected']:,} rejected; peak RSS {rss:.2f} GiB, heap "
            f"{res['anon_kb'] / 2**20:.2f} GiB ({s['memory']['partitions']} partitions, budget {args.budget_mb} MiB); "
            f"CPU {res['cpu']:.1f} s, workers {res['workers_cpu']:.1f} s",
            flush=True,
        )
        if label == "after" and goal is not None:
            ratio_ok = bool(t_hf) and t / t_hf <= goal[0]
            verdict = (
                f"{name} ({n:,}): {f'{t / t_hf:.2f}x' if t_hf else 'no'} load_dataset (goal <= {goal[0]}x): "
                f"{'met' if ratio_ok else 'MISSED'}; peak RSS {rss:.2f} GiB (goal <= {goal[1]} GiB): "
                f"{'met' if rss <= goal[1] else 'MISSED'}"
            )
            print(f"  {verdict}", flush=True)
    if args.profile:
        src, what = data, f"{n:,}"
        if name != "seed records" and n > PROFILE_CONVERSATIONS:  # one process under cProfile: its first lines
            src, what = root_dir / f"head-{data.name}", f"the first {PROFILE_CONVERSATIONS:,} lines"
            with open(data, "rb") as f, open(src, "wb") as out:
                out.writelines(line for _, line in zip(range(PROFILE_CONVERSATIONS), f))
        res, _ = run_child(src, root_dir / f"prof-{data.stem}", args.budget_mb, ROOT, profile=True)
        if src != data:
            src.unlink()
        print(f"  profile of this checkout's prep in one process, {what} ({res['seconds']:.1f} s under cProfile):")
        for key, rows in res["profile"]:
            print(f"    by {key}: " + "; ".join(f"{fn} {sec:.2f} s" for fn, sec, _ in rows[:12]))
    return verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, nargs="*", default=[1_000_000], help="seed records (none: skip)")
    ap.add_argument("--conversations", type=int, default=100_000, help="Hermes conversations (0: skip)")
    ap.add_argument(
        "--formats",
        type=int,
        default=20_000,
        help="conversations per issue-44 format (hermes_export, claude_code, atropos; 0: skip)",
    )
    ap.add_argument("--before", default=None, metavar="DIR", help="another checkout: before / after in one run")
    ap.add_argument("--profile", action="store_true", help="profile this checkout's prep once per input kind")
    ap.add_argument("--budget-mb", type=int, default=512, help="data.memory_budget_mb for prep")
    ap.add_argument("--keep", default=None, help="write into this dir instead of a temp dir")
    args = ap.parse_args(argv)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="bench-prep-")
    root = Path(args.keep) if args.keep else Path(tmp_ctx.name)
    root.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    for n in args.records or []:
        data = root / f"trajectories-{n}.jsonl"
        t = time.perf_counter()
        write_records(data, n)
        print(f"wrote {n:,} records in {time.perf_counter() - t:.1f} s", flush=True)
        done.append(measure("seed records", data, n, args, root, GOALS["records"] if n == 1_000_000 else None))
        if n == 5_000_000:
            _, rss = run_child(data, root / "prep-5m", args.budget_mb)
            met = rss <= GOAL_RSS_GIB_5M
            done.append(f"seed records (5,000,000): peak RSS {rss:.2f} GiB (goal <= {GOAL_RSS_GIB_5M} GiB): "
                        f"{'met' if met else 'MISSED'}")  # fmt: skip
            print(f"  {done[-1]}")
        data.unlink()
    if args.conversations:
        n = args.conversations
        data = root / f"hermes-{n}.jsonl"
        write_conversations(data, n)
        done.append(
            measure("Hermes conversations", data, n, args, root, GOALS["conversations"] if n == 100_000 else None)
        )
        data.unlink()
    for fmt in ("hermes_export", "claude_code", "atropos") if args.formats else ():
        data = root / f"{fmt}-{args.formats}.jsonl"
        n = write_format(data, fmt, args.formats)
        measure(f"{fmt} conversations", data, n, args, root, None, before=False)  # issue 44's: no "before"
        data.unlink()
    tmp_ctx.cleanup()
    lines = [x for x in done if x]
    if lines:  # issue 45's "done when" (prep half), as measured in this run
        print(f"done when (on {len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f}):")
        for x in lines:
            print(f"  {x}")
    return 0 if all("MISSED" not in x for x in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
