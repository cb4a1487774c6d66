"""Model API access: one client for OpenAI-compatible endpoints, its typed errors, and key/proxy helpers.

Used by the comparison reward's judge (``hermes_lab.judge``: ``reward.model`` at ``reward.base_url``), by a
remotely served policy (``model.base_url``) and by ``hermes-lab doctor``. Reads the environment only: the
base URL and the key live in environment variables (the config names the variable, ``api_key_env``; the key
is never in a config). Writes nothing under runs/ (the judge's cache is ``hermes_lab.judge``'s).

The user's connectivity check is ``curl -s $TAOTOKEN_BASE_URL/v1/models -H "Authorization: Bearer $KEY"``;
the client sends exactly that. Check a setup with

    hermes-lab doctor            # or: python -m hermes_lab.doctor

Errors are typed and say what to fix (docs/SPEC.md, "Errors the user hits with the model API"):
ApiAuthError (401/403), ApiBadBody ("Error reading choices": the body was not the expected JSON; shows
status, content-type and the first bytes), ApiConnectionError (.kind: refused, dns, timeout, proxy, tls,
network), ApiStatusError (other HTTP errors, or 429/5xx once retries are spent), ApiConfigError.
The key never reaches a log line, an exception, a repr or MLflow: messages pass through ``redact``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger("hermes_lab.api")

BASE_URL_ENV = "TAOTOKEN_BASE_URL"
API_KEY_ENV = "TAOTOKEN_API_KEY"
# Hosts SDKs fall back to when no base URL is set; another provider's key gets 401 there.
SDK_DEFAULT_HOSTS = {"api.openai.com"}
RETRY_STATUSES = {408, 429, 500, 502, 503, 504, 529}
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
BODY_HEAD = 300  # bytes of a bad body shown in errors


# ------------------------------------------------------------------------------------------------ errors
class ApiError(RuntimeError):
    """Base of the model-API errors. The message is redacted: it never holds the key."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        url: str | None = None,
        request_id: str | None = None,
        content_type: str | None = None,
        body_head: str | None = None,
    ):
        super().__init__(message)
        self.status, self.url, self.request_id = status, url, request_id
        self.content_type, self.body_head = content_type, body_head


class ApiConfigError(ApiError):
    """Base URL, key or model id missing or malformed."""


class ApiAuthError(ApiError):
    """401/403: the server refused the credentials."""


class ApiStatusError(ApiError):
    """Any other HTTP error status (and 429/5xx once the retries are spent)."""


class ApiBadBody(ApiError):
    """The body was not the expected JSON (an HTML page from a middlebox, an error page, truncated JSON)."""


class ApiConnectionError(ApiError):
    """No HTTP answer. ``kind``: refused, dns, timeout, proxy, tls or network; ``proxy_var`` names the
    proxy variable in use, if any."""

    def __init__(self, message: str, *, kind: str, proxy_var: str | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.kind, self.proxy_var = kind, proxy_var


class ApiSkipped(ApiError):
    """Not sent: an earlier request of the same batch failed in a way every request would (auth, network)."""


# ------------------------------------------------------------------------------------ secrets and URLs
class Secret:
    """Holds the key so that repr(), vars() and tracebacks show *** instead."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


# a token-looking word (8+ chars with a digit) after "Bearer": an unknown key, e.g. echoed by a server
_BEARER = re.compile(r"(Bearer\s+)(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,}", re.I)


def redact(text: str, *secrets: str) -> str:
    """Replace each secret (and anything sent as 'Bearer ...') by ***."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    return _BEARER.sub(r"\1***", text)


def safe_url(url: str) -> str:
    """The URL without user:password@ and without a query string, for messages."""
    try:
        p = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{p.port}" if _port_or_none(p) else "")
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


def show_proxy(value: str) -> str:
    """A proxy variable's value fit to print: no user:password@ (httpx reads 'host:port' as http://)."""
    return safe_url(value if "://" in value else f"http://{value}")


def _port_or_none(p: Any) -> int | None:
    try:
        return p.port
    except ValueError:
        return None


def normalize_base_url(url: str | None, source: str = "base URL") -> str:
    """The API root, without a trailing slash or /v1: requests go to ``root + /v1/<path>``.

    Accepts ``https://h``, ``https://h/``, ``https://h/v1``, ``https://h/v1/`` (and a pasted
    ``.../v1/chat/completions`` or ``.../v1/models``), because the user's curl is ``$BASE/v1/models``
    while many SDKs want the root with /v1."""
    if url is None or not str(url).strip():
        raise ApiConfigError(
            f"{source} is empty: base URL, key and model id must all be set "
            "(a request sent to an SDK's default base URL gets 401)."
        )
    u = str(url).strip()
    p = urlsplit(u)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise ApiConfigError(
            f"{source}={safe_url(u)!r} is not an http(s) URL: write the API root, "
            "e.g. https://api.example.com (the part before /v1/models)."
        )
    path = p.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        if path.endswith(suffix):
            path = path[: -len(suffix)].rstrip("/")
            break
    if path.endswith("/v1"):
        path = path[:-3]
    return urlunsplit((p.scheme, p.netloc, path.rstrip("/"), "", ""))


def environment_proxies(env: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """scheme ('http', 'https', 'all', 'no') -> (variable name, value), the way httpx reads them.

    httpx uses urllib's getproxies(): every *_proxy variable, the lowercase one winning, and an empty
    lowercase one switching the scheme off."""
    env = os.environ if env is None else env
    out: dict[str, tuple[str, str]] = {}
    for name, value in env.items():
        if value and name.lower().endswith("_proxy"):
            out[name.lower()[:-6]] = (name, value)
    for name, value in env.items():
        if name.endswith("_proxy"):
            if value:
                out[name[:-6]] = (name, value)
            else:
                out.pop(name[:-6], None)
    return out


def no_proxy_entry(host: str, env: Mapping[str, str] | None = None) -> str | None:
    """The NO_PROXY entry that makes httpx go direct to ``host``, or None (httpx's curl-like rules)."""
    proxies = environment_proxies(env)
    host = host.lower().strip("[]")
    for entry in proxies.get("no", ("", ""))[1].split(","):
        e = entry.strip().lower()
        if not e:
            continue
        if e == "*":
            return e
        if "://" in e:
            e = urlsplit(e).hostname or ""
        e = e.strip("[]")
        if e.startswith("."):
            if host.endswith(e):
                return entry.strip()
        elif host == e or host.endswith("." + e):
            return entry.strip()
    return None


def proxy_for(url: str, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable name, proxy URL) that httpx routes ``url`` through, or None for a direct connection."""
    p = urlsplit(url)
    if no_proxy_entry(p.hostname or "", env) is not None:
        return None
    proxies = environment_proxies(env)
    return proxies.get(p.scheme) or proxies.get("all")


def describe_key(key: str) -> tuple[str, str]:
    """Guess what a key is from its shape: ('api_key' | 'oauth' | 'bearer' | 'whitespace' | 'empty', why).

    An OAuth access token is not an API key and the two must not be mixed; the usual shapes are a JWT
    ('eyJ...' with three dot-separated parts), Google's 'ya29.' and GitHub's 'gho_'/'ghu_'. Never returns
    any part of the key."""
    k = key or ""
    if not k.strip():
        return "empty", "the key is empty"
    if k.strip().lower().startswith("bearer"):
        return "bearer", "the value starts with 'Bearer': store only the key; the client adds 'Bearer ' itself"
    if k != k.strip() or any(c.isspace() for c in k.strip()):
        return "whitespace", "the key holds spaces or a newline (pasted with the shell's quotes or a trailing newline?)"
    why = ""
    if k.startswith("ya29."):
        why = "a Google OAuth access token (ya29.)"
    elif k.lower().startswith("oauth"):
        why = "an OAuth token (oauth prefix)"
    elif k.startswith(("gho_", "ghu_")):
        why = "a GitHub OAuth token (gho_/ghu_)"
    elif k.startswith("eyJ") and k.count(".") == 2:
        why = "JWT-shaped: eyJ... in three dot-separated parts, the usual shape of an OAuth access token"
        claims = _jwt_claims(k)
        if "exp" in claims and isinstance(claims["exp"], (int, float)) and claims["exp"] < time.time():
            why += f", expired {time.strftime('%Y-%m-%d %H:%M', time.gmtime(claims['exp']))} UTC"
        if claims.get("iss"):
            why += f", issuer {str(claims['iss'])[:60]}"
    if why:
        return "oauth", (
            f"this looks like an OAuth access token, not an API key ({why}); the two must not "
            "be mixed: create an API key for this endpoint"
        )
    return "api_key", f"looks like an API key ({len(k)} characters)"


def _jwt_claims(token: str) -> dict[str, Any]:
    try:
        payload = token.split(".")[1]
        data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return data if isinstance(data, dict) else {}
    except (ValueError, IndexError):
        return {}


def key_fingerprint(key: str) -> str:
    """A short hash to tell two keys apart without showing either."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:8]


# ------------------------------------------------------------------------------------------------ client
class ApiClient:
    """An OpenAI-compatible endpoint: ``list_models()``, ``chat()``, ``chat_many()``.

    Retries 429/5xx/timeouts/connection errors with exponential backoff and jitter (honouring
    Retry-After); at most ``concurrency`` requests in flight across threads. DEBUG log (logger
    "hermes_lab.api"): request id, method, path, status and time of every attempt."""

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
        raw = os.environ.get(api_key_env, "").strip()
        if raw.lower().startswith("bearer "):  # a pasted header value: we add 'Bearer ' ourselves
            raw = raw[7:].strip()
        if not raw:
            raise ApiConfigError(
                f"{api_key_env} is not set: base URL, key and model id must all be set "
                f"(export {api_key_env}=<your API key>)."
            )
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
        **extra: Any,
    ) -> str:
        """One chat completion; returns choices[0].message.content. A string is one user message."""
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
        resp, rid = self._request("POST", "/chat/completions", payload, model=model)
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
        **kw: Any,
    ) -> list[Any]:
        """``chat`` over many conversations, ``concurrency`` at a time, results in input order.

        An auth, config or connection error (after retries) stops the batch: what has not started yet is
        not sent (ApiSkipped), since every request would fail the same way. With ``return_exceptions``
        the errors are returned in place of the replies, else the first one is raised."""
        n = len(batch)
        results: list[Any] = [None] * n
        stop = threading.Event()

        def one(i: int) -> str:
            if stop.is_set():
                raise ApiSkipped("not sent: an earlier request of this batch failed (see the first error)")
            try:
                return self.chat(batch[i], **kw)
            except (ApiAuthError, ApiConfigError, ApiConnectionError):
                stop.set()
                raise

        workers = max(1, min(concurrency or self.concurrency, n))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hermes-api") as pool:
            futures = {pool.submit(one, i): i for i in range(n)}
            done = as_completed(futures)
            if progress:
                from tqdm.auto import tqdm

                done = tqdm(done, total=n, desc="model API", unit="req")
            for f in done:
                try:
                    results[futures[f]] = f.result()
                except ApiError as e:
                    results[futures[f]] = e
        if not return_exceptions:
            errors = [r for r in results if isinstance(r, ApiError)]
            if errors:
                raise next((e for e in errors if not isinstance(e, ApiSkipped)), errors[0])
        return results

    # -------------------------------------------------------------------------------------- transport
    def _request(
        self, method: str, path: str, payload: Any = None, model: str | None = None
    ) -> tuple[httpx.Response, str]:
        url = f"{self.base_url}/v1{path}"
        attempts = self.retries + 1
        for attempt in range(1, attempts + 1):
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
                    time.sleep(delay)
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
                time.sleep(delay)
                continue
            if resp.status_code >= 300:
                raise self._status_error(resp, rid, method, attempt, model)
            return resp, rid
        raise AssertionError("unreachable")  # the loop returns or raises

    def _backoff(self, attempt: int) -> float:
        # equal jitter: half fixed, half random, so clients that failed together do not retry together
        d = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
        return d / 2 + self._rng.uniform(0, d / 2)

    def _retry_delay(self, resp: httpx.Response, attempt: int) -> float:
        value = resp.headers.get("retry-after", "").strip()
        wait: float | None = None
        if value:
            try:
                wait = float(value)
            except ValueError:
                try:
                    wait = parsedate_to_datetime(value).timestamp() - time.time()
                except (TypeError, ValueError, IndexError):
                    wait = None
        if wait is None:
            return self._backoff(attempt)
        # the server said when: wait that long (capped), plus a little jitter
        return min(max(wait, 0.0), self.retry_after_max_s) + self._rng.uniform(0, self.backoff_s / 10)

    def _connection_error(self, e: httpx.HTTPError, url: str, rid: str, attempt: int) -> ApiConnectionError:
        kind = _classify(e)
        p = urlsplit(url)
        where = f"{p.hostname}:{_port_or_none(p) or (443 if p.scheme == 'https' else 80)}"
        tries = f" (after {attempt} attempt{'s' if attempt > 1 else ''})"
        cause = self._redact(f"{type(e).__name__}: {e}")
        proxy_var = None
        if self.proxy and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError)):
            proxy_var, value = self.proxy
            phost = (urlsplit(value if "://" in value else f"http://{value}").hostname or "").lower()
            local = phost in ("localhost", "::1") or phost.startswith("127.")
            msg = (
                f"{'local proxy failed' if local else 'proxy failed'}: requests to {p.hostname} go through "
                f"{proxy_var}={show_proxy(value)} and it failed ({kind}: {cause}). "
                f"A stale proxy variable is the usual cause: unset {proxy_var} or fix the proxy, or add "
                f"{p.hostname} to NO_PROXY"
            )
            kind = "proxy"
        elif kind == "refused":
            msg = (
                f"connection refused by {where}: nothing listens there. Is the server up, and is the "
                f"host/port in {self.base_url_source} right?"
            )
        elif kind == "dns":
            msg = f"DNS lookup failed for host '{p.hostname}': check the spelling of {self.base_url_source}"
        elif kind == "timeout":
            phase = "connect" if isinstance(e, httpx.ConnectTimeout) else "read"
            msg = (
                f"timeout: no answer from {where} within {self.timeout:g} s ({phase} timeout): the server is "
                "overloaded or slow, or a firewall drops the packets; retry later or raise the timeout"
            )
        elif kind == "proxy":
            msg = f"proxy failed talking to {where}: {cause}"
        elif kind == "tls":
            msg = (
                f"TLS handshake with {where} failed ({cause}): a middlebox intercepting HTTPS? "
                "Set SSL_CERT_FILE to its CA bundle"
            )
        else:
            msg = f"network error talking to {where}: {cause}"
        return ApiConnectionError(
            self._redact(msg + tries), kind=kind, proxy_var=proxy_var, url=safe_url(url), request_id=rid
        )

    def _body_head(self, resp: httpx.Response) -> str:
        return self._redact(resp.content[:BODY_HEAD].decode("utf-8", errors="replace"))

    def _bad_body(self, what: str, resp: httpx.Response, rid: str, hint: str) -> ApiBadBody:
        ctype = resp.headers.get("content-type", "") or "none"
        head = self._body_head(resp)
        msg = (
            f"{what}: the body of {resp.request.method} {safe_url(str(resp.request.url))} is not the expected "
            f"JSON (HTTP {resp.status_code}, content-type {ctype}, {len(resp.content)} bytes; request {rid}). "
            f"{hint}. First bytes of the raw body: {head!r}"
        )
        return ApiBadBody(
            self._redact(msg),
            status=resp.status_code,
            url=safe_url(str(resp.request.url)),
            request_id=rid,
            content_type=ctype,
            body_head=head,
        )

    def _status_error(self, resp: httpx.Response, rid: str, method: str, attempt: int, model: str | None) -> ApiError:
        status, url = resp.status_code, safe_url(str(resp.request.url))
        ctype = resp.headers.get("content-type", "") or "none"
        head = self._body_head(resp)
        said = _server_message(resp)
        said = f" Server said: {said!r}." if said else f" Body ({ctype}): {head!r}."
        lead = f"{status} {resp.reason_phrase} from {method} {url} (request {rid})."
        kw = dict(status=status, url=url, request_id=rid, content_type=ctype, body_head=head)
        host = (urlsplit(self.base_url).hostname or "").lower()
        if status in (401, 403):
            kind, why = describe_key(self._key.reveal())
            msg = (
                f"{lead} The server refused the key. Usual causes: base URL, key and model id must all be "
                f"set ({self.base_url_source} -> {safe_url(self.base_url)}, {self.api_key_env}"
                + (f", model {model or self.model!r}" if model or self.model else "")
                + f"); the key is sent in an 'Authorization: Bearer' header, so store only the bare key "
                f"in {self.api_key_env}; a request that went to a default base URL gets 401; the key "
                "is expired, revoked or belongs to another provider."
                + (" 403 can also mean the key may not use this model." if status == 403 else "")
            )
            if kind == "oauth":
                msg += f" {self.api_key_env}: {why}."
            if host in SDK_DEFAULT_HOSTS:
                msg += f" The base URL is {host}, the OpenAI SDK default: is {BASE_URL_ENV} set?"
            return ApiAuthError(self._redact(msg + said), **kw)
        hint = ""
        if status == 404:
            hint = (
                f" Is the model id {model!r} served here (hermes-lab doctor lists them)?"
                if model
                else f" Is {self.base_url_source} the API root (the part before /v1/models)?"
            )
        elif status in RETRY_STATUSES:
            hint = f" Gave up after {attempt} attempts (rate limit or server trouble): retry later."
        return ApiStatusError(self._redact(lead + hint + said), **kw)


def _classify(e: BaseException) -> str:
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.ProxyError):
        return "proxy"
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, socket.gaierror):
            return "dns"
        if isinstance(seen, ConnectionRefusedError):
            return "refused"
        if isinstance(seen, ssl.SSLError):
            return "tls"
        if isinstance(seen, (socket.timeout, TimeoutError)):
            return "timeout"
        seen = seen.__cause__ or seen.__context__
    text = str(e).lower()
    if any(
        s in text
        for s in (
            "name or service not known",
            "nodename nor servname",
            "getaddrinfo",
            "name resolution",
            "no address associated",
        )
    ):
        return "dns"
    if "connection refused" in text:
        return "refused"
    if "certificate" in text or "ssl" in text:
        return "tls"
    return "network"


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return json.loads(resp.content)
    except ValueError:
        return None


def _server_message(resp: httpx.Response) -> str:
    """The error message of an OpenAI-style error body ({"error": {"message": ...}}), or ''."""
    body = _json_or_none(resp)
    if not isinstance(body, dict):
        return ""
    err = body.get("error", body)
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail") or err.get("code") or ""
    return str(err or body.get("detail") or body.get("message") or "")[:300]
