"""The real Hermes Agent through `hermes-lab serve` on the embedded policy (issue 55's done-when).

The pinned hermes-agent 0.19.0's CLI (`hermes chat -q PROMPT -Q`, HERMES_HOME a temp dir whose config.yaml points at
the gateway), run by hermes_lab.agents.hermes_chat under bubblewrap with only its workspace and HERMES_HOME
writable, on 20 held-out `hermes` tasks exported by the real command (`hermes-lab tasks export`): all 20 with
`-t terminal,file` and the first 10 with Hermes's default toolsets, one session after another, against a gateway
with embedded:tiny on both arms (an A/A, in-process). What it checks:

- no HTTP 5xx in the gateway's request log, and every session exits 0;
- >= 60% of the sessions' first answers call a tool Hermes offered in that very request, by its name, with
  arguments valid against that tool's JSON schema as the request sent it (jsonschema). A session's first answer is
  the first turn of its first conversation in the gateway's log (found by the session's time span and prompt):
  Hermes resends the same messages after an answer it cannot use (a `<tool_call>` block left as text), and the
  gateway logs that resend as a conversation of its own; the share over every conversation's first turn is printed
  too;
- >= 25% of the 20 `-t terminal,file` tasks done, checked on disk by the checker below (written here from the
  exported line alone: the files' exact content, the answer contains the string), which agrees with
  tasks.hermes.verify's success;
- nothing outside the workspaces changed (sentinel files, one beside the workspaces and one outside /tmp).

The policy build (embedded:tiny, once per machine) happens inside the gateway's start when it is not there yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from gateway_process import Gateway

from hermes_lab.agents import hermes_chat as HA
from hermes_lab.tasks import hermes as H

from repo_paths import FIXTURES, REPO

pytestmark = pytest.mark.slow
N_TASKS, N_DEFAULT = 20, 10
MODEL = "hermes"  # serve.public_model
BUILD_WAIT_S = 1800  # the gateway's start may build the tiny policy first (minutes on a busy machine)


@pytest.fixture(scope="module")
def hermes_bin() -> Path:
    try:
        HA.check_sandbox()
    except HA.BwrapMissing as e:
        pytest.skip(f"no bubblewrap sandbox here: {e}")
    sys.path.insert(0, str(FIXTURES / "hermes"))
    import make_fixtures as mf

    try:
        py = mf.hermes_python(HA.HERMES_VERSION)
    except (SystemExit, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"hermes-agent {HA.HERMES_VERSION} cannot be installed here: {e}")
    try:
        return HA.find_hermes(py.parent / "hermes")
    except HA.HermesMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hermes-real")
    args = ["--params", str(REPO / "params/embedded.yaml"), "--ratio", "0.5", "--set", "serve.rollout=false"]
    args += ["--baseline", "embedded:tiny", "--candidate", "embedded:tiny"]
    gw = Gateway(tmp, args).start(timeout=BUILD_WAIT_S)
    yield gw
    gw.stop()


def export_tasks(out: Path) -> list[dict]:
    exe = REPO / ".venv" / "bin" / "hermes-lab"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "hermes_lab"]
    cmd += ["tasks", "export", "--family", "hermes", "--split", "heldout", "--n", str(N_TASKS), "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()]


def done_on_disk(line: dict, workspace: Path, answer: str | None) -> bool:
    """The exported line's expectations, checked by hand: every expected file has exactly its content, and the
    final answer contains the expected string."""
    expect = line["expect"]
    for rel, want in (expect.get("files") or {}).items():
        p = workspace / rel
        if p.is_symlink() or not p.is_file() or p.read_text(encoding="utf-8", errors="replace") != want:
            return False
    if "answer_contains" in expect and expect["answer_contains"] not in (answer or ""):
        return False
    return bool(expect)


def valid_against(args: object, schema: dict) -> tuple[bool, str]:
    """Arguments (an object) against a tool's JSON schema: jsonschema when there, else required keys and types."""
    if not isinstance(args, dict):
        return False, f"arguments are {type(args).__name__}, not an object"
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validate(args, schema)
        except jsonschema.ValidationError as e:
            return False, e.message
        return True, ""
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    props = schema.get("properties") or {}
    missing = [k for k in schema.get("required") or [] if k not in args]
    if missing:
        return False, f"missing {missing}"
    for k, v in args.items():
        want = (props.get(k) or {}).get("type")
        if want in kinds and (not isinstance(v, kinds[want]) or (want != "boolean" and isinstance(v, bool))):
            return False, f"{k}: not {want}"
        enum = (props.get(k) or {}).get("enum")
        if enum and v not in enum:
            return False, f"{k}: {v!r} not in {enum}"
    return True, ""


def call_ok(record: dict, tools: list[dict]) -> tuple[bool, str]:
    """A first answer calls tools Hermes offered in that request, by name, with arguments valid against the
    offered schema (every call of the answer; at least one)."""
    calls = record.get("tool_calls") or []
    if not calls:
        why = f"finish {record.get('finish_reason')}, truncated {bool((record.get('tokens') or {}).get('truncated'))}"
        return False, f"no tool call ({why}): {str(record.get('response'))[:120]!r}"
    offered = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    for c in calls:
        f = c.get("function") or {}
        name, raw = f.get("name"), f.get("arguments")
        if name not in offered:
            return False, f"{name!r} not offered"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            return False, f"{name}: arguments not JSON: {str(raw)[:60]!r}"
        ok, why = valid_against(args, offered[name])
        if not ok:
            return False, f"{name}: {why}"
    return True, ""


def first_user(messages: list[dict]) -> str | None:
    return next((m.get("content") for m in messages or [] if m.get("role") == "user"), None)


def test_the_sandbox_leaves_only_the_workspace_and_home_writable(tmp_path):
    try:
        HA.check_sandbox()
    except HA.BwrapMissing as e:
        pytest.skip(f"no bubblewrap sandbox here: {e}")
    ws, home, outside = tmp_path / "ws", tmp_path / "home", tmp_path / "outside.txt"
    ws.mkdir()
    home.mkdir()
    outside.write_text("sentinel\n")
    far = Path.home() / ".cache" / "hermes-lab" / f"sentinel-{uuid.uuid4().hex}.txt"  # not under the tmpfs /tmp
    far.parent.mkdir(parents=True, exist_ok=True)
    far.write_text("sentinel\n")
    try:
        script = f"echo ok > in.txt; echo ok > {home}/h.txt; echo x > {outside}; echo x > {far}; echo x > /tmp/t; env"
        cmd = HA.sandbox_command(["sh", "-c", script], ws, home)
        p = subprocess.run(cmd, env=HA.sandbox_env(ws, home, "sk-unused"), capture_output=True, text=True, timeout=60)
        assert (ws / "in.txt").read_text() == "ok\n" and (home / "h.txt").read_text() == "ok\n", p.stderr
        assert outside.read_text() == "sentinel\n" and far.read_text() == "sentinel\n", p.stderr
        assert "Read-only file system" in p.stderr  # the far sentinel: the root is bound read-only
        assert not any(k.lower().endswith("_proxy") for k in (x.split("=", 1)[0] for x in p.stdout.splitlines()))
        assert f"HERMES_HOME={home.resolve()}" in p.stdout and "NO_COLOR=1" in p.stdout
    finally:
        far.unlink(missing_ok=True)


def test_real_hermes_agent_does_heldout_tasks_through_the_gateway(hermes_bin, gateway, tmp_path):
    lines = export_tasks(tmp_path / "heldout.jsonl")
    assert len(lines) == N_TASKS and all(set(x) == {"id", "prompt", "files", "expect"} for x in lines)
    root = tmp_path / "runs"
    root.mkdir()
    beside = tmp_path / "sentinel.txt"  # beside the workspaces (under /tmp: the sandbox sees a tmpfs there)
    beside.write_text("sentinel\n")
    far = Path.home() / ".cache" / "hermes-lab" / f"sentinel-{uuid.uuid4().hex}.txt"  # outside /tmp: read-only
    far.parent.mkdir(parents=True, exist_ok=True)
    far.write_text("sentinel\n")
    before = {p: (p.stat().st_mtime_ns, p.read_text()) for p in (beside, far)}
    base_url = f"{gateway.url}/v1"
    runs: list[tuple[str, dict, HA.HermesRun]] = []
    windows: list[tuple[float, float]] = []  # each session's wall-clock span: its conversations in the log
    try:
        plan = [("terminal,file", x, HA.DEFAULT_TOOLSETS) for x in lines]
        plan += [("default", x, None) for x in lines[:N_DEFAULT]]
        for tag, line, toolsets in plan:
            t0 = time.time()
            r = HA.run_task(line, base_url, MODEL, workspace_root=root, toolsets=toolsets, timeout=180)
            windows.append((t0, time.time()))
            runs.append((tag, line, r))
            print(
                f"[{tag:13s}] {line['prompt']:36s} exit {r.exit_code} {r.seconds:5.1f}s reward {r.reward:.2f} "
                f"calls {','.join(r.tool_calls) or '-'} answer {str(r.answer)[:50]!r}",
                flush=True,
            )
        after = {p: (p.stat().st_mtime_ns, p.read_text()) for p in (beside, far)}
    finally:
        far.unlink(missing_ok=True)

    # ---- the gateway's log: 5xx, and each session's first answer
    records = gateway.records()
    tools_of = {t["tools_hash"]: t["tools"] for t in gateway.records("tools.jsonl")}
    five = [r for r in records if int(r.get("http_status") or 0) >= 500]
    convs: dict[str, list[dict]] = {}
    for r in records:
        convs.setdefault(r["conversation_id"], []).append(r)
    tf_names = {s["function"]["name"] for s in H.W.tool_schemas()}
    opened = []  # (arrival, first turn) of every conversation whose first turn offered tools
    for rs in convs.values():
        first = min(rs, key=lambda r: (r.get("turn", 0), r.get("retry", 0), r.get("t", 0)))
        if tools_of.get(first.get("tools_hash")):
            opened.append((datetime.fromisoformat(first["timestamp"]).timestamp(), first))
    opened.sort(key=lambda x: x[0])
    per_conv = [call_ok(f, tools_of[f["tools_hash"]])[0] for _, f in opened]  # every conversation's first turn
    checked, misses, per_session, offered_ok = [], [], [], []
    for (tag, line, _), (t0, t1) in zip(runs, windows):
        mine = [f for at, f in opened if t0 - 1 <= at <= t1 + 1 and first_user(f.get("messages")) == line["prompt"]]
        per_session.append(len(mine))
        if not mine:
            checked.append(False)
            misses.append(f"[{tag}] {line['prompt']}: no conversation in the log")
            continue
        first = mine[0]  # the session's first answer
        tools = tools_of[first["tools_hash"]]
        names = {t["function"]["name"] for t in tools}
        offered_ok.append(names == tf_names if tag == "terminal,file" else names > tf_names)
        ok, why = call_ok(first, tools)
        checked.append(ok)
        if not ok:
            misses.append(f"[{tag}] {line['prompt']}: {why}")
    call_share = sum(checked) / len(checked)

    # ---- done on disk (this file's checker) vs the project's verifier
    by_tag: dict[str, list[tuple[bool, bool]]] = {}
    disagree = []
    for tag, line, r in runs:
        mine = done_on_disk(line, r.workspace, r.answer)
        by_tag.setdefault(tag, []).append((mine, r.success))
        if mine != r.success:
            disagree.append(f"[{tag}] {line['prompt']}: disk {mine}, verify {r.success} (answer {r.answer!r})")
    tf = by_tag["terminal,file"]
    done_tf = sum(m and v for m, v in tf) / len(tf)
    exits = [r.exit_code for _, _, r in runs]
    print(
        f"\nsessions {len(runs)} ({len(tf)} -t terminal,file, {len(by_tag.get('default', []))} default); "
        f"gateway requests {len(records)} in {len(convs)} conversations; HTTP 5xx {len(five)}; "
        f"exit codes {sorted(set(exits))}\n"
        f"first answers calling an offered tool with valid arguments: {sum(checked)}/{len(checked)} "
        f"({call_share:.0%}) of the sessions; {sum(per_conv)}/{len(per_conv)} of the conversations' first turns; "
        f"conversations per session {dict(sorted(Counter(per_session).items()))}"
    )
    for tag, pairs in by_tag.items():
        print(
            f"done [{tag}]: disk {sum(m for m, _ in pairs)}/{len(pairs)}, verify {sum(v for _, v in pairs)}/"
            f"{len(pairs)}, both {sum(m and v for m, v in pairs)}/{len(pairs)}"
        )
    print("mean seconds per session: %.1f" % (sum(r.seconds for _, _, r in runs) / len(runs)))
    for m in misses + disagree:
        print("  " + m)

    assert after == before, "a file outside the workspaces changed"
    assert all(offered_ok) and len(offered_ok) == len(runs), "-t terminal,file offers Hermes's 6 terminal+file tools"
    assert not five, [(r["http_status"], str(r.get("error"))[:200]) for r in five[:3]]
    assert all(c == 0 for c in exits), [(t, x["prompt"], r.exit_code, r.stderr_tail[-300:]) for t, x, r in runs]
    # the verifier never pays what the disk refuses; on file-only tasks they say the same
    assert all(m or not v for pairs in by_tag.values() for m, v in pairs), disagree
    file_only = [(x, r) for _, x, r in runs if "answer_contains" not in x["expect"]]
    assert file_only and all(done_on_disk(x, r.workspace, r.answer) == r.success for x, r in file_only), disagree
    assert call_share >= 0.60, misses
    assert done_tf >= 0.25, f"{done_tf:.0%} of the -t terminal,file tasks done"
