"""`hermes-lab doctor` against a real HTTP server (tests/fake_openai.py): passes when all is right, and
names the exact problem otherwise. The key never appears in what it prints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hermes_lab.cli import doctor

from fake_openai import free_port

KEY = "sk-test-SECRET-8f3a9c2e71"
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzY29wZSI6Im9wZW5pZCJ9.c2lnbmF0dXJlMTIzNDU2"
VARS = ("TAOTOKEN_BASE_URL", "TAOTOKEN_API_KEY", "HERMES_REWARD_MODEL", "HERMES_POLICY_MODEL")


@pytest.fixture
def fake(fake_openai, monkeypatch):
    fake_openai.api_key = KEY
    for k, v in zip(VARS, (fake_openai.url, KEY, "judge-1", "policy-1")):
        monkeypatch.setenv(k, v)
    return fake_openai


def run(capsys, *argv: str) -> tuple[int, dict[str, str], str, str]:
    """Exit code, {check name: 'STATUS explanation'}, stdout, stderr; asserts no key value was printed."""
    code = doctor.main(["--timeout", "2", *argv])
    out = capsys.readouterr()
    for secret in (KEY, JWT, "sk-wrong-KEY-0000111122"):
        assert secret not in out.out and secret not in out.err
    rows = {}
    for line in out.out.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 5 and cells[2] in ("PASS", "WARN", "FAIL", "SKIP"):
            rows[cells[1]] = f"{cells[2]} {cells[3]}"
    assert rows, out.out
    return code, rows, out.out, out.err


def test_passes_when_all_is_right(fake, capsys):
    code, rows, out, _ = run(capsys)
    assert code == 0, out
    assert all(v.startswith("PASS") for v in rows.values()), rows
    assert {
        "variables",
        "proxy",
        "base URL",
        "key",
        "GET /v1/models",
        "model HERMES_REWARD_MODEL",
        "model HERMES_POLICY_MODEL",
    } <= rows.keys()
    assert "all checks passed" in out and "fingerprint sha256:" in rows["key"]
    assert fake.requests[0].path == "/v1/models" and fake.requests[0].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize("var", VARS)
def test_missing_variable_is_named(fake, capsys, monkeypatch, var):
    monkeypatch.delenv(var)
    code, rows, _, _ = run(capsys)
    assert code == 1
    assert rows["variables"].startswith("FAIL") and f"not set: {var}" in rows["variables"]
    if var == "TAOTOKEN_BASE_URL":
        assert "answers 401" in rows["variables"] and rows["GET /v1/models"].startswith("SKIP")


def test_wrong_key_gets_401_explained(fake, capsys, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", "sk-wrong-KEY-0000111122")  # the fake echoes it: must be redacted
    code, rows, _, _ = run(capsys)
    assert code == 1
    r = rows["GET /v1/models"]
    assert r.startswith("FAIL 401 Unauthorized")
    assert "must all be set" in r and "Bearer" in r and "default base URL gets 401" in r and "***" in r
    assert rows["model HERMES_REWARD_MODEL"].startswith("SKIP")


def test_oauth_token_is_told_from_an_api_key(fake, capsys, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", JWT)
    code, rows, _, _ = run(capsys)
    assert code == 1
    assert rows["key"].startswith("WARN") and "OAuth access token, not an API key" in rows["key"]
    assert "must not be mixed" in rows["GET /v1/models"]


def test_wrong_model_id_is_named_with_close_matches(fake, capsys, monkeypatch):
    monkeypatch.setenv("HERMES_POLICY_MODEL", "policy-2")
    code, rows, out, _ = run(capsys)
    assert code == 1
    r = rows["model HERMES_POLICY_MODEL"]
    assert r.startswith("FAIL wrong model id") and "'policy-2'" in r and "close matches: policy-1" in r
    assert rows["model HERMES_REWARD_MODEL"].startswith("PASS")
    assert "1 check(s) failed: model HERMES_POLICY_MODEL" in out


def test_html_body_shows_status_and_raw_bytes(fake, capsys):
    fake.mode = "html"
    code, rows, _, _ = run(capsys)
    assert code == 1
    r = rows["GET /v1/models"]
    assert "not the expected JSON" in r and "HTTP 200" in r and "text/html" in r and "<!DOCTYPE html>" in r


def test_stale_proxy_variable_is_named(fake, capsys, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HTTP_PROXY", dead)  # the fake is http://, so HTTP_PROXY is the one in use
    code, rows, _, _ = run(capsys)
    assert code == 1
    assert (
        rows["proxy HTTP_PROXY"].startswith("FAIL local proxy failed")
        and "unset HTTP_PROXY" in rows["proxy HTTP_PROXY"]
    )
    assert "local proxy failed" in rows["GET /v1/models"] and "HTTP_PROXY=" + dead in rows["GET /v1/models"]

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # respected: the API goes direct, the variable is only stale
    code, rows, _, _ = run(capsys)
    assert code == 0
    assert rows["proxy HTTP_PROXY"].startswith("WARN stale proxy variable") and "NO_PROXY" in rows["proxy HTTP_PROXY"]


def test_stale_https_proxy_warns_for_an_http_endpoint(fake, capsys, monkeypatch):
    monkeypatch.setenv("https_proxy", f"http://user:hunter2pw@127.0.0.1:{free_port()}")
    code, rows, out, _ = run(capsys)
    assert code == 0 and rows["GET /v1/models"].startswith("PASS")
    assert "hunter2pw" not in out  # a proxy password is not printed either
    assert rows["proxy https_proxy"].startswith("WARN") and "unset https_proxy" in rows["proxy https_proxy"]


def test_server_down_is_connection_refused(fake, capsys, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    code, rows, _, _ = run(capsys)
    assert code == 1 and rows["GET /v1/models"].startswith("FAIL connection refused")


def test_timeout_is_reported(fake, capsys):
    fake.delay_s = 1.0
    code, rows, _, _ = run(capsys, "--timeout", "0.2")
    assert code == 1 and rows["GET /v1/models"].startswith("FAIL timeout") and "0.2 s" in rows["GET /v1/models"]


def test_params_config_supplies_base_url_and_model_ids(fake, capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "hermes_grpo_lora.yaml"
    cfg.write_text(
        "model:\n  base_model: ${HERMES_POLICY_MODEL}\n  base_url: ${TAOTOKEN_BASE_URL}\n"
        "  api_key_env: TAOTOKEN_API_KEY\nreward:\n  model: ${HERMES_REWARD_MODEL}\n"
        "  base_url: ${TAOTOKEN_BASE_URL}\n"
    )
    code, rows, out, _ = run(capsys, "--params", str(cfg))
    assert code == 0, out
    assert rows["config"].startswith("PASS") and "reward.model=judge-1" in rows["config"]
    assert rows["model reward.model"].startswith("PASS") and rows["model model.base_model"].startswith("PASS")

    monkeypatch.setenv("HERMES_REWARD_MODEL", "judge-x")
    code, rows, _, _ = run(capsys, "--params", str(cfg))
    assert code == 1 and "reward.model='judge-x'" in rows["model reward.model"]

    monkeypatch.delenv("HERMES_REWARD_MODEL")
    code, rows, _, _ = run(capsys, "--params", str(cfg))
    assert code == 1 and rows["config"].startswith("FAIL") and "HERMES_REWARD_MODEL is not set" in rows["config"]


def test_debug_logs_request_id_status_and_timing(fake, capsys):
    code, rows, _, err = run(capsys, "--debug", "--chat")
    assert code == 0
    assert "req=" in err and "GET /v1/models -> 200 in" in err and "POST /v1/chat/completions -> 200" in err
    assert rows["chat HERMES_REWARD_MODEL"].startswith("PASS") and "'OK'" in rows["chat HERMES_REWARD_MODEL"]


def test_python_dash_m_entry_point(fake):
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    res = subprocess.run(
        [sys.executable, "-m", "hermes_lab.cli.doctor", "--timeout", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all checks passed" in res.stdout and KEY not in res.stdout + res.stderr


# ------------------------------------------------------------------------------------ hardening (issue 16)
@pytest.mark.parametrize(
    "value, problem",
    [
        ("Qx7Zr9WmTk3Lp8Vb\u2013Kp2", "non-ASCII"),  # used to crash the doctor (UnicodeEncodeError in httpx)
        ("Qx7Zr9WmTk3Lp8Vb\udcffKp2", "not valid UTF-8"),  # invalid bytes in the environment (surrogateescape)
        ("Qx7Zr9WmTk3Lp8Vb\nKp2Lv8Ns", "line break"),  # httpx quoted the part after the newline
    ],
)
def test_a_malformed_key_is_a_fail_row_naming_the_variable_never_a_crash(fake, capsys, monkeypatch, value, problem):
    monkeypatch.setenv("TAOTOKEN_API_KEY", value)
    code, rows, out, err = run(capsys)
    assert code == 1
    assert rows["key"].startswith("FAIL") and "TAOTOKEN_API_KEY" in rows["key"] and problem in rows["key"]
    assert rows["GET /v1/models"].startswith("SKIP") and fake.count() == 0
    for part in ("Qx7Z", "r9Wm", "Tk3L", "p8Vb", "Kp2L", "v8Ns"):
        assert part not in out and part not in err


def test_credentials_in_the_base_url_are_never_printed(fake, capsys, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_BASE_URL", f"http://bob:pw-s3cret-word@127.0.0.1:{fake.port}")
    _code, rows, out, err = run(capsys, "--debug")
    assert "pw-s3cret-word" not in out + err and "bob:" not in out + err
    assert "127.0.0.1" in rows["base URL"]
