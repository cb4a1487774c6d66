"""Where things are, for a test in any folder of tests/: the checkout (REPO), tests/ itself (TESTS) and the shared
test data (FIXTURES: tests/fixtures/). ``from repo_paths import REPO, FIXTURES``: tests/conftest.py puts tests/ on
sys.path, so this and the other shared helpers beside it (fake_openai.py, families.py, forced_lm.py) import by name
from every folder, with no path of their own to compute. Named not to shadow hermes_lab.core.paths."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
