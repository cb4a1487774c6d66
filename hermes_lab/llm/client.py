"""Model API access: one client for OpenAI-compatible endpoints, its typed errors, and key/proxy helpers.

Used by the comparison reward's judge (``hermes_lab.llm.judge``: ``reward.model`` at ``reward.base_url``), by a
remotely served policy (``model.base_url``) and by ``hermes-lab doctor``. Reads the environment only: the
base URL and the key live in environment variables (the config names the variable, ``api_key_env``; the key
is never in a config). Writes nothing under runs/ (the judge's cache is ``hermes_lab.llm.judge``'s).

The user's connectivity check is ``curl -s $TAOTOKEN_BASE_URL/v1/models -H "Authorization: Bearer $KEY"``;
the client sends exactly that. Check a setup with

    hermes-lab doctor            # or: python -m hermes_lab.cli.doctor

Errors are typed and say what to fix (docs/SPEC.md, "Errors the user hits with the model API"):
ApiAuthError (401/403), ApiBadBody ("Error reading choices": the body was not the expected JSON; shows
status, content-type and the first bytes), ApiConnectionError (.kind: refused, dns, timeout, proxy, tls,
network), ApiStatusError (other HTTP errors, or 429/5xx once retries are spent), ApiConfigError
(also a key that holds a line break, a space or a non-ASCII character: refused before any request, and
the message shows no part of it), ApiCancelled (a batch stopped by Ctrl-C or its deadline).
Errors, keys, URLs and proxies are defined in ``hermes_lab.llm.base`` and re-exported here.
The key never reaches a log line, an exception, a repr or MLflow: messages pass through ``redact``
(``hermes_lab.core.redaction``: also ``user:password@`` in URLs). ``Retry-After`` is honoured in both its forms
(seconds, HTTP date), capped; anything else in it falls back to the exponential backoff.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from hermes_lab.llm.base import (  # the errors, keys, URLs and proxies: part of this module's interface
    API_KEY_ENV,
    BASE_URL_ENV,
    PROXY_VARS,
    RETRY_STATUSES,
    SDK_DEFAULT_HOSTS,
    ApiAuthError,
    ApiBadBody,
    ApiCancelled,
    ApiConfigError,
    ApiConnectionError,
    ApiError,
    ApiSkipped,
    ApiStatusError,
    Secret,
    describe_key,
    environment_proxies,
    key_fingerprint,
    load_key,
    no_proxy_entry,
    normalize_base_url,
    proxy_for,
    redact,
    safe_url,
    show_proxy,
)
from hermes_lab.llm.diagnose import Diagnosis, _json_or_none, _server_message

__all__ = [  # hermes_lab.llm.client is the interface; the helpers before HTTP live in hermes_lab.llm.base
    "API_KEY_ENV",
    "BASE_URL_ENV",
    "PROXY_VARS",
    "RETRY_STATUSES",
    "SDK_DEFAULT_HOSTS",
    "ApiAuthError",
    "ApiBadBody",
    "ApiCancelled",
    "ApiClient",
    "ApiConfigError",
    "ApiConnectionError",
    "ApiError",
    "ApiSkipped",
    "ApiStatusError",
    "Secret",
    "describe_key",
    "environment_proxies",
    "key_fingerprint",
    "load_key",
    "no_proxy_entry",
    "normalize_base_url",
    "proxy_for",
    "redact",
    "retry_after_seconds",
    "safe_url",
    "show_proxy",
]
log = logging.getLogger("hermes_lab.api")


# ------------------------------------------------------------------------------------------------ client
class ApiClient(Diagnosis):
    """An OpenAI-compatible endpoint: ``list_models()``, ``chat()``, ``chat_many()``.

    Retries 429/5xx/timeouts/connection errors with exponential backoff and jitter (honouring
    Retry-After); at most ``concurrency`` requests in flight across threads. DEBUG log (logger
    "hermes_lab.llm.client"): request id, method, path, status and time of every attempt."""

    def __init__(
        self,
        base_url: str | None,
        api_key_env: str = API_KEY_ENV,
        model: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        backoff_max_s: float = 20.0,
        retry_after_max_s: float = 60.0,
        concurrency: int = 8,
        base_url_source: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url_source = base_url_source or "base URL"
        self.base_url = normalize_base_url(base_url, self.base_url_source)
        self.api_key_env = api_key_env
        raw = load_key(api_key_env)
        self._key = Secret(raw)
        self.model = model.strip() if model else None
        self.timeout, self.retries = float(timeout), max(0, int(retries))
        self.backoff_s, self.backoff_max_s, self.retry_after_max_s = backoff_s, backoff_max_s, retry_after_max_s
        self.concurrency = max(1, int(concurrency))
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._rng = random.Random()
        self.proxy = proxy_for(self.base_url)
        try:
            # trust_env: honour HTTP(S)_PROXY/NO_PROXY/SSL_CERT_FILE like curl does; a broken proxy value
            # fails here already (socks without socksio, a bad port), so name the variables.
            self._http = httpx.Client(
                timeout=httpx.Timeout(self.timeout),
                follow_redirects=True,
                limits=httpx.Limits(max_connections=self.concurrency + 2, max_keepalive_connections=self.concurrency),
                transport=transport,
            )
        except (ImportError, ValueError, httpx.InvalidURL, httpx.UnsupportedProtocol) as e:
            set_vars = ", ".join(f"{n}={show_proxy(v)}" for n, v in os.environ.items() if n in PROXY_VARS and v)
            raise ApiConnectionError(
                f"local proxy failed: the proxy settings cannot be used ({set_vars}): "
                f"{self._redact(str(e))}. Unset the variable or fix its value.",
                kind="proxy",
            ) from None

    @classmethod
    def from_config(cls, cfg: Any, section: str = "reward", **kw: Any) -> ApiClient:
        """Client for the judge (section='reward') or the remotely served policy (section='model')."""
        sec = getattr(cfg, section)
        where = f"{section}.base_url" + (f" in {cfg.source}" if getattr(cfg, "source", None) else "")
        model = sec.model if section == "reward" else sec.base_model
        if section == "reward":
            kw.setdefault("timeout", sec.judge_timeout_s)
            kw.setdefault("retries", sec.judge_retries)
            kw.setdefault("concurrency", sec.judge_concurrency)
        return cls(sec.base_url, sec.api_key_env, model, base_url_source=where, **kw)

    def __repr__(self) -> str:
        return (
            f"ApiClient(base_url={safe_url(self.base_url)!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"
        )

    def describe(self) -> dict[str, Any]:
        """Secret-free settings, fit for MLflow params."""
        return {
            "base_url": safe_url(self.base_url),
            "model": self.model,
            "api_key_env": self.api_key_env,
            "timeout_s": self.timeout,
            "retries": self.retries,
            "concurrency": self.concurrency,
        }

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _redact(self, text: str) -> str:
        return redact(text, self._key.reveal())

    # ------------------------------------------------------------------------------------- endpoints
    def list_models(self) -> list[str]:
        """Model ids served at the base URL (GET {base}/v1/models, like the user's curl)."""
        resp, rid = self._request("GET", "/models")
        body = _json_or_none(resp)
        data = body.get("data") if isinstance(body, dict) else body
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise self._bad_body(
                "Error reading models",
                resp,
                rid,
                'Expected {"data": [{"id": ...}, ...]}; an '
                "HTML page comes from a proxy or middlebox, or a base URL that is not the API",
            )
        return [str(m["id"]) for m in data]

    def chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        model: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        *,
        cancel: threading.Event | None = None,
        **extra: Any,
    ) -> str:
        """One chat completion; returns choices[0].message.content. A string is one user message.
        ``cancel``: when set, no further attempt is made (ApiCancelled)."""
        model = (model or self.model or "").strip()
        if not model:
            raise ApiConfigError(
                "no model id: base URL, key and model id must all be set (pass model= or configure one)."
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        payload: dict[str, Any] = {"model": model, "messages": list(messages), "temperature": temperature}
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        payload.update(extra)
        resp, rid = self._request("POST", "/chat/completions", payload, model=model, cancel=cancel)
        body = _json_or_none(resp)
        hint = (
            f"A wrong model id ({model!r}) often answers an error page; an HTML page comes from a proxy "
            "or middlebox, or a base URL that is not the API"
        )
        if isinstance(body, dict) and "error" in body and "choices" not in body:
            hint = f"The server sent an error object: {_server_message(resp)!r}. " + hint
        try:
            choice = body["choices"][0]  # type: ignore[index]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise self._bad_body("Error reading choices", resp, rid, hint) from None
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if content is None:
            raise self._bad_body(
                "Error reading choices",
                resp,
                rid,
                f"The message content is null (finish_reason="
                f"{choice.get('finish_reason')!r}): a refusal, a tool call or max_tokens too small",
            )
        return str(content)

    def chat_many(
        self,
        batch: Sequence[str | Sequence[Mapping[str, Any]]],
        concurrency: int | None = None,
        *,
        return_exceptions: bool = False,
        progress: bool = False,
        deadline_s: float | None = None,
        **kw: Any,
    ) -> list[Any]:
        """``chat`` over many conversations, ``concurrency`` at a time, results in input order.

        An auth, config or connection error (after retries) stops the batch: what has not started yet is
        not sent (ApiSkipped), since every request would fail the same way. With ``return_exceptions``
        the errors are returned in place of the replies, else the first one is raised.

        Ctrl-C (KeyboardInterrupt, also a papermill timeout's interrupt) cancels the batch at once: queued
        requests are never sent, running ones make no further attempt, and the interrupt is re-raised
        without waiting for them (each ends within the request timeout). ``deadline_s`` does the same
        after that many seconds: the unfinished requests become ApiCancelled."""
        n = len(batch)
        results: list[Any] = [None] * n
        stop, cancel = threading.Event(), threading.Event()

        def one(i: int) -> str:
            if cancel.is_set():
                raise ApiCancelled("not sent: the batch was cancelled")
            if stop.is_set():
                raise ApiSkipped("not sent: an earlier request of this batch failed (see the first error)")
            try:
                return self.chat(batch[i], cancel=cancel, **kw)
            except (ApiAuthError, ApiConfigError, ApiConnectionError):
                stop.set()
                raise

        workers = max(1, min(concurrency or self.concurrency, n))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hermes-api")
        bar = None
        end = None if deadline_s is None else time.monotonic() + deadline_s
        try:
            futures = {pool.submit(one, i): i for i in range(n)}
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=n, desc="model API", unit="req")
            pending = set(futures)
            while pending:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                # a bounded wait: the main thread wakes up for Ctrl-C even where a blocked wait would not
                done, pending = wait(
                    pending, timeout=0.25 if left is None else min(left, 0.25), return_when=FIRST_COMPLETED
                )
                for f in done:
                    try:
                        results[futures[f]] = f.result()
                    except ApiError as e:
                        results[futures[f]] = e
                    if bar is not None:
                        bar.update(1)
            if pending:  # the deadline passed
                cancel.set()
                for f in pending:
                    f.cancel()
                    results[futures[f]] = ApiCancelled(
                        f"cancelled: the batch's deadline of {deadline_s:g} s passed before this request finished"
                    )
        except BaseException:
            cancel.set()
            raise
        finally:
            # never wait for queued work (cancel_futures) nor for requests in flight (they stop at their
            # next attempt, or at the request timeout)
            pool.shutdown(wait=not cancel.is_set(), cancel_futures=True)
            if bar is not None:
                bar.close()
        if not return_exceptions:
            errors = [r for r in results if isinstance(r, ApiError)]
            if errors:
                raise next((e for e in errors if not isinstance(e, (ApiSkipped, ApiCancelled))), errors[0])
        return results

    # -------------------------------------------------------------------------------------- transport
    def _request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        model: str | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[httpx.Response, str]:
        url = f"{self.base_url}/v1{path}"
        attempts = self.retries + 1
        for attempt in range(1, attempts + 1):
            if cancel is not None and cancel.is_set():
                raise ApiCancelled(f"not sent: the batch was cancelled (attempt {attempt}/{attempts})")
            rid = uuid.uuid4().hex[:12]
            headers = {
                "Authorization": f"Bearer {self._key.reveal()}",
                "Accept": "application/json",
                "X-Request-ID": rid,
                "User-Agent": "hermes-lab",
            }
            t0 = time.perf_counter()
            try:
                with self._slots:
                    resp = self._http.request(method, url, json=payload, headers=headers)
            except httpx.HTTPError as e:
                ms = (time.perf_counter() - t0) * 1000
                err = self._connection_error(e, url, rid, attempt)
                log.debug(
                    "req=%s %s /v1%s -> %s after %.0f ms (attempt %d/%d)",
                    rid,
                    method,
                    path,
                    err.kind,
                    ms,
                    attempt,
                    attempts,
                )
                retryable = isinstance(
                    e, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError, httpx.ProxyError)
                )
                if retryable and attempt < attempts:
                    delay = self._backoff(attempt)
                    log.debug("req=%s retrying in %.2f s", rid, delay)
                    self._sleep(delay, cancel)
                    continue
                raise err from None
            ms = (time.perf_counter() - t0) * 1000
            srv = resp.headers.get("x-request-id")
            log.debug(
                "req=%s %s /v1%s -> %d in %.0f ms (attempt %d/%d)%s",
                rid,
                method,
                path,
                resp.status_code,
                ms,
                attempt,
                attempts,
                f" server-id={srv}" if srv else "",
            )
            if resp.status_code in RETRY_STATUSES and attempt < attempts:
                delay = self._retry_delay(resp, attempt)
                log.debug("req=%s retrying in %.2f s", rid, delay)
                self._sleep(delay, cancel)
                continue
            if resp.status_code >= 300:
                raise self._status_error(resp, rid, method, attempt, model)
            return resp, rid
        raise AssertionError("unreachable")  # the loop returns or raises

    @staticmethod
    def _sleep(seconds: float, cancel: threading.Event | None) -> None:
        if cancel is None:
            time.sleep(seconds)
        elif cancel.wait(seconds):  # cancelled while waiting to retry: the loop raises ApiCancelled
            return

    def _backoff(self, attempt: int) -> float:
        # equal jitter: half fixed, half random, so clients that failed together do not retry together
        d = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return d / 2 + self._rng.uniform(0, d / 2)

    def _retry_delay(self, resp: httpx.Response, attempt: int) -> float:
        wait = retry_after_seconds(resp.headers.get("retry-after"))
        if wait is None:  # absent or not a valid value: our own backoff
            return self._backoff(attempt)
        # the server said when: wait that long (capped), plus a little jitter
        return min(wait, self.retry_after_max_s) + self._rng.uniform(0, self.backoff_s / 10)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (RFC 9110: delay-seconds or an HTTP date), or None
    for anything else (empty, negative, NaN, garbage, a date that cannot be read). Never raises; a date in
    the past means 0. The caller caps the result."""
    v = (value or "").strip()
    if not v:
        return None
    try:
        seconds = float(v)
    except ValueError:
        seconds = None
    if seconds is not None:
        return None if math.isnan(seconds) or seconds < 0 else seconds  # inf: the caller's cap
    try:
        when = parsedate_to_datetime(v)
        if when.tzinfo is None:  # "-0000" or no zone: HTTP dates are always GMT
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    except Exception:  # any unreadable header means "no advice", never an error
        return None
