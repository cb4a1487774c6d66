"""`hermes-lab doctor`: check the model API setup (base URL, key, model ids, proxies) before a round needs it.

Reads environment variables (their names are options: TAOTOKEN_BASE_URL, TAOTOKEN_API_KEY,
HERMES_REWARD_MODEL, HERMES_POLICY_MODEL by default) and, with --params, a config YAML whose model.base_url /
reward.base_url and model ids are then checked instead. Sends GET {base}/v1/models with
"Authorization: Bearer <key>", exactly the user's curl (and, with --chat, a one-word chat per model).
With --params naming a config whose reward.types has ``tests``, also checks the sandbox (``sandbox.*``): what
isolates a run on this machine, or that the SandboxFusion service runs a program. Writes nothing. Prints one
table row per check (PASS / WARN / FAIL / SKIP with a one-line explanation)
and exits 1 when any check fails. The key is never printed (only a short fingerprint). ``--rewards`` runs the
reward audit instead (``hermes_lab.rewards.audit``): one row per reward, FAIL naming any adversarial completion
it paid.

    hermes-lab doctor
    hermes-lab doctor --params params/hermes_grpo_lora.yaml --debug
    hermes-lab doctor --rewards --params params/embedded.yaml
    python -m hermes_lab.cli.doctor --model-env HERMES_REWARD_MODEL --timeout 5
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hermes_lab.llm import client as api

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
DEFAULT_MODEL_ENVS = ("HERMES_REWARD_MODEL", "HERMES_POLICY_MODEL")
PROXY_PORTS = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}
STYLES = {PASS: "bold green", WARN: "bold yellow", FAIL: "bold red", SKIP: "dim"}


@dataclass
class Check:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    detail: str


@dataclass
class Target:
    """One endpoint to check: its base URL, the variable holding its key, the model ids expected there."""

    label: str  # where the base URL comes from: "$TAOTOKEN_BASE_URL" or "reward.base_url"
    base_url: str | None
    key_env: str
    models: list[tuple[str, str]] = field(default_factory=list)  # (where the id comes from, id)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url-env", default=api.BASE_URL_ENV, help="Variable holding the API root (default %(default)s)."
    )
    parser.add_argument(
        "--key-env",
        default=api.API_KEY_ENV,
        help="Variable holding the API key (default %(default)s). The key is never printed.",
    )
    parser.add_argument(
        "--model-env",
        action="append",
        default=None,
        metavar="VAR",
        help="Variable holding a model id to look for; repeatable (default: "
        f"{' and '.join(DEFAULT_MODEL_ENVS)}; with --params: none besides the config's).",
    )
    parser.add_argument(
        "--params", default=None, help="Config YAML: check its model.base_url / reward.base_url and model ids instead."
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="Seconds per request (default %(default)s).")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="Also send a one-word chat to each model (checks it answers, not just that it is listed).",
    )
    parser.add_argument("--debug", action="store_true", help="Log each request's id, status and timing to stderr.")
    parser.add_argument(
        "--rewards",
        action="store_true",
        help="Instead: the reward audit (hermes_lab.rewards.audit): each reward of --params (default: built-in "
        "defaults) scores built-in adversarial completions; one paid above reward.audit_threshold fails.",
    )


# ------------------------------------------------------------------------------------------- targets
def _config_targets(params: str, checks: list[Check]) -> list[Target]:
    from hermes_lab.config.schema import ConfigError, load_config

    try:
        cfg = load_config(params)
    except ConfigError as e:
        checks.append(Check("config", FAIL, str(e)))
        return []
    found: dict[tuple[str, str], Target] = {}

    def add(label: str, base: str, key_env: str, where: str, model: str | None) -> None:
        t = found.setdefault((base, key_env), Target(label, base, key_env))
        if label not in t.label:
            t.label += f", {label}"
        if model:
            t.models.append((where, model))

    if "tests" in cfg.reward.types:
        checks.extend(_sandbox_checks(cfg))
    checks.append(_format_check(cfg))
    m, r = cfg.model, cfg.reward
    if m.base_url:
        add(
            "model.base_url",
            m.base_url,
            m.api_key_env,
            "model.base_model",
            None if m.base_model.startswith("embedded:") else m.base_model,
        )
    if r.model and r.model.strip().lower() != "local":
        if r.base_url:
            add("reward.base_url", r.base_url, r.api_key_env, "reward.model", r.model)
        else:
            checks.append(
                Check(
                    "config",
                    FAIL,
                    f"{params}: reward.model is '{r.model}' but reward.base_url is empty: "
                    "base URL, key and model id must all be set (a request sent to a default base "
                    "URL gets 401)",
                )
            )
    if found:
        what = "; ".join(
            f"{t.label} with {', '.join(f'{w}={i}' for w, i in t.models) or 'no model id'}" for t in found.values()
        )
        checks.append(Check("config", PASS, f"{params}: {what}"))
    elif not any(c.status == FAIL for c in checks):
        checks.append(
            Check(
                "config",
                WARN,
                f"{params}: no remote endpoint (model.base_url and reward.base_url are "
                "empty); checking the environment variables instead",
            )
        )
    return list(found.values())


def _format_check(cfg: object) -> Check:
    """The policy's chat format (``hermes_lab.policy.formats``): its template, the reader its tool calls are read
    with, whether the template renders tools, is prefix-preserving and re-renders a tool-result turn as TRL
    trains it. FAIL: no template, a format no reader knows, or a reader that cannot read the template's calls."""
    from hermes_lab.policy import formats

    m = cfg.model  # type: ignore[attr-defined]
    try:
        tok = formats.model_tokenizer(cfg, local_only=True)
    except Exception as e:  # not on this machine (doctor downloads nothing): said, and checked at round start
        why = str(e).splitlines()[0][:160]
        return Check(
            "chat format",
            WARN,
            f"{m.base_model}: no tokenizer on this machine to check ({type(e).__name__}: {why}); the round checks "
            "it at its start",
        )
    if tok is None:
        return Check("chat format", PASS, f"{m.base_model}: the tiny policy's own template and reader (policy.chat)")
    d = formats.describe(tok, m.tool_parser)
    facts = (
        f"template {d['template']}, reader {d['reader'] or 'none'}, "
        f"{'renders' if d['renders_tools'] else 'does not render'} tools, "
        f"{'' if d['prefix_preserving'] else 'not '}prefix-preserving"
        + (f" (rendered with {d['render']})" if d["render"] != "own" else "")
        + f", a tool-result turn re-renders {'to' if d['rerender_stable'] else 'NOT to'} the trained tokens"
    )
    if d["error"]:
        return Check("chat format", FAIL, f"{m.base_model}: {d['error']} [{facts}]")
    if not d["renders_tools"] or not d["multi_turn"]:
        return Check("chat format", WARN, f"{m.base_model}: {facts}: tool-calling episodes cannot be trained")
    return Check("chat format", PASS, f"{m.base_model}: {facts}")


def _sandbox_checks(cfg: object) -> list[Check]:
    """The tests reward's sandbox: the local one layer by layer (a probe run reports what holds from inside),
    or one run through the service (fusion). A missing layer FAILs under sandbox.require_isolation, else WARNs."""
    from hermes_lab.rewards.tests import executor_of
    from hermes_lab.sandbox.executor import Limits, RunRequest
    from hermes_lab.sandbox.local import LocalExecutor

    s = cfg.sandbox  # type: ignore[attr-defined]
    try:
        ex = executor_of(cfg) if s.executor == "fusion" else LocalExecutor(workers=1, python=s.python or None)  # type: ignore[arg-type]
    except ValueError as e:
        return [Check("sandbox", FAIL, str(e))]
    try:
        rep = ex.describe()
        if rep["executor"] == "fusion":
            r = ex.run_one(RunRequest("print(6 * 7)"), Limits(timeout_s=10))
            if r.status != "ok" or r.stdout.strip() != "42":
                return [Check("sandbox", FAIL, f"{rep['url']}/run_code: {r.status} {r.detail}".strip())]
            return [Check("sandbox", PASS, f"{rep['url']}/run_code ran a program ({rep['network']})")]
        if "error" in rep:
            return [Check("sandbox", FAIL, rep["error"])]
        gaps = rep.get("missing") or []
        bad = FAIL if s.require_isolation else WARN
        head = f"local, {rep['mode']}: python {rep['python']} ({rep['python_version']}), runs as {rep.get('user')}"
        if gaps:
            head += f"; NOT enforced: {'; '.join(gaps)}" + (
                " (sandbox.require_isolation: training with the tests reward refuses)" if s.require_isolation else ""
            )
        hidden = ", ".join(f"{p} {v}" for p, v in (rep.get("host_paths") or {}).items())
        out = [Check("sandbox", bad if gaps else PASS, head)]
        for layer in ("namespaces", "filesystem", "seccomp", "cgroup", "network", "processes"):
            weak = str(rep.get(layer, "")).startswith(("none", "NOT"))
            # no namespaces is no gap by itself where Landlock stands in (the fallback): a warning
            status = PASS if not weak else (WARN if layer == "namespaces" else bad)
            detail = str(rep.get(layer))
            if layer == "filesystem" and hidden:
                detail += f"; seen from a run: {hidden}"
            out.append(Check(f"sandbox {layer}", status, detail))
        return out
    finally:
        ex.close()


def _variables_check(names: list[str], base_url_env: str) -> Check:
    missing = [n for n in dict.fromkeys(names) if not os.environ.get(n, "").strip()]
    if not missing:
        return Check("variables", PASS, f"set: {', '.join(dict.fromkeys(names))}")
    hint = (
        f"; without {base_url_env} a client falls back to its default base URL, which answers 401"
        if base_url_env in missing
        else ""
    )
    return Check(
        "variables",
        FAIL,
        f"not set: {', '.join(missing)}. Base URL, key and model id must all be set{hint}: export {missing[0]}=...",
    )


# ------------------------------------------------------------------------------------------- proxies
def _probe(host: str, port: int, timeout: float) -> str | None:
    """None when something accepts a TCP connection at host:port, else what went wrong."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror:
        return f"host '{host}' does not resolve (DNS)"
    except ConnectionRefusedError:
        return f"nothing listens on {host}:{port} (connection refused)"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as e:
        return f"cannot reach {host}:{port} ({e.strerror or e})"


def _why_unused(name: str, root: str) -> str:
    host, scheme = urlsplit(root).hostname or "", urlsplit(root).scheme
    entry = api.no_proxy_entry(host)
    if entry is not None:
        return f"NO_PROXY entry '{entry}' covers {host}"
    var_scheme = name.lower()[: -len("_proxy")]
    if var_scheme not in (scheme, "all"):
        return f"{name} is for {var_scheme}:// URLs and the API is {scheme}://"
    chosen = api.proxy_for(root)
    return f"{chosen[0]} takes precedence" if chosen else "not selected"


def _proxy_checks(roots: list[str], timeout: float) -> list[Check]:
    set_vars = [(n, os.environ[n]) for n in api.PROXY_VARS if os.environ.get(n, "").strip()]
    if not set_vars:
        return [Check("proxy", PASS, "no HTTP_PROXY / HTTPS_PROXY / ALL_PROXY set: direct connection")]
    out = []
    for name, value in set_vars:
        url = value.strip() if "://" in value else f"http://{value.strip()}"
        p = urlsplit(url)
        shown = f"{name}={api.safe_url(url)}"
        users = [r for r in roots if (api.proxy_for(r) or ("",))[0] == name]
        why_not = "; ".join(dict.fromkeys(_why_unused(name, r) for r in roots)) or "no valid base URL to check"
        host = (p.hostname or "").lower()
        local = host in ("localhost", "::1") or host.startswith("127.")
        try:
            port = p.port or PROXY_PORTS.get(p.scheme, 80)
            problem = _probe(host, port, min(timeout, 3.0)) if host else "no host in the value"
        except ValueError:
            problem = "the port is not a number"
        if problem is None and p.scheme.startswith("socks"):
            try:
                import socksio  # noqa: F401  (httpx needs it for socks proxies)
            except ImportError:
                problem = "a socks proxy needs the socksio package (httpx[socks]), which is not installed"
        if problem:
            label = "local proxy failed" if local else "proxy unreachable"
            if users:
                hosts = ", ".join(sorted({urlsplit(r).hostname or "" for r in users}))
                out.append(
                    Check(
                        f"proxy {name}",
                        FAIL,
                        f"{label}: {shown}: {problem}; requests to {hosts} go "
                        f"through it. Unset it (`unset {name}`) or fix the proxy, or add the host to NO_PROXY",
                    )
                )
            else:
                out.append(
                    Check(
                        f"proxy {name}",
                        WARN,
                        f"stale proxy variable: {shown}: {problem}. Not used for "
                        f"the API ({why_not}), but other tools fail through it: `unset {name}`",
                    )
                )
        elif users:
            out.append(Check(f"proxy {name}", PASS, f"{shown} answers; requests to the API go through it"))
        else:
            out.append(Check(f"proxy {name}", PASS, f"{shown} answers; not used for the API ({why_not})"))
    return out


# ----------------------------------------------------------------------------------------- endpoints
def _base_check(t: Target, name: str) -> tuple[Check, str | None]:
    try:
        root = api.normalize_base_url(t.base_url, t.label)
    except api.ApiConfigError as e:
        return Check(name, FAIL, str(e)), None
    p = urlsplit(root)
    host = (p.hostname or "").lower()
    raw = (t.base_url or "").strip().rstrip("/")
    root_shown = api.safe_url(root)  # no user:password@ in the table
    note = "" if raw in (root, root + "/v1") else f" ('{api.safe_url(raw)}' holds an endpoint path; using the root)"
    if host in api.SDK_DEFAULT_HOSTS:
        return Check(
            name,
            WARN,
            f"{root_shown} is the OpenAI SDK default base URL: a key from another provider gets "
            f"401 there; is {t.label} meant to point at it?{note}",
        ), root
    if p.scheme == "http" and not (host in ("localhost", "::1") or host.startswith("127.")):
        return Check(name, WARN, f"{root_shown} is plain http: the key travels unencrypted{note}"), root
    return Check(name, PASS, f"{root_shown} (requests go to {root_shown}/v1/...){note}"), root


def _key_error(key_env: str) -> str | None:
    """What the API client would refuse in this key (the same check, the same words), or None."""
    try:
        api.load_key(key_env)
    except api.ApiConfigError as e:
        return str(e)
    return None


def _key_check(t: Target, name: str) -> Check:
    value = os.environ.get(t.key_env, "")
    if not value.strip():
        return Check(name, SKIP, f"{t.key_env} is not set (see variables)")
    problem = _key_error(t.key_env)
    if problem:  # refused before any request, and no part of the key is shown
        return Check(name, FAIL, problem)
    kind, why = api.describe_key(value)
    if kind == "api_key":
        return Check(name, PASS, f"{t.key_env}: {why}, fingerprint {api.key_fingerprint(value.strip())}")
    return Check(name, WARN, f"{t.key_env}: {why}")


def _endpoint_checks(t: Target, prefix: str, timeout: float, chat: bool) -> list[Check]:
    out: list[Check] = []
    base, root = _base_check(t, prefix + "base URL")
    out.append(base)
    out.append(_key_check(t, prefix + "key"))
    name = prefix + "GET /v1/models"
    ids: list[str] | None = None
    client = None
    if root is None or not os.environ.get(t.key_env, "").strip() or _key_error(t.key_env):
        out.append(Check(name, SKIP, "not sent: needs a valid base URL and a well-formed key"))
    else:
        try:
            # no retries: the doctor reports what a single request meets, fast
            client = api.ApiClient(root, t.key_env, timeout=timeout, retries=0, base_url_source=t.label)
            t0 = time.perf_counter()
            ids = client.list_models()
            ms = (time.perf_counter() - t0) * 1000
            listed = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            out.append(
                Check(
                    name, PASS, f"200 from {api.safe_url(root)}/v1/models in {ms:.0f} ms: {len(ids)} models ({listed})"
                )
            )
        except api.ApiError as e:
            out.append(Check(name, FAIL, str(e)))
    for where, mid in t.models:
        mname = f"{prefix}model {where}"
        if ids is None:
            out.append(Check(mname, SKIP, f"'{mid}' not checked: GET /v1/models failed"))
        elif mid in ids:
            out.append(Check(mname, PASS, f"'{mid}' is served"))
        elif not ids:
            out.append(Check(mname, WARN, f"'{mid}': the server lists no models, cannot confirm"))
        else:
            close = [i for i in ids if i.lower() == mid.lower()] or difflib.get_close_matches(mid, ids, n=3, cutoff=0.5)
            seen = (
                f"close matches: {', '.join(close)}"
                if close
                else f"served: {', '.join(ids[:8])}{', ...' if len(ids) > 8 else ''}"
            )
            out.append(
                Check(
                    mname,
                    FAIL,
                    f"wrong model id: {where}='{mid}' is not among the {len(ids)} models "
                    f"served at {api.safe_url(root)}; {seen}. A wrong model id makes chat answer an error page "
                    "('Error reading choices')",
                )
            )
    if chat and client is not None and ids:
        for where, mid in t.models:
            if mid not in ids:
                continue
            try:
                t0 = time.perf_counter()
                reply = client.chat("Reply with the single word OK.", model=mid, max_tokens=8)
                ms = (time.perf_counter() - t0) * 1000
                out.append(Check(f"{prefix}chat {where}", PASS, f"'{mid}' replied {reply[:40]!r} in {ms:.0f} ms"))
            except api.ApiError as e:
                out.append(Check(f"{prefix}chat {where}", FAIL, str(e)))
    if client is not None:
        client.close()
    return out


def run_checks(
    base_url_env: str = api.BASE_URL_ENV,
    key_env: str = api.API_KEY_ENV,
    model_envs: list[str] | None = None,
    params: str | None = None,
    timeout: float = 10.0,
    chat: bool = False,
) -> list[Check]:
    """Every check, in order; details are redacted (no key value anywhere)."""
    checks: list[Check] = []
    targets = _config_targets(params, checks) if params else []
    names: list[str] = []
    if targets:
        names = [t.key_env for t in targets] + list(model_envs or [])
        for env_name in model_envs or []:  # explicit --model-env next to --params: look for it at the first endpoint
            if os.environ.get(env_name, "").strip():
                targets[0].models.append((env_name, os.environ[env_name].strip()))
    else:
        model_envs = list(model_envs) if model_envs else list(DEFAULT_MODEL_ENVS)
        names = [base_url_env, key_env, *model_envs]
        t = Target(f"${base_url_env}", os.environ.get(base_url_env, "").strip() or None, key_env)
        t.models = [(n, os.environ[n].strip()) for n in model_envs if os.environ.get(n, "").strip()]
        targets = [t]
    checks.insert(0, _variables_check(names, base_url_env))
    roots = []
    for t in targets:
        with contextlib.suppress(api.ApiConfigError):
            roots.append(api.normalize_base_url(t.base_url))
    checks += _proxy_checks(roots, timeout)
    for t in targets:
        prefix = f"[{t.label}] " if len(targets) > 1 else ""
        try:
            checks += _endpoint_checks(t, prefix, timeout, chat)
        except Exception as e:  # the doctor reports, it never crashes: a bug here is one more FAIL row
            checks.append(
                Check(f"{prefix}doctor", FAIL, f"internal error while checking {t.label}: {type(e).__name__}: {e}")
            )
    keys = [os.environ.get(n, "").strip() for n in {key_env, *(t.key_env for t in targets)}]
    for c in checks:
        c.detail = api.redact(_printable(c.detail), *keys)
    return checks


def _printable(text: str) -> str:
    """Text any terminal can print: undecodable bytes (surrogate escapes from the environment) shown as \\x.."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def render(checks: list[Check], file=None, title: str = "hermes-lab doctor: model API") -> None:
    """The table of checks and a one-line verdict."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    out = file or sys.stdout
    # off a terminal (CI logs, pytest, pipes) keep each explanation on one line so it can be grepped
    console = Console(file=out, width=None if out.isatty() else 1000, highlight=False)
    table = Table(title=title, title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("explanation", overflow="fold")
    for c in checks:
        # Text(), not markup: details hold brackets ("[Errno 111]") that rich would read as styles
        table.add_row(Text(c.name), Text(c.status, style=STYLES[c.status]), Text(c.detail))
    console.print(table)
    failed = [c.name for c in checks if c.status == FAIL]
    warned = sum(c.status == WARN for c in checks)
    if failed:
        console.print(Text(f"doctor: {len(failed)} check(s) failed: {', '.join(failed)}", style="bold red"))
    else:
        console.print(
            Text(f"doctor: all checks passed{f' ({warned} warning(s))' if warned else ''}", style="bold green")
        )


def reward_checks(params: str | None) -> list[Check]:
    """One row per reward of the config: what the reward audit found (``hermes-lab doctor --rewards``)."""
    from hermes_lab.config.schema import load_config
    from hermes_lab.rewards.audit import audit_rewards

    result = audit_rewards(load_config(params))
    checks, scale = [], result.scale
    for name in dict.fromkeys(r["reward"] for r in result.rows):
        paid = [r["paid"] or 0.0 for r in result.rows if r["reward"] == name]
        bad = [f for f in result.findings if f.reward == name]
        if bad:
            more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
            detail = "; ".join(f.line(scale) for f in bad[:3]) + more
            checks.append(Check(f"reward {name}", FAIL if result.mode == "block" else WARN, detail))
        else:
            most = f"paid at most {max(paid):g}/{scale:g} (limit {result.threshold:g})"
            detail = f"{len(paid)} adversarial completions, {most}"
            checks.append(Check(f"reward {name}", PASS, detail))
    checks += [Check(f"reward {n}", WARN, f"not audited: {why}") for n, why in result.not_audited.items()]
    return checks


def run_cli(args: argparse.Namespace) -> int:
    if getattr(args, "rewards", False):
        checks = reward_checks(args.params)
        render(checks, title="hermes-lab doctor: reward audit")
        return 1 if any(c.status == FAIL for c in checks) else 0
    logger = logging.getLogger("hermes_lab.api")
    handler = None
    old_level = logger.level
    if args.debug:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        checks = run_checks(args.base_url_env, args.key_env, args.model_env, args.params, args.timeout, args.chat)
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
    render(checks)
    return 1 if any(c.status == FAIL for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.cli.doctor", add_arguments, run_cli, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
