"""The interactive labeller behind notebooks/review.ipynb: ipywidgets buttons over prep's review queue.

Stage: human review, between prep and train; ``hermes_lab.review.gate`` holds the label store it writes to and
the gate that reads the labels. One queue item at a time (prompt and response; the reward model's score
is never shown while labelling), labelled 0..scale or pass/fail, with skip and undo. A conversation (an
agent's multi-turn, tool-calling log: the item carries ``messages``) is shown as a person reads one: each
message under its role, reasoning and the system prompt folded, each tool call as its name and arguments,
tool results folded when long; the label is the conversation's (its review id). Everything shown is model
or tool output and is HTML-escaped.

Reads   runs/<round>/prep/review_queue.jsonl  (prep's sample, through review.load_queue)
        runs/review/labels.jsonl              (to resume at the reviewer's next unlabelled item)
Writes  runs/review/labels.jsonl              (the crash-safe label store, review.LabelStore: append only,
                                              one fsync'd line per click, undo appends a tombstone)

Open it in JupyterLab, then run notebooks/review.ipynb with your reviewer id (by default it labels the
latest round's queue, ``latest_queue``):

    make lab                                                         # JupyterLab on the project
    hermes-lab review --queue runs/round-01/prep/review_queue.jsonl  # afterwards: the gate

Keyboard. JupyterLab keeps keystrokes for its own commands, and a widget cannot bind global shortcuts
without a frontend extension (e.g. ipyevents, not a dependency). So the labeller has a "Keys" box: click
it once, then type a digit (or p/f, s = skip, u = undo) and Enter; the box stays focused. Buttons carry
the key in their tooltip.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any

from hermes_lab.core.layout import RoundLayout, RunsLayout
from hermes_lab.review.gate import LabelStore, load_queue


def latest_queue(runs_dir: str | os.PathLike[str]) -> Path:
    """The newest round's review queue (runs/round-NN/prep/review_queue.jsonl, highest NN that has one)."""
    # prep writes each round's sample to its prep/ (core.layout)
    rounds = [rd.prep.review_queue for rd in RunsLayout(runs_dir).rounds() if rd.prep.review_queue.is_file()]
    if not rounds:
        raise FileNotFoundError(
            f"no review queue yet: no {RoundLayout(Path(runs_dir) / 'round-NN').prep.review_queue}. "
            "Run a round first (make round; "
            "its prep stage samples the queue), or set queue_path / round_dir"
        )
    return rounds[-1]


def find_queue(runs_dir: str | os.PathLike[str], round_dir: str = "", queue_path: str = "") -> Path:
    """review.ipynb's queue: queue_path if given, else round_dir's, else the latest round's."""
    if queue_path:
        return Path(queue_path)
    if round_dir:
        return RoundLayout(round_dir).prep.review_queue
    return latest_queue(runs_dir)


def _pre(text: str) -> str:
    # model output is untrusted: everything shown goes through html.escape
    if not text:
        return "<i>(empty)</i>"
    return (
        '<div style="max-height:18em;overflow:auto"><pre style="white-space:pre-wrap;margin:0">'
        f"{html.escape(text)}</pre></div>"
    )


FOLD_CHARS = 600  # tool results (and answers) longer than this are folded, their first line as the summary


def _fold(summary: str, body: str, open_: bool = False) -> str:
    return (
        f"<details{' open' if open_ else ''}><summary>{summary}</summary>"
        f'<pre style="white-space:pre-wrap;margin:0">{html.escape(body)}</pre></details>'
    )


def _text_block(text: str) -> str:
    if len(text) <= FOLD_CHARS:
        return f'<pre style="white-space:pre-wrap;margin:0">{html.escape(text)}</pre>'
    head = html.escape(text[:120].split("\n")[0])
    return _fold(f"{head} ... ({len(text):,} characters)", text)


ROLE_STYLE = {
    "system": "#666",
    "user": "#1f5fa8",
    "assistant": "#2e7d32",
    "tool": "#8a5a00",
}


def conversation_html(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """A conversation as a person reads it: one block per message under its role; the system prompt and
    reasoning folded; each tool call as name(arguments); a long tool result folded. All text escaped."""
    names = ", ".join(html.escape(str((t.get("function") or {}).get("name"))) for t in tools or [])
    out = ['<div class="hermes-conversation" style="max-height:32em;overflow:auto">']
    if names:
        out.append(f"<div><i>tools offered:</i> <code>{names}</code></div>")
    for i, m in enumerate(messages):
        role = str(m.get("role"))
        color = ROLE_STYLE.get(role, "#000")
        label = html.escape(role if role != "tool" else f"tool · {m.get('name') or ''}")
        body = []
        content = m.get("content") or ""
        if role == "system":
            body.append(_fold(f"system prompt ({len(content):,} characters)", content))
        else:
            if m.get("reasoning"):
                body.append(_fold("reasoning", str(m["reasoning"])))
            if content:
                body.append(_text_block(str(content)))
            for c in m.get("tool_calls") or []:
                fn = c.get("function") or {}
                call = f"{fn.get('name')}({fn.get('arguments')})"
                body.append(f'<div class="tool-call">&#8594; call <code>{html.escape(call)}</code></div>')
        out.append(
            f'<div class="msg msg-{html.escape(role)}" style="border-left:3px solid {color};padding:2px 8px;'
            f'margin:4px 0"><b style="color:{color}">{i + 1}. {label}</b>{"".join(body) or " <i>(empty)</i>"}</div>'
        )
    out.append("</div>")
    return "".join(out)


class ReviewApp:
    """ipywidgets labeller. ``display(app.widget)``; ``app.buttons`` maps 0..scale (score mode) or
    "pass"/"fail" to their Buttons. The reward model's score is never shown while labelling."""

    def __init__(
        self,
        queue_path: str | os.PathLike[str],
        store_path: str | os.PathLike[str] | None = None,
        reviewer: str = "",
        mode: str = "score",
        *,
        scale: float = 5.0,
        min_labels: int | None = None,
    ):
        import ipywidgets as w

        if mode not in ("score", "passfail"):
            raise ValueError(f"mode must be score or passfail, got {mode!r}")
        self.items = load_queue(queue_path)
        self.store = LabelStore(store_path, scale=scale)
        self.mode, self.scale, self.min_labels = mode, float(scale), min_labels
        self.reviewer = reviewer.strip()
        self.skipped: set[str] = set()
        self.index: int | None = None
        self.message = ""
        self.buttons: dict[Any, Any] = {}
        if mode == "score":
            for v in range(int(self.scale) + 1):
                self.buttons[v] = w.Button(
                    description=str(v),
                    layout=w.Layout(width="3.5em"),
                    tooltip=f"Label {v} of {self.scale:g} (key: {v} + Enter in Keys)",
                )
        else:
            self.buttons["pass"] = w.Button(
                description="Pass", button_style="success", tooltip=f"Pass = {self.scale:g} (key: p + Enter in Keys)"
            )
            self.buttons["fail"] = w.Button(
                description="Fail", button_style="danger", tooltip="Fail = 0 (key: f + Enter in Keys)"
            )
        for key, b in self.buttons.items():
            b.on_click(lambda _b, key=key: self.label(key))
        self.skip_button = w.Button(description="Skip", tooltip="Skip for now; it comes back later (key: s)")
        self.undo_button = w.Button(description="Undo", tooltip="Undo your last label (key: u)")
        self.skip_button.on_click(lambda _b: self.skip())
        self.undo_button.on_click(lambda _b: self.undo())
        keys = "0-5" if mode == "score" else "p/f"
        self.keys = w.Text(
            description="Keys", continuous_update=False, placeholder=f"{keys}, s skip, u undo, then Enter"
        )
        self.keys.observe(self._on_keys, "value")
        self.note = w.Text(description="Note", placeholder="optional, saved with the next label")
        self.reviewer_box = w.Text(
            value=self.reviewer,
            description="Reviewer",
            continuous_update=False,
            placeholder="your name or id (required)",
        )
        self.reviewer_box.observe(self._on_reviewer, "value")
        self.progress = w.IntProgress(min=0, max=max(1, len(self.items)), description="Labelled")
        self.progress_label = w.Label()
        self.header, self.prompt_html, self.response_html, self.status = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.prompt_label, self.response_label = w.HTML("<b>Prompt</b>"), w.HTML("<b>Response</b>")
        self.widget = w.VBox(
            [
                w.HBox([self.reviewer_box, self.progress, self.progress_label]),
                self.header,
                self.prompt_label,
                self.prompt_html,
                self.response_label,
                self.response_html,
                w.HBox(list(self.buttons.values()) + [self.skip_button, self.undo_button]),
                w.HBox([self.keys, self.note]),
                self.status,
            ]
        )
        if self.store.recovered:
            self._say(self.store.recovered)
        self._advance()
        self._render()

    # -- actions
    def label(self, key: Any) -> dict[str, Any] | None:
        if not self.reviewer or self.index is None:
            self._say("Enter your reviewer id first." if not self.reviewer else "Nothing left to label.")
            return None
        value = (self.scale if key == "pass" else 0.0) if self.mode == "passfail" else float(key)
        item = self.items[self.index]
        rec = self.store.append(item["review_id"], self.reviewer, value, mode=self.mode, note=self.note.value.strip())
        self.note.value = ""
        self.skipped.discard(item["review_id"])
        self._say(f"Saved {key} for item {self.index + 1}.")
        self._advance()
        self._render()
        return rec

    def skip(self) -> None:
        if self.index is not None:
            self.skipped.add(self.items[self.index]["review_id"])
            self._advance()
            self._render()

    def undo(self) -> dict[str, Any] | None:
        rec = self.store.undo(self.reviewer) if self.reviewer else None
        if rec is None:
            self._say("Nothing to undo.")
            return None
        ids = [it["review_id"] for it in self.items]
        if rec["review_id"] in ids:  # go back to the item so it can be relabelled
            self.index = ids.index(rec["review_id"])
            self.skipped.discard(rec["review_id"])
        self._say(f"Undid label {rec['label']:g} on {rec['review_id']}.")
        self._render()
        return rec

    def _on_keys(self, change: dict[str, Any]) -> None:
        key = str(change["new"]).strip().lower()
        if not key:
            return
        self.keys.value = ""  # ready for the next key; re-enters here with "" and returns
        if key == "s":
            self.skip()
        elif key == "u":
            self.undo()
        elif self.mode == "passfail" and key in ("p", "f"):
            self.label("pass" if key == "p" else "fail")
        elif self.mode == "score" and key.isdigit() and int(key) in self.buttons:
            self.label(int(key))
        else:
            self._say(f"Unknown key {key!r}: use {f'0-{int(self.scale)}' if self.mode == 'score' else 'p/f'}, s or u.")

    def _on_reviewer(self, change: dict[str, Any]) -> None:
        self.reviewer, self.index = str(change["new"]).strip(), None
        self.skipped.clear()
        self._advance()  # resume: this reviewer's next unlabelled item
        self._render()

    # -- navigation and display
    def _advance(self) -> None:
        if not self.reviewer:  # nothing is shown before we know who labels
            self.index = None
            return
        done = self.store.labelled_ids(self.reviewer)
        pending = [i for i, it in enumerate(self.items) if it["review_id"] not in done]
        fresh = [i for i in pending if self.items[i]["review_id"] not in self.skipped]
        if not fresh and pending:  # only skipped items left: go round them again, after the current one
            self.skipped.clear()
            after = [i for i in pending if self.index is None or i > self.index]
            fresh = after or pending
        self.index = fresh[0] if fresh else None

    def _say(self, msg: str) -> None:
        self.message = msg
        self.status.value = f"<span>{html.escape(msg)}</span>"

    def _render(self) -> None:
        n = len(self.items)
        done = (
            len(self.store.labelled_ids(self.reviewer) & {it["review_id"] for it in self.items}) if self.reviewer else 0
        )
        self.progress.value = done
        need = f" · the gate needs {min(self.min_labels, n)}" if self.min_labels else ""
        who = self.reviewer or "(no reviewer yet)"
        self.progress_label.value = f"{done}/{n} labelled by {who}{need} · {len(self.skipped)} skipped"
        active = bool(self.reviewer) and self.index is not None
        for b in [*self.buttons.values(), self.skip_button]:
            b.disabled = not active
        self.undo_button.disabled = not self.reviewer
        if self.index is None:
            self.header.value = (
                f"<b>All {n} items are labelled by {html.escape(who)}.</b> Run the gate: "
                "notebooks/15_review_gate.ipynb or <code>hermes-lab review --queue ...</code>"
                if self.reviewer
                else "<b>Type your reviewer id above to start.</b>"
            )
            self.prompt_html.value = self.response_html.value = ""
            self.prompt_label.value = self.response_label.value = ""
            return
        it = self.items[self.index]
        self.header.value = (
            f"<b>Item {self.index + 1} of {n}</b> · family <code>{html.escape(str(it['family']))}"
            f"</code> · task <code>{html.escape(str(it['task_id']))}</code>"
        )
        msgs = it.get("messages")
        if isinstance(msgs, list) and msgs:  # a conversation: the label is for all of it
            turns = sum(1 for m in msgs if isinstance(m, dict) and m.get("role") == "assistant")
            cid = html.escape(str(it.get("conversation_id") or it["review_id"]))
            self.prompt_label.value = f"<b>Conversation</b> <code>{cid}</code> · {len(msgs)} messages, {turns} turns"
            self.prompt_html.value = conversation_html(msgs, it.get("tools"))
            self.response_label.value = "<b>Label the whole conversation</b> (did the agent do the task well?)"
            self.response_html.value = ""
            return
        self.prompt_label.value, self.response_label.value = "<b>Prompt</b>", "<b>Response</b>"
        self.prompt_html.value = _pre(str(it["prompt"]))
        self.response_html.value = _pre(str(it["response"]))
