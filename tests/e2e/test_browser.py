"""The front door in a real browser (issue 15): JupyterLab started exactly as `make lab` starts it
(`hermes-lab lab`, here on 127.0.0.1, a free port and a fixed token), driven in headless Chromium by Selenium.

- review.ipynb, opened with its default parameters, runs, renders the labeller on the latest round's queue;
  three items are labelled (two button clicks, one through the Keys box), one is undone, and the label store
  holds exactly the other two;
- 10_data_prep.ipynb runs the same way and its plots render (decoded images, not broken ones).

Screenshots land in tests/artifacts/ (git-ignored). Needs Debian's chromium and chromium-driver (`make test`
installs them when it runs as root with apt-get); without them the tests skip and say so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from repo_paths import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOKEN = "hermes-browser-test"

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(
        f"browser tests need {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver; "
        "`make test` installs them when run as root)",
        allow_module_level=True,
    )

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from test_status_page import chromium  # noqa: E402

pytestmark = pytest.mark.slow
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook on show


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_lab(tmp: Path, fill: Callable[[Path, Path], Path]) -> Iterator[dict]:
    """A project copy under ``tmp`` whose round-01 ``fill(proj, round_dir)`` prepares (it returns the review
    queue), served by `hermes-lab lab` as `make lab` starts it; stopped (SIGTERM, then SIGKILL) on exit."""
    from hermes_lab.policy.model import build_tiny_policy

    proj = tmp / "proj"
    for d in ("params", "notebooks"):
        shutil.copytree(REPO / d, proj / d)
    (proj / "runs").mkdir()
    (proj / "runs" / "policies").symlink_to(build_tiny_policy(REPO / "runs", 0, quiet=True).parent.resolve())
    round_dir = proj / "runs" / "round-01"
    queue = fill(proj, round_dir)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("HERMES_LAB_ROOT", "MLFLOW_TRACKING_URI")}
    # the test's own Jupyter state: no user settings, workspaces or runtime files are read or written
    for var, sub in (
        ("JUPYTER_CONFIG_DIR", "cfg"),
        ("JUPYTER_RUNTIME_DIR", "rt"),
        ("JUPYTERLAB_WORKSPACES_DIR", "ws"),
        ("JUPYTERLAB_SETTINGS_DIR", "settings"),
    ):
        env[var] = str(tmp / sub)
    env.setdefault("OMP_NUM_THREADS", "1")  # a 0.3M-parameter policy: two contended threads are 10x slower than one
    cmd = [sys.executable, "-m", "hermes_lab.cli.main", "lab", "--ip", "127.0.0.1", "--port", str(port), "--no-browser"]
    cmd += ["--", f"--IdentityProvider.token={TOKEN}"]
    log = open(tmp / "lab.log", "w+")  # noqa: SIM115 - read back at the end
    server = subprocess.Popen(cmd, cwd=proj, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    pytest.fail(f"JupyterLab did not start: {log.read()[-3000:]}")
                time.sleep(0.5)
        yield {"url": url, "proj": proj, "log": log, "queue": queue}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # jupyter shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _seed_round(proj: Path, round_dir: Path) -> Path:
    """600 seed trajectories through prep: the round's review queue."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.prep import run as prep

    from test_paths import write_trajectories

    write_trajectories(round_dir / "trajectories.jsonl", n=600)
    cfg = load_config(proj / "params" / "embedded.yaml", {"round.runs_dir": str(proj / "runs")})
    prep.run_prep([round_dir / "trajectories.jsonl"], round_dir / "prep", cfg, make_plots=False)
    return round_dir / "prep" / "review_queue.jsonl"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A project copy with one round's trajectories and review queue, served by `hermes-lab lab`."""
    with serve_lab(tmp_path_factory.mktemp("lab"), _seed_round) as info:
        yield info


@pytest.fixture
def browser(lab, request):
    with chromium("1400,1100") as driver:
        yield driver
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / f"{request.node.name}-last.png"))  # what the page showed at the end


def _open_and_run_all(driver, lab, notebook: str) -> WebDriverWait:
    # reset: a fresh workspace (no tab of an earlier test restored), this notebook alone
    driver.get(f"{lab['url']}/lab/tree/notebooks/{notebook}?reset&token={TOKEN}")
    wait = WebDriverWait(driver, 120, poll_frequency=0.5)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{PANEL} .jp-Cell"))
    # the kernel is up when the toolbar's kernel status says Idle
    wait.until(lambda d: d.execute_script("return document.body.innerText.includes('Idle')"))
    driver.find_element(By.XPATH, "//li[contains(@class,'lm-MenuBar-item')][.//div[text()='Run']]").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "li[data-command='runmenu:run-all']"))
    driver.find_element(By.CSS_SELECTOR, "li[data-command='runmenu:run-all']").click()
    return wait


def _errors(driver) -> list[str]:
    return [
        e.text[:500] for e in driver.find_elements(By.CSS_SELECTOR, "[data-mime-type='application/vnd.jupyter.error']")
    ]


def _button(driver, text: str):
    return driver.find_element(By.XPATH, f"//button[contains(@class,'widget-button')][normalize-space()='{text}']")


def _text_input(driver, label: str):
    return driver.find_element(
        By.XPATH, f"//div[contains(@class,'widget-text')][.//label[normalize-space()='{label}']]//input"
    )


def _store_lines(lab) -> int:
    p = lab["proj"] / "runs" / "review" / "labels.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _panel(driver) -> str:
    return driver.find_element(By.CSS_SELECTOR, PANEL).text


def _until(driver, wait: WebDriverWait, lab, cond: Callable, what: str) -> None:
    """``wait.until(cond)``; a timeout fails saying what was awaited, the page's text and the label store."""
    try:
        wait.until(cond)
    except TimeoutException:
        store = lab["proj"] / "runs" / "review" / "labels.jsonl"
        lines = store.read_text().splitlines() if store.exists() else []
        pytest.fail(
            f"timed out waiting for {what}\n--- the notebook's text (end):\n{_panel(driver)[-2500:]}\n"
            f"--- {store} ({len(lines)} lines):\n" + "\n".join(lines)
        )


def test_review_notebook_labels_by_click_and_keys_and_undoes(lab, browser):
    from hermes_lab.review import gate as review

    driver = browser
    wait = _open_and_run_all(driver, lab, "review.ipynb")
    wait.until(lambda d: d.find_elements(By.XPATH, "//*[contains(text(),'Type your reviewer id above')]") or _errors(d))
    assert not _errors(driver), _errors(driver)
    assert str(lab["queue"]) in _panel(driver)  # the latest round's
    box = _text_input(driver, "Reviewer")
    box.send_keys("ada", Keys.ENTER)
    wait.until(lambda d: "Item 1 of" in _panel(d))
    items = review.load_queue(lab["queue"])
    # each step waits for the app's own answer on the page and exactly one more line in the store before the
    # next one: a click while the page still shows the last step could race it, and one line too many (a value
    # submitted twice) would be a bug, not a pass
    steps = [
        (lambda: _button(driver, "4").click(), "Saved 4 for item 1."),
        (lambda: _button(driver, "2").click(), "Saved 2 for item 2."),
        (lambda: _text_input(driver, "Keys").send_keys("5", Keys.ENTER), "Saved 5 for item 3."),
        (lambda: _button(driver, "Undo").click(), f"Undid label 5 on {items[2]['review_id']}."),  # a tombstone line
    ]
    for lines, (act, said) in enumerate(steps, 1):
        act()
        _until(
            driver,
            wait,
            lab,
            lambda d, s=said, n=lines: s in _panel(d) and _store_lines(lab) == n,
            f"step {lines}: {said}",
        )
    _until(driver, wait, lab, lambda d: "Item 3 of" in _panel(d), "back to item 3 after the undo")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "review_labeller.png"
    driver.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    live = review.current_labels(review.read_labels(lab["proj"] / "runs" / "review" / "labels.jsonl").records)
    got = {rid: rec["label"] for (rid, who), rec in live.items() if who == "ada"}
    assert got == {items[0]["review_id"]: 4.0, items[1]["review_id"]: 2.0}
    assert not _errors(driver), _errors(driver)


def test_data_prep_notebook_runs_and_its_plots_render(lab, browser):
    driver = browser
    wait = _open_and_run_all(driver, lab, "10_data_prep.ipynb")
    decoded = (
        "return Array.from(document.querySelectorAll('.jp-OutputArea-output img'))"
        ".filter(i => i.complete && i.naturalWidth > 200).length"
    )
    wait.until(lambda d: d.execute_script(decoded) >= 2 or _errors(d))
    wait.until(lambda d: "PASS" in _panel(d) or _errors(d))
    assert not _errors(driver), _errors(driver)
    assert driver.execute_script(decoded) >= 2
    driver.execute_script("document.querySelectorAll('.jp-OutputArea-output img')[0].scrollIntoView()")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "data_prep_plots.png"
    driver.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert (lab["proj"] / "runs" / "round-01" / "prep" / "plots").is_dir()
    lab["log"].seek(0)
    server_log = lab["log"].read()
    assert "running over TCP without encryption" not in server_log, server_log[-2000:]
