"""Benchmark: the sandbox's throughput and what each of its layers costs, and the tests reward's share of a GRPO
step on the code family.

1. Executions per second: ``--n`` completions (1,000 by default) x 3 tests each (the embedded code family's
   hidden asserts; every completion distinct, so the cache never answers), scored by the tests machinery
   (``TestRunner``, with the grading harness the tests reward sends) on the local executor, ``--workers`` runs
   at once (default 2: this project's machine). The arms, in one run so the ratios are measured under the same
   load:
   - ``sandbox``: the local executor as training uses it: runs forked from a warm launcher inside bubblewrap's
     root, each in a mount+pid namespace with tmpfs work dir, /tmp and /dev/shm, a seccomp filter, a cgroup,
     no privileges, the audit hook;
   - ``- seccomp``, ``- cgroup``, ``- tmpfs root``: the same with that one layer off (``- tmpfs root``: no
     namespaces, no bubblewrap root, no Landlock either): what each layer costs;
   - ``fallback``: no namespaces, Landlock instead (what a machine without user namespaces runs);
   - ``rlimits only``: the fork server with every layer off;
   - ``bare python``: one ``python -S`` per program, no sandbox at all (the same programs, through the same
     TestRunner).
   - ``in-process harness``: the full sandbox running the tests reward's harness of before issue 42 (the tests,
     their marker and the completion in one process: what a completion could reach), beside ``sandbox``'s
     judge-and-candidate harness (two processes, calls over pipes): what the verdict's safety costs.
2. A GRPO step's time on the code family: the tiny policy (built once under runs/policies/) trains
   ``--steps`` steps on code-family prompts only, with ``reward.types: [tests]``; the tests reward is timed
   around each call, the step by TRL's own ``step_time`` (generation, rewards, forward and backward).

Not a test: run it by hand or via ``make bench``.

    .venv/bin/python benchmarks/bench_sandbox.py [--n 1000] [--workers 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hermes_lab.sandbox.executor import Executor, Limits, RunRequest, RunResult

ROOT = Path(__file__).resolve().parents[1]


def completions(n: int) -> tuple[list[str], list]:
    """n distinct (completion, spec) pairs from the code family: right, another right form, or a slip."""
    from hermes_lab.tasks import code as C
    from hermes_lab.tasks import suite as T

    rng = random.Random(0)
    seen: set[tuple[str, str]] = set()
    codes, specs = [], []
    for t in T.generate_tasks(20 * n, split="any", seed=1, families=["code"]):
        x = T.input_of(t)
        c = rng.choice([t.answer, C.variant(x, rng), T.corrupt(t.answer, rng)])
        if (c, x) in seen:
            continue
        seen.add((c, x))
        codes.append(c)
        specs.append(C.spec(x))
        if len(codes) == n:
            break
    return codes, specs


class BareExecutor(Executor):
    """No sandbox: ``python -S -c program`` with the run's stdin, one process per run (the floor to compare to)."""

    name = "bare"

    def run_one(self, req: RunRequest, limits: Limits) -> RunResult:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "program.py"  # a file: a harness is longer than one argument may be
            path.write_text(req.program)
            cmd = [os.path.realpath(sys.executable), "-S", "-s", "-B", str(path)]
            try:
                p = subprocess.run(
                    cmd, input=req.stdin, capture_output=True, text=True, timeout=limits.timeout_s + 5, cwd=d
                )
            except subprocess.TimeoutExpired:
                return RunResult("timeout")
        return RunResult("ok" if p.returncode == 0 else "error", p.returncode, p.stdout, p.stderr)


# The tests reward's harness before issue 42, for the code family's assert specs only: one process holds the
# completion, the tests and the report (what a completion could reach: the hostile set's 22 paid cases).
IN_PROCESS = """\
import os as _os
_out, _write, _exec, _compile, _isinstance = _os.dup(1), _os.write, exec, compile, isinstance
def _report(kind, marks):
    _write(_out, ("\\n%s %s %s\\n" % ("HERMES-bench", kind, marks or "-")).encode())
_g = {{"__name__": "__main__", "__builtins__": __builtins__}}
_exec(_compile({solution!r}, "solution.py", "exec"), _g)
_marks = ""
for _i, _t in enumerate({tests!r}):
    try:
        _exec(_compile(_t, "test_%d.py" % _i, "exec"), _g)
        _marks += "1"
    except BaseException:
        _marks += "0"
_report("done", _marks)
"""


def in_process_requests(codes: list[str], specs: list) -> list[RunRequest]:
    return [RunRequest(IN_PROCESS.format(solution=s.prefix + c, tests=s.tests)) for c, s in zip(codes, specs)]


ARMS = {
    "sandbox": {},
    "in-process harness": {},
    "- seccomp": {"seccomp": False},
    "- cgroup": {"cgroup": False},
    "- tmpfs root": {"isolate": False, "landlock": False},
    "fallback": {"isolate": False},
    "rlimits only": {"isolate": False, "landlock": False, "seccomp": False, "cgroup": False, "guard": False},
    "bare python": None,
}


def throughput(n: int, workers: int) -> dict[str, float]:
    from hermes_lab.sandbox.local import LocalExecutor
    from hermes_lab.sandbox.specs import TestRunner
    from hermes_lab.tasks.code import LIMITS

    codes, specs = completions(n)
    secs: dict[str, float] = {}
    kinds: dict[str, int] = {}
    for name, switches in ARMS.items():
        ex = BareExecutor(workers) if switches is None else LocalExecutor(workers=workers, **switches)
        if name == "sandbox":
            rep = ex.describe()
            print(f"  sandbox: {rep['mode']}, missing: {rep['missing'] or 'nothing'}; {rep['cgroup']}")
        runner = TestRunner(ex, LIMITS, cache_size=0)
        runner.score(list(codes[:20]), list(specs[:20]))  # the fork server started, the filter built
        t0 = time.perf_counter()
        if name == "in-process harness":
            out = ex.run_many(in_process_requests(codes, specs), LIMITS)
            assert sum(r.stdout.rstrip().endswith(" done 111") for r in out) > n // 2, out[0]
        else:
            out = runner.score(list(codes), list(specs))
        secs[name] = time.perf_counter() - t0
        if name == "sandbox":
            for o in out:
                kinds[o.kind] = kinds.get(o.kind, 0) + 1
        ex.close()
        print(
            f"  {name:14s} {n} completions x 3 tests in {secs[name]:6.1f} s: "
            f"{3 * n / secs[name]:6.1f} test executions/s ({n / secs[name]:5.1f} programs/s)"
        )
    print(f"  outcomes (sandbox arm): {kinds}")
    return secs


def grpo_share(steps: int) -> tuple[float, float, int]:
    """(mean step time, mean tests-reward time per step, steps) of a short training on the code family."""
    import datasets
    from datasets import Dataset

    from hermes_lab.config.schema import load_config
    from hermes_lab.rewards import registry as R
    from hermes_lab.tasks import suite as T
    from hermes_lab.train.grpo import train

    spent: list[float] = []
    make = R.REGISTRY["tests"]

    def timed_factory(cfg):  # the real tests reward, timed around each call TRL makes
        fn = make(cfg)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent.append(time.perf_counter() - t0)

        timed.__name__, timed.sandbox = fn.__name__, fn.sandbox
        return timed

    R.REGISTRY["tests"] = timed_factory
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        ts = T.generate_tasks(200, split="train", seed=0, families=["code"])
        data = Path(tmp) / "grpo_dataset"
        Dataset.from_dict(
            {"prompt": [t.prompt for t in ts], "tests": [json.dumps(T.tests_of(t)) for t in ts]}
        ).save_to_disk(str(data))
        cfg = load_config(
            ROOT / "params" / "embedded.yaml",
            {
                "grpo.max_steps": steps,
                "reward.types": ["tests"],
                "reward.weights": [1.0],
                "round.runs_dir": str(ROOT / "runs"),
            },
        )
        with (
            open(Path(tmp) / "train.log", "w") as log,
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
        ):
            train(cfg, data, Path(tmp) / "train", evaluate_heldout=False)  # TRL's per-step lines: not ours to print
        rows = [json.loads(x) for x in (Path(tmp) / "train" / "train_log.jsonl").read_text().splitlines()]
        step_times = [r["step_time"] for r in rows if "step_time" in r]
        health = json.loads((Path(tmp) / "train" / "health.json").read_text())
    R.REGISTRY["tests"] = make
    print(f"  sandbox in training: {health['sandbox']['by_kind']}, {health['sandbox']['executions']} runs")
    return sum(step_times) / len(step_times), sum(spent) / len(spent), len(step_times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1000, help="completions (x 3 tests each)")
    p.add_argument("--workers", type=int, default=2, help="runs at once (this project's machine has 2 cores)")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps on the code family (0: skip)")
    a = p.parse_args()
    print(f"== sandbox throughput: {a.n} completions x 3 tests, {a.workers} workers")
    secs = throughput(a.n, a.workers)
    s = secs["sandbox"]
    costs = ", ".join(f"{layer[2:]} {s / secs[layer]:.2f}x" for layer in ("- seccomp", "- cgroup", "- tmpfs root"))
    print(
        f"sandbox: {3 * a.n / s:.0f} test executions/s ({a.n / s:.0f} programs/s) on {a.workers} workers; "
        f"each layer's cost (the sandbox's time over the same without it): {costs}; all layers "
        f"{s / secs['rlimits only']:.2f}x the rlimits-only fork server; the fallback (Landlock) "
        f"{secs['fallback'] / s:.2f}x the sandbox's time; {secs['bare python'] / s:.1f}x faster than a bare python "
        "per program"
    )
    old = secs["in-process harness"]
    print(
        f"the grading harness (judge and candidate in two processes): {3 * a.n / s:.0f} test executions/s; the "
        f"in-process harness of before: {3 * a.n / old:.0f}/s: the verdict out of the completion's reach costs "
        f"{s / old:.2f}x its time"
    )
    if a.steps:
        print(f"== a GRPO step on the code family ({a.steps} steps, the tiny policy, reward.types: [tests])")
        step, reward, n = grpo_share(a.steps)
        print(
            f"GRPO step {step:.2f} s, of which the tests reward {reward:.2f} s: "
            f"{reward / step:.0%} of the step ({n} steps)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
