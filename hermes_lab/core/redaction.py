"""Secrets out of every message, log line, printed value and MLflow param: by value, not by name.

Reads the environment only; writes nothing. Used by ``hermes_lab.llm.client`` (client errors), ``hermes_lab.cli.doctor``
(its table), ``hermes_lab.core.tracking`` (MLflow params and tags) and the stages' printed output.

What counts as a secret (``secret_values``):
- the value of every environment variable whose NAME says secret: a ``_``-separated part is KEY, TOKEN,
  SECRET, PASSWORD, CRED(ENTIALS), AUTH, ... (``TAOTOKEN_API_KEY``, ``HF_TOKEN``, ``MY_CRED``), unless the
  last part says it holds something else (``..._URL``, ``..._FILE``, ``..._ENV``: ``TAOTOKEN_BASE_URL``
  is not a secret, only its ``user:password@`` part is);
- the value of every environment variable that LOOKS like a key, whatever its name (``sk-``, ``ghp_``,
  ``xox?-``, ``hf_``, ``AKIA`` prefixes, a JWT, or a long random-looking token: ``looks_like_key``);
- the value of the variables a config names in ``api_key_env`` (every loaded config registers them,
  ``register_secret_env``; ``tracking.safe_params`` also reads them from the params it is given) and every
  key an ``ApiClient`` has loaded (``register_secret``).

``redact(text)`` replaces each of them by ``***``, and also ``user:password@`` in URLs, anything sent as
``Bearer ...`` and key-looking tokens. ``key_problem(value)`` says what is wrong with a pasted key (a line
break, a space, a non-ASCII character, quotes) without showing any part of it.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections import Counter
from collections.abc import Iterable

MASK = "***"
SECRET_WORDS = frozenset(
    {"KEY", "APIKEY", "KEYS", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS", "PASSPHRASE"}
    | {"CRED", "CREDS", "CREDENTIAL", "CREDENTIALS", "AUTH", "BEARER", "PAT", "PRIVATE", "SIGNATURE"}
)
# a last part naming what the variable holds when it is not the secret itself (TAOTOKEN_BASE_URL, KEY_FILE)
NOT_SECRET_LAST = frozenset(
    {"URL", "URI", "HOST", "PORT", "FILE", "PATH", "DIR", "SOCK", "ENV", "NAME", "MODEL", "ID", "TYPE", "MODE"}
    | {"REGION", "USER"}
)
KEY_PREFIXES = (
    "sk-",
    "sk_",
    "rk_",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
    "github_pat_",
    "glpat-",
    "xoxa-",
    "xoxb-",
    "xoxp-",
    "xoxr-",
    "xoxs-",
    "hf_",
    "AKIA",
    "ASIA",
    "AIza",
    "ya29.",
)
MIN_ENV_SECRET = 8  # shorter values of secret-named variables ("1", "true") would mask half of every message
_TOKEN = re.compile(r"[A-Za-z0-9_\-.~+=]{16,}")
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")
_SEGMENTS = re.compile(r"[-_.~+=]")
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/@?#]+@")
# a token-looking word (8+ chars with a digit) after "Bearer": an unknown key, e.g. echoed by a server
_BEARER = re.compile(r"(Bearer\s+)(?=[A-Za-z0-9._~+/=-]*\d)[A-Za-z0-9._~+/=-]{8,}", re.I)

_registered: set[str] = set()
_registered_env: set[str] = set()
_lock = threading.Lock()


def secret_env_name(name: str) -> bool:
    """True when a variable's NAME says it holds a secret (see the module docstring)."""
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", name.upper()) if p]
    if not parts or parts[-1] in NOT_SECRET_LAST:
        return False
    return any(p in SECRET_WORDS for p in parts)


def _entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def looks_like_key(value: str) -> bool:
    """True for a value shaped like a credential: a known key prefix, a JWT, or a long random token.

    Random token: one segment (between - _ . ~ + =) of 20+ characters mixing upper case, lower case and
    digits with high character entropy, or one of 41+ letters and digits (a long hex secret). Model ids
    (``Qwen2.5-0.5B-Instruct``), paths, UUIDs and 32-hex run ids do not match."""
    v = value.strip()
    if len(v) < 16 or len(v) > 8192 or not _TOKEN.fullmatch(v):
        return _JWT.fullmatch(v) is not None
    if v.startswith(KEY_PREFIXES) and len(v) >= 20:
        return True
    if _JWT.fullmatch(v):
        return True
    for seg in _SEGMENTS.split(v):
        if len(seg) >= 20 and not seg.isalpha() and not seg.isdigit():
            mixed = any(c.isupper() for c in seg) and any(c.islower() for c in seg) and any(c.isdigit() for c in seg)
            if mixed and _entropy(seg) >= 3.5:
                return True
        if len(seg) >= 41 and seg.isalnum() and not seg.isalpha() and not seg.isdigit():
            return True
    return False


def register_secret_env(*names: str | None) -> None:
    """Remember variables that hold keys (a config's ``api_key_env``): their values are secrets from then on."""
    with _lock:
        _registered_env.update(n for n in names if n)


def register_secret(value: str | None) -> None:
    """Remember a secret this process uses (an API client's key): redacted from then on, whatever its source."""
    if value and len(value) >= 4:
        with _lock:
            _registered.add(value)


def secret_values(extra_env_names: Iterable[str] = ()) -> set[str]:
    """Every secret value known now (see the module docstring). Never logged, never printed."""
    out: set[str] = set()
    env = os.environ
    for name, value in env.items():
        v = value.strip()
        if len(v) >= MIN_ENV_SECRET and (secret_env_name(name) or looks_like_key(v)):
            out.add(v)
            out.add(value)
    with _lock:
        named = set(_registered_env)
    for name in named | set(map(str, extra_env_names)):
        v = env.get(name, "")
        if len(v.strip()) >= 4:
            out.update({v, v.strip()})
    with _lock:
        out.update(_registered)
    return {s for s in out if s}


def strip_url_credentials(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://***@host`` anywhere in ``text``."""
    return _URL_CREDENTIALS.sub(rf"\1{MASK}@", text)


def mask_keylike(text: str) -> str:
    """Replace every key-looking token in free text by ***."""

    def sub(m: re.Match[str]) -> str:
        return MASK if looks_like_key(m.group(0)) else m.group(0)

    text = _JWT.sub(MASK, text)
    return _TOKEN.sub(sub, text)


def redact(text: str, *secrets: str | None, env: bool = True) -> str:
    """``text`` with every secret replaced by ***: the given ones, the environment's (``env=True``), URL
    credentials, 'Bearer <token>' and key-looking tokens."""
    known = {s for s in secrets if s and len(s) >= 4}
    if env:
        known |= secret_values()
    for s in sorted(known, key=len, reverse=True):  # longest first: a key that contains another
        if s in text:
            text = text.replace(s, MASK)
    text = strip_url_credentials(text)
    text = _BEARER.sub(rf"\1{MASK}", text)
    return mask_keylike(text)


def key_problem(value: str) -> str | None:
    """What is wrong with an API key's value (already stripped of surrounding whitespace), or None.

    The answer never holds any part of the key, nor a position in it."""
    if not value:
        return "is empty"
    if any(c in value for c in "\r\n\u2028\u2029\x85"):
        return "contains a line break (pasted with a second line? export only the key)"
    if any(c.isspace() for c in value):
        return "contains a space or tab (two words pasted, or the shell's quotes inside the value?)"
    if any("\ud800" <= c <= "\udfff" for c in value):
        return "contains bytes that are not valid UTF-8 (a binary or mis-encoded paste)"
    if not value.isascii():
        return (
            "contains a non-ASCII character (a typographic quote or dash, or an invisible character, "
            "from a pasted document?); API keys are plain ASCII"
        )
    if not value.isprintable():
        return "contains a control character (an escape sequence pasted from a terminal?)"
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"`":
        return "is wrapped in quotes: store the key without them"
    return None
