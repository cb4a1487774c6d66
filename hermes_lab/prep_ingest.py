"""Data prep, part 1: ingest. Every line of every trajectories file is read in bounded memory and validated;
each lands in exactly one of accepted / negatives / duplicates / rejects.

Stage: prep (``hermes_lab.prep`` runs it, then distills the accepted records). Reads the input and negative
trajectories JSONL files; writes ``accepted.jsonl``, ``negatives.jsonl``, ``duplicates.jsonl`` and
``rejects.jsonl`` into prep's output dir (``runs/round-NN/prep/``). The rules (line too long, NaN/Infinity,
rewards outside 0..scale, lone surrogates, ...) and the count identities are in ``hermes_lab.prep``'s docstring.

    hermes-lab prep --input runs/round-01/trajectories.jsonl --output runs/round-01/prep
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

BOM = b"\xef\xbb\xbf"
REQUIRED = ("prompt", "response", "reward", "task_id")
RAW_KEEP = 4096  # bytes of a too-long line kept in rejects.jsonl
PROGRESS_MIN = 32 << 20  # show a tqdm bar for files from this size on


class _Bad(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def _no_constants(name: str) -> Any:
    raise _Bad("NaN/Infinity not allowed", f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one decoder: json.loads(**kw) builds one per call


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(v), "number")


def _check_record(obj: Any, scale: float) -> tuple[str, str, float, str, str | None]:
    """(prompt, response, reward, task_id, family field) of a valid record, else raises _Bad."""
    if type(obj) is not dict:
        raise _Bad("not a JSON object", f"got a JSON {_kind(obj)}")
    for k in REQUIRED:
        if k not in obj:
            raise _Bad(f"missing field '{k}'", f"required: {', '.join(REQUIRED)}; present: {', '.join(list(obj)[:12])}")
    prompt, response, reward, task_id = obj["prompt"], obj["response"], obj["reward"], obj["task_id"]
    if type(prompt) is not str:
        raise _Bad("prompt not a string", f"prompt is a JSON {_kind(prompt)}")
    if not prompt.strip():
        raise _Bad("empty prompt")
    if type(response) is not str:
        raise _Bad("response not a string", f"response is a JSON {_kind(response)}")
    if type(reward) is not float and type(reward) is not int:  # bool is not a reward; neither is "4.2"
        raise _Bad("reward not a number", f"reward is a JSON {_kind(reward)}: {str(reward)[:40]}")
    if not 0 <= reward <= scale:  # 1e999 parses to inf: caught here too
        raise _Bad("reward out of range", f"reward {reward} outside 0..{scale:g}")
    if type(task_id) is int:  # numeric ids are common in exports; the split hashes the text
        task_id = str(task_id)
    elif type(task_id) is not str or not task_id.strip():
        raise _Bad("bad task_id", f"task_id must be a non-empty string, got {json.dumps(task_id)[:40]}")
    for name, s in (("prompt", prompt), ("response", response), ("task_id", task_id)):
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:  # "\ud800" escapes decode to lone surrogates Arrow cannot store
                raise _Bad("invalid Unicode", f"lone surrogate escape in {name}") from None
    fam = obj.get("family")
    return prompt, response, float(reward), task_id, fam if type(fam) is str and fam else None


class _Ingest:
    """Streams every line of every file into column lists and the four JSONL sinks."""

    def __init__(self, out: Path, scale: float, max_line_bytes: int):
        self.scale, self.cap = scale, max_line_bytes
        self.cols: dict[str, list[Any]] = {
            k: [] for k in ("prompt", "response", "reward", "task_id", "family", "file", "line", "negative")
        }
        self.seen: dict[tuple[str, str, str], str] = {}
        self.files: list[dict[str, Any]] = []
        self.sinks = {
            name: open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed in close())
            for name in ("accepted", "negatives", "duplicates", "rejects")
        }

    def close(self) -> None:
        for f in self.sinks.values():
            f.close()

    def _reject(self, st: dict[str, Any], lineno: int, reason: str, detail: str, raw: bytes, **extra: Any) -> None:
        st["rejected"] += 1
        st["by_reason"][reason] += 1
        if len(st["first_errors"]) < 5:
            st["first_errors"].append(f"line {lineno}: {reason}" + (f" ({detail})" if detail else ""))
        rec = {
            "file": st["file"],
            "line": lineno,
            "reason": reason,
            "detail": detail,
            "raw": raw.decode("utf-8", errors="backslashreplace"),
            **extra,
        }
        self.sinks["rejects"].write(json.dumps(rec) + "\n")

    def scan(self, path: Path, role: str, round_no: int | None) -> dict[str, Any]:
        from tqdm import tqdm

        st: dict[str, Any] = {
            "file": str(path),
            "role": role,
            "round": round_no,
            "lines": 0,
            "blank": 0,
            "read": 0,
            "accepted": 0,
            "rejected": 0,
            "duplicates": 0,
            "by_reason": Counter(),
            "first_errors": [],
        }
        fidx, negative = len(self.files), role == "negative"
        self.files.append(st)
        c = self.cols
        c_prompt, c_resp, c_rew, c_tid, c_fam = c["prompt"], c["response"], c["reward"], c["task_id"], c["family"]
        c_file, c_line, c_neg = c["file"], c["line"], c["negative"]
        seen, scale, cap, decode = self.seen, self.scale, self.cap, _DECODER.decode
        out = self.sinks["negatives" if negative else "accepted"]
        dup_out = self.sinks["duplicates"]
        enc = json.encoder.encode_basestring_ascii  # C encoder: a duplicate costs no dict dumps
        file_js = enc(st["file"])
        size = path.stat().st_size
        bar = tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"prep {path.name}",
            disable=size < PROGRESS_MIN,
            mininterval=1.0,
        )
        lineno = pending = read = blank = accepted = dups = 0
        with open(path, "rb") as f:
            readline = f.readline
            while True:
                raw = readline(cap + 1)  # bounded: a 1 GiB line never sits in memory whole
                if not raw:
                    break
                lineno += 1
                pending += len(raw)
                if pending > 1 << 22:
                    bar.update(pending)
                    pending = 0
                if len(raw) > cap and not raw.endswith(b"\n"):
                    total, chunk = len(raw), raw
                    while chunk and not chunk.endswith(b"\n"):
                        chunk = readline(1 << 20)
                        total += len(chunk)
                    pending += total - len(raw)
                    read += 1
                    self._reject(
                        st,
                        lineno,
                        "line too long",
                        f"{total} bytes > data.max_line_bytes {cap}",
                        raw[:RAW_KEEP],
                        raw_truncated=True,
                    )
                    continue
                line = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw.rstrip(b"\r")
                if line.startswith(BOM):  # Windows editors put one at the file start (or at every join)
                    line = line[3:]
                if not line.strip():
                    blank += 1
                    continue
                read += 1
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    self._reject(st, lineno, "not valid UTF-8", f"{e.reason} at byte {e.start}", line)
                    continue
                try:
                    obj = decode(text)
                    prompt, response, reward, task_id, fam = _check_record(obj, scale)
                except _Bad as e:
                    self._reject(st, lineno, e.reason, e.detail, line)
                    continue
                except json.JSONDecodeError as e:
                    self._reject(st, lineno, "malformed JSON", f"{e.msg} at column {e.colno}", line)
                    continue
                except RecursionError:
                    self._reject(st, lineno, "malformed JSON", "nested too deeply", line)
                    continue
                key = (prompt, response, task_id)
                first = seen.get(key)
                if first is not None:
                    dups += 1
                    dup_out.write(
                        f'{{"file": {file_js}, "line": {lineno}, "duplicate_of": {enc(first)}, "raw": {enc(text)}}}\n'
                    )
                    continue
                seen[key] = f"{st['file']}:{lineno}"
                accepted += 1
                if negative:
                    obj["_negative"] = {"file": st["file"], "round": round_no}
                    out.write(json.dumps(obj) + "\n")  # ASCII escapes: extra fields may hold lone surrogates
                else:
                    out.write(text + "\n")
                c_prompt.append(prompt)
                c_resp.append(response)
                c_rew.append(reward)
                c_tid.append(task_id)
                c_fam.append(fam)
                c_file.append(fidx)
                c_line.append(lineno)
                c_neg.append(negative)
        bar.update(pending)
        bar.close()
        st.update(lines=lineno, read=read, blank=blank, accepted=accepted, duplicates=dups)
        return st
