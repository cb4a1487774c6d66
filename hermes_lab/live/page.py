"""The live flywheel's status page: one HTML document that says what the flywheel waits for.

Stage: validate (the live A/B gateway, issue 30 "the live flywheel"). Reads a status dict built by the
supervisor (``hermes_lab.round.supervisor``): the gateway's address and phase, what it waits for, the round
and the experiment running now, the rounds so far with their decisions and gains, the swaps, the MLflow UI's
address. Writes nothing. The gateway serves it at ``GET /``; it refreshes itself every 5 s (a meta refresh,
no JavaScript) and needs no build step.

Every key is optional (a missing one or None shows "—"), and every value is escaped: model names, paths and
reasons come from outside. Only an http(s) ``mlflow_ui`` becomes a link.
"""

from __future__ import annotations

import html
from typing import Any

DASH = "—"

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 980px;
       padding: 18px 24px; color: #1f2328; background: #f6f8fa; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 22px 0 8px; }
.meta { color: #57606a; font-size: 13px; } .meta b { color: #1f2328; }
.phase { display: inline-block; padding: 1px 8px; border-radius: 10px; background: #ddf4ff; color: #0969da; }
.phase.failed, .phase.stopped { background: #ffebe9; color: #cf222e; }
.waiting { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 8px; padding: 12px 18px; margin: 16px 0; }
.waiting h2 { margin: 0 0 6px; } .waiting ul { margin: 0; padding-left: 20px; font-size: 17px; }
.box { background: #fff; border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 16px; }
table { border-collapse: collapse; width: 100%; background: #fff; }
th, td { border: 1px solid #d0d7de; padding: 5px 10px; text-align: left; font-size: 14px; }
th { background: #eaeef2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.up { color: #1a7f37; } .down { color: #cf222e; }
.ramp .now { font-weight: bold; background: #ddf4ff; padding: 0 4px; border-radius: 4px; }
code { font-size: 13px; } footer { margin-top: 24px; color: #57606a; font-size: 13px; }
"""


def _e(value: Any) -> str:
    """A value as escaped text; None or "" as a dash."""
    return DASH if value is None or value == "" else html.escape(str(value))


def _pct(frac: Any, digits: int = 1) -> str:
    return f"{float(frac) * 100:.{digits}f}%" if isinstance(frac, (int, float)) else _e(frac)


def _points(gain: Any) -> str:
    """A gain (a fraction) in percentage points with its sign, coloured."""
    if not isinstance(gain, (int, float)):
        return _e(gain)
    cls = "up" if gain > 0 else "down" if gain < 0 else ""
    return f'<span class="{cls}">{gain * 100:+.1f} pts</span>'


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _header(s: dict) -> str:
    phase = s.get("phase")
    scale = s.get("time_scale")
    demo = ""
    if isinstance(scale, (int, float)) and scale > 1:
        demo = f" · <b>demo clock: {_e(f'{scale:g}')}x faster than wall time</b>"
    return (
        "<h1>hermes-lab live flywheel</h1>"
        f'<div class="meta">gateway <b>{_e(s.get("address"))}</b> · pid <b>{_e(s.get("pid"))}</b> · '
        f'phase <span class="phase {_e(phase)}">{_e(phase)}</span> · updated <b>{_e(s.get("updated"))}</b>{demo}'
        f" · answered {_e(s.get('answered_requests'))}, failed {_e(s.get('failed_requests'))}</div>"
    )


def _waiting(s: dict) -> str:
    items = [f"<li>{_e(w)}</li>" for w in _list(s.get("waiting_for"))] or ["<li>nothing</li>"]
    counts = _dict(s.get("counts"))
    line = ""
    if counts:
        left = counts.get("cooldown_left_s")
        cool = f"{left / 3600:.1f} h" if isinstance(left, (int, float)) else _e(left)
        line = (
            f'<div class="meta">conversations {_e(counts.get("conversations"))} / {_e(counts.get("min_samples"))}'
            f" · labels {_e(counts.get('labels'))} / {_e(counts.get('labels_needed'))} · cooldown left {cool}</div>"
        )
    return f'<section class="waiting"><h2>Waiting for</h2><ul>{"".join(items)}</ul>{line}</section>'


def _round(s: dict) -> str:
    r = s.get("round")
    if not isinstance(r, dict):
        return "<h2>Current round</h2><p>none running</p>"
    return (
        f'<h2>Current round</h2><div class="box">round <b>{_e(r.get("number"))}</b> · stage '
        f"<b>{_e(r.get('stage'))}</b> · since {_e(r.get('since'))} · worker pid {_e(r.get('pid'))}</div>"
    )


def _arm(name: str, arm: Any) -> str:
    a = _dict(arm)
    if a.get("kind") == "upstream":
        what = f"upstream <code>{_e(a.get('url'))}</code>, model <code>{_e(a.get('model'))}</code>"
    else:
        what = f"{_e(a.get('kind'))} <code>{_e(a.get('base'))}</code>"
        what += f", adapter <code>{_e(a.get('adapter'))}</code>" if a.get("adapter") else ""
    return f"<li>{_e(name)}: {what}</li>"


def _experiment(s: dict) -> str:
    x = s.get("experiment")
    if not isinstance(x, dict):
        return "<h2>Current experiment</h2><p>none running</p>"
    stages, k = _list(x.get("stages")), x.get("stage")
    steps = []
    for i, st in enumerate(stages):
        share = _pct(st[0], 0) if isinstance(st, (list, tuple)) and st else _e(st)
        steps.append(f'<span class="now">{share}</span>' if i == k else share)
    ramp = " → ".join(steps) or DASH
    n = f"{k + 1} of {len(stages)}" if isinstance(k, int) and stages else _e(k)
    arms = _dict(x.get("arms"))
    return (
        f'<h2>Current experiment</h2><div class="box"><b>{_e(x.get("name"))}</b> ({_e(x.get("status"))})'
        f" · log <code>{_e(x.get('log_dir'))}</code><br>stage {n}, candidate share {_pct(x.get('ratio'), 0)}"
        f' · ramp <span class="ramp">{ramp}</span><br>conversations: baseline {_e(x.get("n_baseline"))}, '
        f"candidate {_e(x.get('n_candidate'))} · waiting for {_e(x.get('waiting_for'))}"
        f"<ul>{''.join(_arm(name, arm) for name, arm in arms.items())}</ul></div>"
    )


def _rounds(s: dict) -> str:
    rows = []
    for r in _list(s.get("rounds")):
        r = _dict(r)
        rows.append(
            f"<tr><td>{_e(r.get('round'))}</td><td>{_e(r.get('status'))}</td><td>{_e(r.get('decision'))}</td>"
            f'<td class="num">{_pct(r.get("pass_rate"))}</td><td class="num">{_pct(r.get("base_pass_rate"))}</td>'
            f'<td class="num">{_points(r.get("gain"))}</td><td>{_e(r.get("experiment"))}</td>'
            f"<td>{_e(r.get('ended'))}</td></tr>"
        )
    if not rows:
        return "<h2>Rounds</h2><p>none yet</p>"
    head = "".join(
        f"<th>{h}</th>" for h in ("round", "status", "decision", "pass rate", "baseline", "gain", "experiment", "ended")
    )
    return f"<h2>Rounds</h2><table><tr>{head}</tr>{''.join(rows)}</table>"


def _swaps(s: dict) -> str:
    items = [
        f"<li>{_e(w.get('at'))}: {_e(w.get('experiment'))} — baseline {_e(w.get('baseline'))} → "
        f"candidate {_e(w.get('candidate'))}</li>"
        for w in map(_dict, _list(s.get("swaps"))[-10:])
    ]
    return f"<h2>Recent swaps</h2>{'<ul>' + ''.join(items) + '</ul>' if items else '<p>none yet</p>'}"


def _footer(s: dict) -> str:
    url = s.get("mlflow_ui")
    if isinstance(url, str) and url.lower().startswith(("http://", "https://")):
        link = f'<a href="{html.escape(url, quote=True)}">MLflow UI</a>'
    else:
        link = f"MLflow UI: {_e(url)}"
    return f"<footer>{link}</footer>"


def render(status: dict) -> str:
    """The whole page (an HTML5 document) for one status dict; every key optional."""
    s = _dict(status)
    body = "".join(f(s) for f in (_header, _waiting, _round, _experiment, _rounds, _swaps, _footer))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="refresh" content="5">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>hermes-lab flywheel · {_e(s.get('phase'))}</title><style>{CSS}</style></head>\n"
        f"<body>{body}</body></html>\n"
    )
