"""What went wrong with a model API request, in words that say what to fix: the typed errors' messages.

Part of ``hermes_lab.llm.client``: ``ApiClient`` inherits ``Diagnosis``, whose methods turn a failed request
(no HTTP answer, an error status, a body that is not the expected JSON) into the typed error
(``hermes_lab.llm.base``) with the usual causes named (docs/SPEC.md, "Errors the user hits with the model
API"), the key redacted and the URL without credentials. Split out of api.py, which keeps the transport.
Reads and writes nothing.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

import httpx

from hermes_lab.llm.base import (
    BASE_URL_ENV,
    BODY_HEAD,
    RETRY_STATUSES,
    SDK_DEFAULT_HOSTS,
    ApiAuthError,
    ApiBadBody,
    ApiConnectionError,
    ApiError,
    ApiStatusError,
    _port_or_none,
    describe_key,
    safe_url,
    show_proxy,
)


class Diagnosis:
    """The error-building half of ``ApiClient`` (a mixin: it reads the client's base_url, base_url_source,
    api_key_env, model, timeout, proxy and key through ``self``)."""

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
