"""A workspace with the Hermes Agent's terminal and file tools: the same result strings, confined to one folder.

Reads ``hermes_tools.json`` beside it (hermes-agent 0.19.0's own schemas of these tools, as its requests send them
with ``-t terminal,file``: tests/fixtures/hermes/make_workspace.py captures them); reads and writes only inside its
workspace, a temporary folder of its own. ``hermes_lab.tasks.hermes.WorkspaceEnv`` serves it to TRL and to the
episode runner; ``tests/tasks/test_hermes_tasks.py`` holds every tool's result to the real Hermes Agent's on the same
calls (tests/fixtures/hermes/workspace.json).

Two differences from Hermes, both on purpose: every path is confined to the workspace (Hermes reads anywhere: here a
path outside is an error result), and ``terminal`` runs no shell: it interprets the few commands the tasks need
(``echo W >> F``, ``ls [D]``, ``ls D | wc -l``, ``cat F``, ``wc -l < F``) and answers anything else with exit code
127, so a policy's command never reaches the host.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

_SCHEMAS = Path(__file__).with_name("hermes_tools.json")
TOOLS = ("read_file", "write_file", "patch", "search_files", "terminal")  # the Hermes tools the tasks use


def lay_files(root: str | Path, files: dict[str, str]) -> None:
    """Write a task's files into an (empty) workspace."""
    root = Path(root)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


@cache
def tool_schemas() -> tuple[dict[str, Any], ...]:
    """Hermes 0.19.0's own schemas of its terminal and file tools (``hermes_tools.json``), in its order."""
    return tuple(json.loads(_SCHEMAS.read_text(encoding="utf-8")))


def tool_schema() -> list[dict[str, Any]]:
    """The schemas a conversation record's ``tools`` holds: Hermes's, as its requests send them."""
    return [json.loads(json.dumps(s)) for s in tool_schemas()]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


class Workspace:
    """Hermes's five tools on a temporary folder of their own (``open`` lays it, ``_close`` removes it). The public
    methods are the tools (TRL serves every public method of an environment as one)."""

    def __init__(self, shown_root: str | None = None) -> None:
        self._root: Path | None = None
        # the workspace's path as results show it (write_file's resolved_path, patch's diff): the real folder by
        # default, as Hermes shows its cwd; a fixed one makes an episode's tokens the same on every run (the build)
        self._shown = shown_root
        self.calls = self.errors = 0

    def _show(self, p: Path) -> str:
        """A path as the results show it (under ``shown_root`` when one is set)."""
        if self._shown is None or self._root is None:
            return str(p)
        return self._shown + str(p)[len(str(self._root.resolve())) :]

    def _open(self, files: dict[str, str]) -> None:
        """A fresh workspace holding ``files`` (the previous one removed)."""
        self._close()
        self._root = Path(tempfile.mkdtemp(prefix="hermes-ws-"))
        lay_files(self._root, files)
        self.calls = self.errors = 0

    def _close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __del__(self) -> None:
        self._close()

    @property
    def workspace(self) -> Path | None:
        return self._root

    def _path(self, path: str) -> Path:
        if self._root is None:
            raise RuntimeError("WorkspaceEnv: reset() first")
        p = Path(path).expanduser()
        full = (p if p.is_absolute() else self._root / p).resolve()
        root = self._root.resolve()
        if full != root and root not in full.parents:
            raise PermissionError(f"{path}: outside the workspace")
        return full

    def _tool(self, fn: Any) -> str:
        self.calls += 1
        try:
            return fn()
        except Exception as e:  # a tool error is a result the policy sees, as Hermes shows it
            self.errors += 1
            return _dumps({"error": str(e)})

    def read_file(self, path: str, offset: int = 1, limit: int = 500) -> str:
        """Read a text file with line numbers ('LINE_NUM|CONTENT').

        Args:
            path: Path to the file to read
            offset: Line number to start reading from (1-indexed)
            limit: Maximum number of lines to read
        """

        def run() -> str:
            p = self._path(path)
            if not p.is_file():
                stat = {"content": "", "total_lines": 0, "file_size": 0, "truncated": False}
                # names beside it, from inside the workspace only (the workspace itself has nothing beside it)
                near = sorted(p.parent.glob(f"*{p.suffix}")) if p != self._root.resolve() else []
                similar = [f"./{q.name}" for q in near if q.is_file() and not q.is_symlink()][:5]
                flags = {"is_binary": False, "is_image": False, "error": f"File not found: {path}"}
                return _dumps({**stat, **flags, "similar_files": similar})
            text = p.read_text(encoding="utf-8", errors="replace")
            lines = text.split("\n")
            start = max(1, int(offset))
            shown = lines[start - 1 : start - 1 + int(limit)]
            numbered = "\n".join(f"{start + i}|{line}" for i, line in enumerate(shown))
            return _dumps(
                {
                    "content": numbered,
                    "total_lines": text.count("\n"),
                    "file_size": len(text.encode("utf-8")),
                    "truncated": False,
                    "is_binary": False,
                    "is_image": False,
                }
            )

        return self._tool(run)

    def write_file(self, path: str, content: str) -> str:
        """Write content to a file, completely replacing existing content.

        Args:
            path: Path to the file to write
            content: Complete content to write to the file
        """

        def run() -> str:
            p = self._path(path)
            made = not p.parent.exists()
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content, encoding="utf-8")
            return _dumps(
                {
                    "bytes_written": len(content.encode("utf-8")),
                    "dirs_created": made or True,
                    "lint": {"status": "skipped", "message": f"No linter for {p.suffix or 'these'} files"},
                    "resolved_path": self._show(p),
                    "files_modified": [self._show(p)],
                }
            )

        return self._tool(run)

    def patch(self, path: str, old_string: str, new_string: str, mode: str = "replace") -> str:
        """Targeted find-and-replace edits in files.

        Args:
            path: File path to edit
            old_string: Exact text to find and replace
            new_string: Replacement text
            mode: Edit mode ('replace')
        """

        def run() -> str:
            if mode != "replace":
                raise ValueError(f"mode {mode!r}: this workspace applies mode='replace' only")
            p = self._path(path)
            if not p.is_file():
                return _dumps({"success": False, "error": f"Failed to read file: {self._show(p)}"})
            text = p.read_text(encoding="utf-8")
            n = text.count(old_string) if old_string else 0
            if n == 0:
                hint = (
                    "old_string not found. Use read_file to verify the current content, or search_files to locate "
                    "the text."
                )
                return _dumps(
                    {"success": False, "error": "Could not find a match for old_string in the file", "_hint": hint}
                )
            if n > 1:
                raise ValueError(f"old_string found {n} times in {path}: it must be unique")
            new = text.replace(old_string, new_string, 1)
            p.write_text(new, encoding="utf-8")
            diff = "".join(
                difflib.unified_diff(
                    text.splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    f"a/{self._show(p)}",
                    f"b/{self._show(p)}",
                    lineterm="\n",
                )
            )
            lint = {"status": "skipped", "message": f"No linter for {p.suffix or 'these'} files"}
            return _dumps(
                {
                    "success": True,
                    "diff": diff,
                    "files_modified": [self._show(p)],
                    "lint": lint,
                    "resolved_path": self._show(p),
                }
            )

        return self._tool(run)

    def search_files(self, pattern: str, target: str = "content", path: str = ".") -> str:
        """Search file contents (regex) or find files by name (glob).

        Args:
            pattern: Regex pattern for content search, or glob pattern for file search
            target: 'content' searches inside files, 'files' searches for files by name
            path: Directory to search in
        """

        def run() -> str:
            base = self._path(path)
            # no symlinks: a link placed in the workspace would read outside it
            files = [q for q in base.rglob("*") if q.is_file() and not q.is_symlink() and not q.name.startswith(".")]
            # as Hermes's rg: paths under the searched dir with its './', file names newest first
            rel = {q: f"./{q.relative_to(base)}" if path == "." else str(q.relative_to(self._root)) for q in files}
            if target == "files":
                found = [rel[q] for q in sorted(files, key=lambda q: -q.stat().st_mtime_ns) if q.match(pattern)]
                return _dumps({"total_count": len(found), "files": found} if found else {"total_count": 0})
            rx = re.compile(pattern)
            matches = []
            for q in sorted(files):
                for i, line in enumerate(q.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                    if rx.search(line):
                        matches.append({"path": rel[q], "line": i, "content": line[:500]})
            return _dumps({"total_count": len(matches), "matches": matches} if matches else {"total_count": 0})

        return self._tool(run)

    def terminal(self, command: str) -> str:
        """Execute a shell command in the workspace.

        Args:
            command: The command to execute
        """
        return self._tool(lambda: _dumps(self._shell(command)))

    def _shell(self, command: str) -> dict[str, Any]:
        """The few commands the tasks need, interpreted (no shell runs); anything else: exit code 127."""
        cmd = command.strip()
        m = re.fullmatch(r"echo (.*?) >> (\S+)", cmd)
        if m:
            words = " ".join(shlex.split(m.group(1)))
            p = self._path(m.group(2))
            with open(p, "a", encoding="utf-8") as f:
                f.write(words + "\n")
            return {"output": "", "exit_code": 0, "error": None}
        m = re.fullmatch(r"ls( \S+)?( \| wc -l)?", cmd)
        if m:
            arg = (m.group(1) or " .").strip()
            d = self._path(arg)
            if not d.is_dir():
                return {
                    "output": f"ls: cannot access '{arg}': No such file or directory",
                    "exit_code": 2,
                    "error": None,
                }
            names = sorted(x.name for x in d.iterdir() if not x.name.startswith("."))
            return {"output": str(len(names)) if m.group(2) else "\n".join(names), "exit_code": 0, "error": None}
        m = re.fullmatch(r"cat (\S+)|wc -l < (\S+)", cmd)
        if m:
            p = self._path(m.group(1) or m.group(2))
            if not p.is_file():
                return {"output": f"cat: {p.name}: No such file or directory", "exit_code": 1, "error": None}
            text = p.read_text(encoding="utf-8", errors="replace")
            return {
                "output": (text if m.group(1) else str(text.count("\n"))).rstrip("\n"),
                "exit_code": 0,
                "error": None,
            }
        return {"output": f"bash: {cmd.split(' ', 1)[0]}: command not found", "exit_code": 127, "error": None}


def env_tools(env: Workspace) -> list[Any]:
    """The environment's tools, as TRL collects them (its public methods but reset)."""
    return [env.read_file, env.write_file, env.patch, env.search_files, env.terminal]
