"""The live flywheel's status page (issue 30): ``hermes_lab.live.page.render`` on its own, then served by a real
HTTP server (Starlette under uvicorn on 127.0.0.1) and opened in headless Chromium driven by Selenium.

The browser test needs Debian's chromium and chromium-driver (as tests/e2e/test_browser.py does); without them it
skips and says so. Its screenshot lands in tests/artifacts/status_page.png (git-ignored).
``chromium_page(url, name)`` (the page's visible text and its screenshot) and ``serve_html(page)`` are kept small
so other tests can import them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_lab.live.page import render

from repo_paths import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PAYLOAD = "<script>window.__pwned = 1</script>"
EVIL_MODEL = "<script>alert(1)</script>"

SAMPLE = {
    "updated": "2026-12-05T01:02:03+00:00",
    "address": "http://127.0.0.1:8700",
    "pid": 1234,
    "phase": "experiment",
    "waiting_for": ["312 more conversations with feedback (data.min_samples 500)", "cooldown: 3.2 h left"],
    "time_scale": 60.0,
    "round": {"number": 2, "stage": "train", "since": "2026-12-05T01:00:00+00:00", "pid": 4321},
    "experiment": {
        "name": "round-01",
        "log_dir": "runs/live/round-01",
        "status": "running",
        "stage": 1,
        "ratio": 0.3,
        "stages": [[0.1, 7200], [0.3, 14400], [1.0, 0]],
        "waiting_for": f"the stage's planned end {PAYLOAD}",
        "n_baseline": 120,
        "n_candidate": 40,
        "arms": {
            "baseline": {"kind": "local", "base": "embedded:tiny", "adapter": None},
            "candidate": {"kind": "upstream", "url": "http://127.0.0.1:8000/v1/chat/completions", "model": EVIL_MODEL},
        },
    },
    "counts": {"conversations": 188, "min_samples": 500, "cooldown_left_s": 11520.0, "labels": 3, "labels_needed": 20},
    "rounds": [
        {
            "round": 1,
            "status": "promoted",
            "decision": "promote",
            "pass_rate": 0.628,
            "base_pass_rate": 0.399,
            "gain": 0.229,
            "experiment": "round-01",
            "ended": "2026-12-05T00:50:00+00:00",
        },
        {
            "round": 2,
            "status": "rolled back",
            "decision": "roll back",
            "pass_rate": 0.55,
            "base_pass_rate": 0.628,
            "gain": -0.078,
            "experiment": "round-02",
            "ended": None,
        },
    ],
    "swaps": [
        {"at": "2026-12-05T00:51:00+00:00", "experiment": "round-01", "baseline": "tiny", "candidate": "round-01"}
    ],
    "mlflow_ui": "http://127.0.0.1:5000",
    "failed_requests": 0,
    "answered_requests": 1234,
}


# ---- render() on its own ----


def test_values_are_escaped():
    page = render(SAMPLE)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script" not in page.lower()
    assert "window.__pwned = 1" in page  # shown as text, escaped


def test_a_full_document_that_refreshes_itself():
    page = render(SAMPLE)
    assert page.startswith("<!DOCTYPE html>")
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "312 more conversations with feedback" in page and "cooldown: 3.2 h left" in page
    assert "hermes-lab live flywheel" in page and "http://127.0.0.1:8700" in page
    assert "stage 2 of 3" in page and "candidate share 30%" in page
    assert '<span class="now">30%</span>' in page and "10%" in page and "100%" in page
    assert "demo clock" in page
    assert '<a href="http://127.0.0.1:5000">MLflow UI</a>' in page


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"round": None, "experiment": None, "rounds": None, "swaps": None, "counts": None, "waiting_for": None},
        {"experiment": {}, "round": {}, "rounds": [{}], "swaps": [{}], "counts": {}, "mlflow_ui": None},
        {"experiment": {"stages": [], "stage": None, "arms": {"baseline": None}}, "time_scale": None},
    ],
)
def test_missing_keys_render(status):
    page = render(status)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "—" in page


def test_nothing_to_wait_for():
    assert "<li>nothing</li>" in render({"waiting_for": []})


def test_gains_in_points_with_sign():
    page = render(SAMPLE)
    assert "+22.9 pts" in page and "-7.8 pts" in page
    assert "62.8%" in page and "39.9%" in page
    assert "+0.0 pts" in render({"rounds": [{"gain": 0.0}]})


@pytest.mark.parametrize("url", ["javascript:alert(1)", "JavaScript:alert(1)", "data:text/html,x", "//evil"])
def test_only_http_mlflow_ui_is_a_link(url):
    page = render({"mlflow_ui": url})
    assert "<a " not in page and "href" not in page
    assert "MLflow UI" in page


def test_the_mlflow_href_is_escaped():
    page = render({"mlflow_ui": 'http://x/"><script>alert(1)</script>'})
    assert 'href="http://x/&quot;&gt;&lt;script&gt;' in page and "<script" not in page


# ---- a real server, a real browser ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_html(page: str) -> Iterator[str]:
    """``page`` served at GET / by a Starlette app under uvicorn (a background thread, 127.0.0.1, a free port);
    yields the URL, stops the server on exit."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    app = Starlette(routes=[Route("/", lambda request: HTMLResponse(page))])
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            pytest.fail("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _skip_without_browser() -> None:
    pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(
            f"browser tests need {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver; "
            "`make test` installs them when run as root)"
        )


@contextlib.contextmanager
def chromium(size: str = "1280,1000") -> Iterator:
    """A headless Chromium (Debian's, with its own throw-away profile) under Selenium, ``size`` its window;
    skips without one. tests/e2e/test_browser.py drives JupyterLab with it too."""
    _skip_without_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM  # never let Selenium Manager download a browser
    profile = tempfile.mkdtemp(prefix="hermes-chromium-")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={size}",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def chromium_page(url: str, name: str, driver=None) -> tuple[str, Path]:
    """Open ``url`` in headless Chromium: the page's visible text and its screenshot,
    tests/artifacts/<name>.png. A ``driver`` given is used (and left open); else one is started and quit."""
    from selenium.webdriver.common.by import By

    if driver is None:
        with chromium() as own:
            return chromium_page(url, name, own)
    driver.get(url)
    text = driver.find_element(By.TAG_NAME, "body").text
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    return text, shot


@pytest.mark.slow
def test_the_page_in_chromium():
    _skip_without_browser()
    with serve_html(render(SAMPLE)) as url, chromium() as driver:
        text, shot = chromium_page(url, "status_page", driver)
        assert driver.execute_script("return window.__pwned === undefined"), "an injected script ran"
        assert driver.title.startswith("hermes-lab flywheel")
    assert "312 more conversations with feedback (data.min_samples 500)" in text
    assert "1 promoted promote 62.8% 39.9% +22.9 pts round-01" in text  # the rounds table's row
    assert "<script>alert(1)</script>" in text and PAYLOAD in text  # shown as text
    assert "MLflow UI" in text and "10% → 30% → 100%" in text
    assert shot.is_file() and shot.stat().st_size > 10_000
