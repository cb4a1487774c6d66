"""Property-based test of prep over generated JSONL lines, hostile ones included (hypothesis, 2,000 examples).

Each example writes one to three files of generated lines (records, near-records with one hostile field,
non-objects, byte-level damage: BOM, CR, invalid UTF-8, truncation, blank lines; sometimes gzip) and runs
prep's ingest on them in-process. Properties: nothing raises; per file, lines = blank + read and
read = accepted + rejected + duplicates; every line of the file is accounted for; each sink holds exactly
its count of lines and every written line reads back as strict JSON (and an accepted one passes the checks
again). Every 50th example also runs the whole of ``run_prep`` (tables, review sample, outliers, datasets),
which must end in a result or a defined refusal, never an exception of another kind."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hermes_lab.config.schema import load_config
from hermes_lab.prep import ingest as I
from hermes_lab.prep.run import GateRefused, run_prep

CFG = load_config(None, overrides={"data.min_samples": 1, "data.max_bad_fraction": 1.0, "data.max_line_bytes": 16384})
FAMILIES = ["c++", "$x^2$", r"$\frac$", "a/b", "..", ".", "_hidden", "", "x" * 300, "\u2028", "\x00nul", "upper"]
RAW_HOSTILE = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "4.9e-400",
    "1" + "0" * 5000,
    "-1" + "0" * 30,
    "1" + "0" * 25,
    '"\\ud800"',
    '"a\\udfff"',
    '"\\uDC80x"',
    '"\\ud83d\\ude00"',  # a valid surrogate pair
    "[" * 3000 + "]" * 3000,
    '{"a":' * 200 + "1" + "}" * 200,
    "true",
    "null",
    '"' + "y" * 5000 + '"',
    '"' + "z" * 20000 + '"',  # over data.max_line_bytes: "line too long"
]


def _json_pool(n: int = 80) -> list[str]:
    """Assorted JSON values (nested, unicode, big numbers) drawn once: sampling from a pool keeps each
    example cheap, so 2,000 of them fit in CI."""
    rng = random.Random(16)
    atoms = [None, True, False, 0, -1, 2**63, -(2**64), 1.5e308, 1e-320, 0.1, "", "é", "\u2028", "\x00", "日本", "😀"]

    def value(depth: int):
        if depth > 2 or rng.random() < 0.5:
            return rng.choice(atoms)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(["a", "b", "", "é"]): value(depth + 1) for _ in range(rng.randrange(3))}

    return [json.dumps(value(0), ensure_ascii=rng.random() < 0.5) for _ in range(n)]


VALUES = _json_pool() + RAW_HOSTILE + [json.dumps(f) for f in FAMILIES]
GOOD = {
    "prompt": ["up cat=", "rev abc=", "sort 312=", "p", " ", "Summarise #1"],
    "response": ["CAT", "cba", "123", "", "x"],
    "reward": [0, 1, 2.5, 5, 5.0, 4.999, -1, 7.5, "4.2", True],
    "task_id": ["t1", "t2", "upper-x", 7, ""],
}
EXTRA_KEYS = ["meta", "x", "family", "\\ud800", "", "reward"]  # "reward": a key twice
OTHER = [
    b"[1, 2]",
    b'"s"',
    b"42",
    b"null",
    b"{",
    b"}",
    b'{"a": }',
    b"",
    b"   \t",
    b"\xef\xbb\xbf",
    b"\xff\xfe",
    b"\x00",
]
DAMAGE = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]


def make_line(seed: int) -> bytes:
    """One generated line, hostile or not, from a seed hypothesis draws: one draw a line keeps 2,000
    examples fast (hypothesis still shrinks a failure to fewer, earlier lines and smaller seeds)."""
    rng = random.Random(seed)
    kind = rng.randrange(10)
    if kind == 0:
        line = rng.choice(OTHER)
    elif kind == 1:
        line = rng.choice(VALUES).encode("utf-8", "surrogatepass")
    else:  # a record, perhaps with a hostile or odd field, a key twice, or a field missing
        pairs = [(k, json.dumps(rng.choice(v))) for k, v in GOOD.items()]
        if rng.random() < 0.5:
            pairs.append(("family", json.dumps(rng.choice(FAMILIES))))
        for _ in range(rng.randrange(3)):
            key, value = rng.choice(EXTRA_KEYS), rng.choice(VALUES)
            if rng.random() < 0.5:  # a field of its own
                pairs.insert(rng.randrange(len(pairs) + 1), (key, value))
            else:  # a required field's value replaced by an odd one
                i = rng.randrange(len(pairs))
                pairs[i] = (pairs[i][0], value)
        if rng.randrange(5) == 0:
            del pairs[rng.randrange(len(pairs))]
        keys = [f'"{k}"' if k.startswith("\\") else json.dumps(k) for k, _ in pairs]
        line = ("{" + ", ".join(f"{k}: {v}" for k, (_, v) in zip(keys, pairs)) + "}").encode("utf-8", "surrogatepass")
    damage = rng.randrange(10)
    if damage == 0:
        return b"\xef\xbb\xbf" + line
    if damage == 1:
        return line + b"\r"
    if damage == 2:
        i = rng.randrange(len(line) + 1)
        return line[:i] + rng.choice(DAMAGE) + line[i:]
    if damage == 3:
        return line[: rng.randrange(len(line) + 1)]
    return line


line_st = st.integers(0, 2**32 - 1).map(make_line)
files_st = st.lists(
    st.tuples(st.lists(line_st, min_size=1, max_size=15), st.booleans(), st.booleans()), min_size=1, max_size=3
)  # (lines, gzip it, end with a newline)
_calls = {"n": 0}


def _physical_lines(data: bytes) -> int:
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} in a written line")


def _strict(line: str) -> None:
    json.loads(line, parse_constant=_no_constant)


@pytest.mark.slow
@settings(
    max_examples=int(os.environ.get("HERMES_FUZZ_EXAMPLES", "2000")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(files_st)
def test_prep_never_crashes_and_every_line_is_accounted_for(files):
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-prep-"))
    try:
        paths, raw = [], {}
        for i, (lines, gz, trailing) in enumerate(files):
            data = b"\n".join(lines) + (b"\n" if trailing else b"")
            p = tmp / (f"in{i}.jsonl.gz" if gz else f"in{i}.jsonl")
            p.write_bytes(gzip.compress(data) if gz else data)
            paths.append(p)
            raw[str(p)] = data
        inputs, negs = paths[:-1] or paths, paths[-1:] if len(paths) > 1 else []
        (tmp / "spill").mkdir()
        ing = I.Ingest(tmp / "spill", 5.0, CFG.data.max_line_bytes, 64 << 20, 1, CFG)
        try:
            stats = [ing.scan(p, "input", None) for p in inputs] + [ing.scan(p, "negative", 3) for p in negs]
        finally:
            ing.close()
        for s in stats:
            assert s["lines"] == s["blank"] + s["read"], s
            assert s["read"] == s["accepted"] + s["rejected"] + s["duplicates"], s
            assert s["lines"] == _physical_lines(raw[s["file"]]), s
        total = {k: sum(s[k] for s in stats) for k in ("accepted", "rejected", "duplicates")}
        # JSONL splits on "\n" only: accepted lines are kept as logged and may hold a raw U+2028
        sinks = {n: (tmp / "spill" / f"{n}.jsonl").read_bytes().decode().split("\n")[:-1] for n in I.SINKS}
        assert len(sinks["accepted"]) + len(sinks["negatives"]) == total["accepted"] == ing.n
        assert len(sinks["rejects"]) == total["rejected"] and len(sinks["duplicates"]) == total["duplicates"]
        for name, rows in sinks.items():
            for row in rows:
                _strict(row)
                if name in ("accepted", "negatives"):
                    I.check_record(I.decode(row), 5.0)  # what was accepted passes the checks again
        _calls["n"] += 1
        if _calls["n"] % 50 == 0:  # the whole stage now and then: tables, review sample, datasets
            try:
                res = run_prep(inputs, tmp / "out", CFG, negatives=negs, make_plots=_calls["n"] % 500 == 0)
            except GateRefused as e:  # nothing accepted: a defined refusal
                res = e.result
            k = res.summary["counts"]
            assert k["read"] == k["accepted"] + k["rejected"] + k["duplicates"]
            assert k["accepted"] == total["accepted"] and k["rejected"] == total["rejected"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
