"""hermes_lab.llm.client through real HTTP (tests/fake_openai.py): base URLs, errors, retries, concurrency, the judge
(hermes_lab.llm.judge), and that the key never shows up in exceptions, reprs, logs or printed output."""

from __future__ import annotations

import logging
import time

import pytest

from hermes_lab.config.schema import ConfigError, load_config
from hermes_lab.llm import client as api
from hermes_lab.llm.judge import ApiJudge, JudgeParseError, parse_score

from fake_openai import free_port, judge_score

KEY = "sk-test-SECRET-8f3a9c2e71"
WRONG = "sk-wrong-KEY-0000111122"


@pytest.fixture
def fake(fake_openai, monkeypatch):
    fake_openai.api_key = KEY
    monkeypatch.setenv("TAOTOKEN_BASE_URL", fake_openai.url)
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    return fake_openai


def client(base: str, **kw) -> api.ApiClient:
    kw.setdefault("backoff_s", 0.01)  # real backoff, test-sized
    kw.setdefault("timeout", 5)
    return api.ApiClient(base, "TAOTOKEN_API_KEY", "judge-1", **kw)


# ----------------------------------------------------------------------------------- base URL and key
@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/", "/v1/chat/completions"])
def test_base_url_with_or_without_v1_hits_v1_models_with_bearer(fake, suffix):
    ids = client(fake.url + suffix).list_models()
    assert ids == ["judge-1", "policy-1"]
    req = fake.requests[-1]
    assert (req.method, req.path) == ("GET", "/v1/models")
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["x-request-id"]


def test_missing_base_url_key_or_model_are_config_errors(fake, monkeypatch):
    with pytest.raises(api.ApiConfigError, match="must all be set"):
        api.ApiClient("", "TAOTOKEN_API_KEY")
    with pytest.raises(api.ApiConfigError, match="not an http"):
        api.ApiClient("api.example.com", "TAOTOKEN_API_KEY")
    with pytest.raises(api.ApiConfigError, match="no model id"):
        api.ApiClient(fake.url, "TAOTOKEN_API_KEY").chat("hi")
    monkeypatch.delenv("TAOTOKEN_API_KEY")
    with pytest.raises(api.ApiConfigError, match="TAOTOKEN_API_KEY is not set"):
        api.ApiClient(fake.url, "TAOTOKEN_API_KEY")


def test_key_pasted_with_bearer_prefix_is_sent_once(fake, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", f"Bearer {KEY}\n")
    assert client(fake.url).chat("hi") == "OK"
    assert fake.requests[-1].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    "key, kind",
    [
        ("sk-proj-abcdef0123456789", "api_key"),
        ("eyJhbGciOiJSUzI1NiJ9.eyJpc3MiOiJodHRwczovL2lkcC5leGFtcGxlIiwiZXhwIjoxfQ.c2lnbmF0dXJl", "oauth"),
        ("ya29.a0AfH6SMBxyz0123456789", "oauth"),
        ("Bearer sk-abc0123456789", "bearer"),
        ("sk-abc 0123456789", "malformed"),
    ],
)
def test_describe_key_tells_oauth_from_api_key_without_showing_it(key, kind):
    got, why = api.describe_key(key)
    assert got == kind
    assert key not in why and key[8:] not in why  # the prefix may be named, the secret part never
    if kind == "oauth":
        assert "not an API key" in why and "must not be mixed" in why
    if key.startswith("eyJ"):
        assert "expired" in why and "idp.example" in why  # exp=1 and iss decoded from the payload


def test_proxy_resolution_follows_httpx_rules():
    env = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2", "ALL_PROXY": "http://all:3"}
    assert api.proxy_for("https://api.example.com", env) == ("https_proxy", "http://lower:2")  # lowercase wins
    assert api.proxy_for("http://api.example.com", env) == ("ALL_PROXY", "http://all:3")
    assert api.proxy_for("https://api.example.com", {**env, "https_proxy": ""}) == ("ALL_PROXY", "http://all:3")
    assert api.proxy_for("https://api.example.com", {**env, "NO_PROXY": "example.com"}) is None
    assert api.proxy_for("https://api.example.com", {**env, "NO_PROXY": ".other.com,*"}) is None
    assert api.proxy_for("https://example.com", {**env, "no_proxy": ".example.com"}) is not None  # subdomains only


# ------------------------------------------------------------------------------------------ errors
def test_chat_reads_choices_and_404_names_the_model(fake):
    c = client(fake.url)
    assert c.chat([{"role": "user", "content": "hello"}], temperature=0.3, max_tokens=4) == "OK"
    body = fake.requests[-1].body
    assert body["model"] == "judge-1" and body["max_tokens"] == 4 and body["temperature"] == 0.3
    with pytest.raises(api.ApiStatusError, match="model id 'judge-9'") as e:
        c.chat("hi", model="judge-9")
    assert e.value.status == 404 and "does not exist" in str(e.value)


def test_401_explains_causes_and_redacts_the_echoed_key(fake, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", WRONG)  # the fake echoes the key it got in its error body
    c = client(fake.url)
    with pytest.raises(api.ApiAuthError) as e:
        c.list_models()
    msg = str(e.value)
    assert e.value.status == 401
    assert "must all be set" in msg and "Bearer" in msg and "default base URL gets 401" in msg
    assert "Incorrect API key provided: ***" in msg
    assert WRONG not in msg and WRONG not in (e.value.body_head or "") and WRONG not in repr(e.value.args)
    assert fake.count() == 1  # 401 is not retried


@pytest.mark.parametrize(
    "mode, expect",
    [
        ("html", ["HTTP 200", "text/html", "<!DOCTYPE html>"]),
        ("malformed", ["HTTP 200", "application/json", '{"id": "cmpl-1", "choices"']),
        ("no_choices", ["HTTP 200", "chat.completion"]),
    ],
)
def test_body_not_the_expected_json_says_error_reading_choices(fake, mode, expect):
    fake.mode = mode
    with pytest.raises(api.ApiBadBody) as e:
        client(fake.url).chat("hi")
    msg = str(e.value)
    assert msg.startswith("Error reading choices")
    for s in expect:
        assert s in msg
    assert e.value.status == 200 and e.value.body_head


def test_429_retried_honouring_retry_after(fake):
    fake.configure(fail_429=2, retry_after="0.2")
    t0 = time.perf_counter()
    assert client(fake.url, retries=3).chat("hi") == "OK"
    assert fake.count("/v1/chat/completions") == 3
    assert time.perf_counter() - t0 >= 0.4  # two waits of Retry-After 0.2 s, not the 0.01 s backoff


def test_500_once_then_ok(fake):
    fake.fail_500 = 1
    assert client(fake.url, retries=2).list_models() == ["judge-1", "policy-1"]
    assert fake.count() == 2


def test_429_beyond_the_retries_is_a_status_error(fake):
    fake.fail_429 = 10
    with pytest.raises(api.ApiStatusError, match="after 3 attempts") as e:
        client(fake.url, retries=2).chat("hi")
    assert e.value.status == 429 and fake.count() == 3


def test_timeout_is_retried_then_reported(fake):
    fake.configure(delay_s=0.6, delay_n=1)  # only the first request is slow
    assert client(fake.url, timeout=0.3, retries=2).chat("hi") == "OK"
    assert fake.count() >= 2  # the first attempt timed out and was retried
    fake.configure(delay_s=0.5, delay_n=None)
    with pytest.raises(api.ApiConnectionError, match="timeout") as e:
        client(fake.url, timeout=0.15, retries=1).chat("hi")
    assert e.value.kind == "timeout" and "after 2 attempts" in str(e.value)


def test_connection_refused_dns_and_stale_proxy_are_told_apart(fake, monkeypatch):
    port = free_port()
    with pytest.raises(api.ApiConnectionError, match="connection refused") as e:
        client(f"http://127.0.0.1:{port}", retries=1).list_models()
    assert e.value.kind == "refused"
    with pytest.raises(api.ApiConnectionError, match="DNS lookup failed") as e:
        client("http://no-such-host.invalid", retries=0).list_models()
    assert e.value.kind == "dns"
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    with pytest.raises(api.ApiConnectionError, match="local proxy failed") as e:
        client(fake.url, retries=0).list_models()
    assert e.value.kind == "proxy" and e.value.proxy_var == "HTTP_PROXY" and "unset HTTP_PROXY" in str(e.value)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # NO_PROXY is respected: direct again
    assert client(fake.url).list_models()


def test_unusable_proxy_setting_is_named(fake, monkeypatch):
    try:
        import socksio  # noqa: F401

        pytest.skip("socksio installed: a socks proxy is usable")
    except ImportError:
        pass
    monkeypatch.setenv("ALL_PROXY", "socks5://user:pw-secret@127.0.0.1:1080")
    with pytest.raises(api.ApiConnectionError, match="ALL_PROXY=socks5://127.0.0.1:1080") as e:
        client(fake.url)
    assert e.value.kind == "proxy" and "socksio" in str(e.value) and "pw-secret" not in str(e.value)


# --------------------------------------------------------------------------------------- concurrency
def test_chat_many_keeps_order_and_the_concurrency_limit(fake):
    fake.delay_s = 0.15
    t0 = time.perf_counter()
    out = client(fake.url).chat_many(["a"] * 8, concurrency=3)
    assert out == ["OK"] * 8
    assert 2 <= fake.max_inflight <= 3
    assert time.perf_counter() - t0 < 8 * 0.15  # ran in parallel


def test_chat_many_stops_a_batch_on_auth_error(fake, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", WRONG)
    with pytest.raises(api.ApiAuthError):
        client(fake.url).chat_many(["a"] * 6, concurrency=1)
    assert fake.count() == 1  # the other five were not sent
    res = client(fake.url).chat_many(["a"] * 3, concurrency=1, return_exceptions=True)
    assert isinstance(res[0], api.ApiAuthError) and all(isinstance(r, api.ApiSkipped) for r in res[1:])


def test_key_never_in_repr_logs_or_output(fake, monkeypatch, caplog, capsys):
    caplog.set_level(logging.DEBUG)  # every logger, httpx and httpcore included
    c = client(fake.url)
    c.list_models()
    c.chat("hi")
    fake.api_key = "another"  # now the server refuses KEY and echoes it back
    with pytest.raises(api.ApiAuthError) as e:
        c.chat("hi")
    print(e.value, repr(c), vars(c), c.describe())
    logging.getLogger("test").error("failure: %s", e.value)
    out = capsys.readouterr()
    for text in (out.out, out.err, caplog.text, repr(c), str(vars(c)), str(c.describe()), str(e.value)):
        assert KEY not in text
    assert (
        "req=" in caplog.text
        and "GET /v1/models -> 200" in caplog.text
        and "POST /v1/chat/completions -> 401" in caplog.text
    )
    assert "TAOTOKEN_API_KEY" in repr(c)


# ---------------------------------------------------------------------------------------------- judge
@pytest.mark.parametrize(
    "reply, score",
    [
        ("4", 4),
        ("**3**", 3),
        ("Score: 4/5", 4),
        ("score = 2.5", 2.5),
        ("4 out of 5", 4),
        ("8/10", 4),
        ("<think>3 or 5? maybe 1</think>\n5", 5),
        ("I would give it a 2.", 2),
    ],
)
def test_parse_score(reply, score):
    assert parse_score(reply, 5) == score


@pytest.mark.parametrize("reply", ["no idea", "between 2 and 3", "7", "-1"])
def test_parse_score_rejects_with_the_raw_reply(reply):
    with pytest.raises(JudgeParseError, match="raw reply") as e:
        parse_score(reply, 5)
    assert repr(reply) in str(e.value)


def test_judge_scores_batches_and_caches_on_disk(fake, tmp_path):
    fake.judge_format = "Score: {score}/5"
    cache = tmp_path / "judge.jsonl"
    prompts = ["add 2 3", "reverse abc", "upper hi", "add 2 3"]
    responses = ["5", "cba", "HX", "5"]
    refs = ["5", "cba", "HI", "5"]
    judge = ApiJudge(client(fake.url), scale=5, concurrency=4, cache_path=cache)
    scores = judge.score(prompts, responses, refs)
    assert scores == [judge_score(r, ref) for r, ref in zip(responses, refs)] == [5, 5, 2, 5]
    assert fake.count("/v1/chat/completions") == 3  # the duplicate asked once
    assert judge.stats == {"requests": 3, "cache_hits": 0, "failed": 0}
    sent = fake.requests[-1].body
    assert (
        sent["model"] == "judge-1" and sent["temperature"] == 0.0 and "<<<REFERENCE " in sent["messages"][1]["content"]
    )

    assert judge.score(prompts, responses, refs) == scores  # second call: no request
    assert fake.count("/v1/chat/completions") == 3 and judge.stats["cache_hits"] == 4
    again = ApiJudge(client(fake.url), cache_path=cache)  # a rerun reads the file
    assert again.score_one("upper hi", "HX", "HI") == 2 and fake.count("/v1/chat/completions") == 3
    assert len(cache.read_text().splitlines()) == 3 and KEY not in cache.read_text()


def test_judge_survives_429s_and_timeouts(fake, tmp_path):
    fake.configure(fail_429=3, retry_after="0", delay_s=0.5, delay_n=1)
    judge = ApiJudge(client(fake.url, timeout=0.25, retries=4), concurrency=2, cache_path=tmp_path / "c.jsonl")
    assert judge.score(["p1", "p2", "p3"], ["x", "yy", "z"], ["x", "yy", "q"]) == [5, 5, 0]
    assert fake.count() >= 3 + 3  # three answered, plus the 429s and the timed-out one


def test_judge_unparseable_reply_is_an_error_quoting_it_and_not_cached(fake, tmp_path):
    fake.chat_reply = "I cannot decide."
    judge = ApiJudge(client(fake.url), cache_path=tmp_path / "c.jsonl")
    with pytest.raises(JudgeParseError, match="I cannot decide"):
        judge.score(["p"], ["a"], ["b"])
    assert len(judge.cache) == 0


def test_judge_from_the_users_config(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("HERMES_REWARD_MODEL", "judge-1")
    cfg_path = tmp_path / "hermes_grpo_lora.yaml"
    cfg_path.write_text(
        "reward:\n  model: ${HERMES_REWARD_MODEL}\n  base_url: ${TAOTOKEN_BASE_URL}\n"
        "  scale: 5\n  judge_timeout_s: 3\n  judge_retries: 1\n  judge_concurrency: 2\n"
        f"round:\n  runs_dir: {tmp_path / 'runs'}\n"
    )
    cfg = load_config(cfg_path)
    judge = ApiJudge.from_config(cfg)
    assert (judge.model, judge.client.base_url, judge.client.timeout, judge.client.retries) == (
        "judge-1",
        fake.url,
        3.0,
        1,
    )
    assert judge.score_one("p", "abc", "abc") == 5
    assert (tmp_path / "runs" / "cache" / "judge.jsonl").is_file()
    with pytest.raises(api.ApiConfigError, match="local"):
        ApiJudge.from_config(load_config(cfg_path, overrides={"reward.model": "local"}))
    with pytest.raises(ConfigError, match="reward.base_url"):  # config.py refuses it at load time now
        load_config(cfg_path, overrides={"reward.base_url": ""})


# ------------------------------------------------------------------------------------ hardening (issue 16)
PASTED = "Qx7Zr9WmTk3Lp8Vb"  # no word in it: a message that held any 4 characters of it would be caught


def _no_part_of(key: str, text: str) -> bool:
    return not any(key[i : i + 4] in text for i in range(len(key) - 3))


@pytest.mark.parametrize(
    "value, problem",
    [
        (f"{PASTED}\n{PASTED[::-1]}", "line break"),
        (f"{PASTED}\r\nmore", "line break"),
        (f"{PASTED} {PASTED[::-1]}", "space or tab"),
        (f"{PASTED}\u2013{PASTED[::-1]}", "non-ASCII"),  # an en dash from a pasted document
        (f"{PASTED}\u200b", "non-ASCII"),  # an invisible zero-width space
        (f"{PASTED}\x1b[0m", "control character"),
        (f'"{PASTED}"', "quotes"),
    ],
)
def test_a_malformed_key_is_refused_before_any_request_without_showing_it(fake, monkeypatch, value, problem):
    """A bad paste used to reach httpx, whose header error quoted the key (or crashed on non-ASCII)."""
    monkeypatch.setenv("TAOTOKEN_API_KEY", value)
    with pytest.raises(api.ApiConfigError) as e:
        client(fake.url).list_models()
    msg = str(e.value)
    assert "TAOTOKEN_API_KEY" in msg and problem in msg
    assert _no_part_of(PASTED, msg) and _no_part_of(PASTED[::-1], msg) and "position" not in msg
    assert fake.count() == 0


@pytest.mark.parametrize(
    "header",
    ["nan", "-5", "soon", "1e999", "inf", "", "Wed, 21 Oct 2015 07:28:00 GMT", "Fri, 99 Foo 2026 25:61:00", "1, 2"],
)
def test_any_retry_after_is_handled_and_never_raises(fake, header):
    """'nan' used to reach time.sleep() and raise a plain ValueError out of the client."""
    fake.configure(fail_429=1, retry_after=header)
    t0 = time.perf_counter()
    assert client(fake.url, retries=1, retry_after_max_s=0.3).chat("hi") == "OK"
    assert time.perf_counter() - t0 < 2.0 and fake.count() == 2


def test_retry_after_forms():
    from email.utils import formatdate

    now = time.time()
    assert api.retry_after_seconds("2") == 2.0 and api.retry_after_seconds(" 0.5 ") == 0.5
    assert api.retry_after_seconds(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert api.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert api.retry_after_seconds("Wed, 21 Oct 2015 07:28:00 -0000", now=0) > 1e9  # no zone: GMT
    for bad in (None, "", "nan", "-1", "soon", "1, 2", "Fri, 99 Foo 2026"):
        assert api.retry_after_seconds(bad) is None, bad
    assert api.retry_after_seconds("inf") == float("inf")  # the caller caps it


CTRL_C_CHILD = """
import signal, sys, time
# a shell's background job starts with SIGINT ignored, and Python then keeps it so: Ctrl-C is what we test
signal.signal(signal.SIGINT, signal.default_int_handler)
from hermes_lab.llm import client as api
c = api.ApiClient(sys.argv[1], "TAOTOKEN_API_KEY", "judge-1", timeout=5, retries=0)
t0 = time.monotonic()
try:
    c.chat_many(["hi"] * 40, concurrency=2)
except KeyboardInterrupt:
    print(f"interrupted {time.monotonic() - t0:.2f}", flush=True)
"""


def test_ctrl_c_cancels_a_batch_at_once(fake, tmp_path):
    """Ctrl-C (or a papermill timeout's interrupt) used to wait for every queued request of the pool."""
    import os
    import signal
    import subprocess
    import sys

    fake.delay_s = 0.4  # 40 requests, 2 at a time: 8 s if the queue were drained
    env = dict(os.environ, TAOTOKEN_API_KEY=KEY)
    child = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_CHILD, fake.url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180  # a loaded machine can take long to start the child
    while fake.count() < 2 and time.monotonic() < deadline and child.poll() is None:  # the batch is under way
        time.sleep(0.05)
    assert child.poll() is None and fake.count() >= 2, (fake.count(), child.poll())
    t0 = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    assert "interrupted" in out, (out, err[-2000:])
    assert time.monotonic() - t0 < 2.5  # at most the requests in flight finish (0.4 s each)
    time.sleep(0.5)
    assert fake.count() <= 6  # nothing queued was sent after the interrupt


def test_a_batch_deadline_cancels_the_rest(fake):
    fake.delay_s = 0.3
    t0 = time.perf_counter()
    out = client(fake.url).chat_many(["hi"] * 20, concurrency=2, deadline_s=0.5, return_exceptions=True)
    assert time.perf_counter() - t0 < 1.5
    done = [r for r in out if r == "OK"]
    cancelled = [r for r in out if isinstance(r, api.ApiCancelled)]
    assert 1 <= len(done) <= 6 and len(done) + len(cancelled) == 20 and "deadline" in str(cancelled[0])
    time.sleep(0.4)
    assert fake.count() <= 6
    with pytest.raises(api.ApiCancelled):
        client(fake.url).chat_many(["hi"] * 6, concurrency=1, deadline_s=0.1)


def test_url_credentials_are_redacted_in_every_message(fake, monkeypatch):
    port = free_port()
    with pytest.raises(api.ApiConnectionError) as e:
        client(f"http://bob:pw-s3cret-word@127.0.0.1:{port}", retries=0).list_models()
    with pytest.raises(api.ApiConfigError) as e2:
        api.ApiClient("ftp://bob:pw-s3cret-word@host/", "TAOTOKEN_API_KEY")
    c = client(f"http://bob:pw-s3cret-word@127.0.0.1:{fake.port}")
    for text in (str(e.value), str(e2.value), repr(c), str(c.describe()), api.redact(f"GET {c.base_url}/v1/models")):
        assert "pw-s3cret-word" not in text and "bob:" not in text, text


def test_judge_failures_are_per_sample(fake, tmp_path):
    """A 429 after the retries or an unparsable reply used to raise out of the whole batch."""
    fake.configure(fail_429=2)
    judge = ApiJudge(client(fake.url, retries=0), concurrency=1, cache_path=tmp_path / "c.jsonl")
    scores, errors = judge.score_or_none(["p1", "p2", "p3", "p4"], ["a", "b", "c", "d"], ["a", "b", "c", "x"])
    assert scores[:2] == [None, None] and scores[2:] == [5.0, 0.0]
    assert all(isinstance(e, api.ApiStatusError) and e.status == 429 for e in errors[:2]) and errors[2:] == [None] * 2
    assert len(judge.cache) == 2 and judge.stats == {"requests": 4, "cache_hits": 0, "failed": 2}
    fake.chat_reply = "I cannot decide."
    scores, errors = judge.score_or_none(["p1", "p3"], ["a", "c"], ["a", "c"])
    assert scores == [None, 5.0] and isinstance(errors[0], JudgeParseError)  # p3 came from the cache
    fake.configure(chat_reply=None, api_key="another")  # every request would fail: raised, not per sample
    with pytest.raises(api.ApiAuthError):
        judge.score_or_none(["p9"], ["a"], ["b"])
