"""The model API's errors, secrets, URLs, proxies and keys: everything ``hermes_lab.llm.client`` needs before HTTP.

Reads the environment only (the base URL, proxy variables, the key's variable); writes nothing. Re-exported by
``hermes_lab.llm.client``, which is the interface the stages and ``hermes-lab doctor`` use: import from there.
A key is checked when it is loaded (``load_key``): surrounding whitespace and a pasted 'Bearer ' are dropped,
and a line break, a space, a non-ASCII or control character inside is an ApiConfigError that names the
variable and shows no part of the key. ``redact`` is ``hermes_lab.core.redaction.redact`` (URL credentials too).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hermes_lab.core import redaction
from hermes_lab.core.redaction import key_problem

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


class ApiCancelled(ApiError):
    """Not sent, or not retried: the batch was cancelled (KeyboardInterrupt, or its deadline passed)."""


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


def redact(text: str, *secrets: str) -> str:
    """Replace each secret, the environment's secrets, URL credentials and 'Bearer ...' by *** (one
    function for every message: ``hermes_lab.core.redaction.redact``)."""
    return redaction.redact(text, *secrets)


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
    """Guess what a key is from its shape: ('api_key' | 'oauth' | 'bearer' | 'malformed' | 'empty', why).

    An OAuth access token is not an API key and the two must not be mixed; the usual shapes are a JWT
    ('eyJ...' with three dot-separated parts), Google's 'ya29.' and GitHub's 'gho_'/'ghu_'. Never returns
    any part of the key."""
    k = key or ""
    if not k.strip():
        return "empty", "the key is empty"
    if k.strip().lower().startswith("bearer"):
        return "bearer", "the value starts with 'Bearer': store only the key; the client adds 'Bearer ' itself"
    problem = key_problem(k.strip())
    if problem:
        return "malformed", f"the key {problem}"
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
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def load_key(api_key_env: str, env: Mapping[str, str] | None = None) -> str:
    """The key in ``api_key_env``, checked before any request: surrounding whitespace and a pasted 'Bearer '
    are dropped; a key that is unset, or holds a line break, a space, a non-ASCII or control character
    (httpx would quote it into its error, or crash on it) is an ApiConfigError that names the variable
    and the problem and shows no part of the key."""
    raw = (os.environ if env is None else env).get(api_key_env, "").strip()
    if raw.lower().startswith("bearer "):  # a pasted header value: we add 'Bearer ' ourselves
        raw = raw[7:].strip()
    if not raw:
        raise ApiConfigError(
            f"{api_key_env} is not set: base URL, key and model id must all be set "
            f"(export {api_key_env}=<your API key>)."
        )
    problem = key_problem(raw)
    if problem:
        raise ApiConfigError(f"{api_key_env} {problem}. Fix the variable; the key is not shown.")
    redaction.register_secret(raw)
    return raw
