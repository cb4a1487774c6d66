"""The labeller on agent conversations in a real browser (issue 27): JupyterLab as `make lab` starts it, headless
Chromium driven by Selenium (tests/e2e/test_browser.py's helpers), a round whose queue prep made from what the real
Hermes Agent wrote (tests/fixtures/hermes/) plus one chat whose tool result carries a <script>.

review.ipynb renders each conversation as a person reads it: roles, the reasoning folded (it opens on a click),
each tool call as name(arguments), the long tool result folded, the script shown as text and never run; a
click labels the whole conversation (its review id in the label store). Screenshot:
tests/artifacts/review_conversation.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from repo_paths import FIXTURES
from test_browser import (
    ARTIFACTS,
    _button,
    _errors,
    _open_and_run_all,
    _panel,
    _store_lines,
    _text_input,
    browser,  # noqa: F401  (the fixture, on this module's lab)
    serve_lab,
)

pytestmark = pytest.mark.slow
FIX = FIXTURES / "hermes"
EVIL = "<script>document.title='pwned'</script>"


def _conversation_round(proj: Path, round_dir: Path) -> Path:
    from hermes_lab.config.schema import load_config
    from hermes_lab.prep import run as prep

    round_dir.mkdir(parents=True)
    chat = round_dir / "chat.jsonl"
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "terminal", "arguments": json.dumps({"command": "ls"})},
    }
    msgs = [
        {"role": "user", "content": "List the folder, please."},
        {"role": "assistant", "content": None, "reasoning": "I should run ls.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "terminal", "content": "file\n" * 300 + EVIL},
        {"role": "assistant", "content": f"It holds 300 files and {EVIL}"},
    ]
    chat.write_text(json.dumps({"id": "conv-evil", "messages": msgs}) + "\n")
    over = {"round.runs_dir": str(proj / "runs"), "data.min_samples": 1, "data.review_fraction": 1.0}
    over["conversations.no_signal"] = "warn"  # outcome rewards only: the review lab still gets its queue
    cfg = load_config(proj / "params" / "embedded.yaml", over)
    inputs = [FIX / "trajectory_samples.jsonl", FIX / "failed_trajectories.jsonl", chat]
    prep.run_prep(inputs, round_dir / "prep", cfg, make_plots=False)
    return round_dir / "prep" / "review_queue.jsonl"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with serve_lab(tmp_path_factory.mktemp("conv-lab"), _conversation_round) as info:
        yield info


def test_review_notebook_labels_a_tool_calling_conversation(lab, browser):  # noqa: F811 (the imported fixture)
    from hermes_lab.review import gate as review

    driver = browser
    items = review.load_queue(lab["queue"])
    evil = next(i for i, it in enumerate(items) if it["conversation_id"] == "conv-evil")
    wait = _open_and_run_all(driver, lab, "review.ipynb")
    wait.until(lambda d: d.find_elements(By.XPATH, "//*[contains(text(),'Type your reviewer id above')]") or _errors(d))
    assert not _errors(driver), _errors(driver)
    _text_input(driver, "Reviewer").send_keys("grace", Keys.ENTER)
    wait.until(lambda d: "Item 1 of" in _panel(d))
    for _ in range(evil):  # to the chat with the script in it: skip the others
        n = _panel(driver)
        _button(driver, "Skip").click()
        wait.until(lambda d, n=n: _panel(d) != n)
    text = _panel(driver)
    assert "conv-evil" in text and 'terminal({"command": "ls"})' in text and EVIL in text  # shown as text
    conv = driver.find_element(By.CSS_SELECTOR, ".hermes-conversation")
    assert not conv.find_elements(By.TAG_NAME, "script") and driver.title != "pwned"
    roles = [e.get_attribute("class") for e in conv.find_elements(By.CSS_SELECTOR, ".msg")]
    assert roles == ["msg msg-user", "msg msg-assistant", "msg msg-tool", "msg msg-assistant"]
    folds = conv.find_elements(By.TAG_NAME, "details")
    assert len(folds) == 2 and not any(f.get_attribute("open") for f in folds)  # reasoning, the long result
    assert not folds[0].find_element(By.TAG_NAME, "pre").is_displayed()
    folds[0].find_element(By.TAG_NAME, "summary").click()
    wait.until(lambda d: folds[0].find_element(By.TAG_NAME, "pre").is_displayed())
    assert "I should run ls." in folds[0].text
    ARTIFACTS.mkdir(exist_ok=True)
    driver.execute_script("arguments[0].scrollIntoView(); window.scrollBy(0, -40)", conv)
    shot = ARTIFACTS / "review_conversation.png"
    driver.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    _button(driver, "4").click()
    wait.until(lambda d: _store_lines(lab) >= 1)
    live = review.current_labels(review.read_labels(lab["proj"] / "runs" / "review" / "labels.jsonl").records)
    got = {rid: rec["label"] for (rid, who), rec in live.items() if who == "grace"}
    assert got == {items[evil]["review_id"]: 4.0}  # the conversation's review id: the label is the whole conversation's
    assert not _errors(driver), _errors(driver)
