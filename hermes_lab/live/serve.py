"""The command line of the live gateway: ``hermes-lab serve`` (``python -m hermes_lab.live.serve``).

Stage: validate (live A/B). Builds the ``hermes_lab.live.gateway.Gateway`` from the config and the arm flags, binds
the socket and serves it (``hermes_lab.live.server``); ``--report DIR`` instead writes the live report of a log dir
(``hermes_lab.live.report``) and exits. Reads and writes what the gateway does (``runs/live/<experiment>/``).

    hermes-lab serve --params params/embedded.yaml --time-scale 120     # a 10% -> 30% -> 100% rollout in minutes
    hermes-lab serve --report runs/live/tiny-vs-round-01 --params params/embedded.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from hermes_lab.config.schema import HermesConfig, load_config, set_overrides
from hermes_lab.live import log as L
from hermes_lab.live import server
from hermes_lab.live.arms import ARMS, resolve_arm
from hermes_lab.live.gateway import Gateway, log
from hermes_lab.live.routes import build_app


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default=None, help="config YAML (serve and ab sections; default: built-in defaults)")
    for arm in ARMS:
        p.add_argument(
            f"--{arm}",
            default=None,
            metavar="SPEC",
            help=f"{arm} arm: embedded:tiny, a model/adapter/train dir, 'latest', or an http(s) API root "
            f"(default: serve.{arm})",
        )
        p.add_argument(f"--{arm}-model", default=None, metavar="ID", help=f"model id of a URL {arm} arm")
        p.add_argument(f"--{arm}-key-env", default=None, metavar="VAR", help=f"env var with the {arm} upstream's key")
    p.add_argument("--ratio", type=float, default=None, help="candidate share (default: the first ab.stages ratio)")
    p.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: serve.port, 8700; 0: any free port)")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="log dir (default: runs/live/<experiment>)")
    p.add_argument("--experiment", default=None, help="experiment name (default: <baseline>-vs-<candidate>)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="K",
        help="run the experiment clock K times faster (stages, looks; demos and tests); default serve.time_scale",
    )
    p.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write DIR/ab_report.json (and plots) of a gateway log dir, print its summary, and exit",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--debug", action="store_true", help="DEBUG logging: one line per request (id, arm, status)")


def config_of(args: argparse.Namespace) -> HermesConfig:
    overrides = set_overrides(args.set)
    for flag, key in (("host", "serve.host"), ("port", "serve.port"), ("time_scale", "serve.time_scale")):
        if getattr(args, flag, None) is not None:
            overrides[key] = getattr(args, flag)
    return load_config(args.params, overrides=overrides)


def make_gateway(args: argparse.Namespace) -> Gateway:
    cfg = config_of(args)
    # an experiment continued on its log dir (one a round prepared, or a restart) serves its recorded arms
    # unless a flag names another
    known = args.log_dir or cfg.serve.log_dir
    recorded = ((L.load_experiment(known) if known else None) or {}).get("arm_specs", {})
    specs = {}
    for a in ARMS:
        given = (getattr(args, a), getattr(args, f"{a}_model"), getattr(args, f"{a}_key_env"))
        r = recorded.get(a) if given[0] is None else None
        specs[a] = resolve_arm(cfg, a, r["spec"], r["model"], r["key_env"]) if r else resolve_arm(cfg, a, *given)
    return Gateway(cfg, specs, ratio=args.ratio, log_dir=args.log_dir, experiment=args.experiment)


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket, bound before the server starts (port 0: the port it got is printed);
    SO_REUSEADDR: a gateway restarted right after a stop (or a kill -9) gets its address back at once;
    ``reuse_port``: several processes share the port (SO_REUSEPORT; benchmarks/bench_gateway.py --processes)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_cli(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.debug:
        log.setLevel(logging.DEBUG)
    else:  # quiet by default: no weight-loading bars or deprecation notes from transformers / peft
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        import warnings

        for mod in ("transformers", "peft"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=mod)
    if args.report:
        from hermes_lab.live.report import report_cli

        return report_cli(config_of(args), args.report)
    gw = make_gateway(args)
    s = gw.cfg.serve
    try:
        sock = bind(s.host, s.port)
    except OSError as e:
        print(f"hermes-lab serve: cannot bind {s.host}:{s.port}: {e.strerror}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    if s.host not in ("127.0.0.1", "localhost", "::1") and not s.api_key_env:
        print(
            f"hermes-lab serve: warning: {s.host} is reachable from other machines and no gateway key is set "
            "(serve.api_key_env)",
            file=sys.stderr,
        )
    b, c = gw.specs["baseline"], gw.specs["candidate"]
    print(
        f"hermes-lab serve: http://{s.host}:{port}/v1  model {gw.public!r}\n"
        f"  baseline  {b.served_model} ({b.kind}) {1 - gw.ratio:.0%}\n"
        f"  candidate {c.served_model} ({c.kind}) {gw.ratio:.0%}\n"
        f"  log {gw.log_dir}  ({gw.tally.n[0] + gw.tally.n[1]} requests logged before)\n"
        f"  {rollout_line(gw)}",
        flush=True,
    )
    server.run(sock, gw, build_app(gw), access_log=s.access_log, event_loop=s.event_loop)
    return 0


def rollout_line(gw: Gateway) -> str:
    """The rollout at start: the plan, the clock, where it is."""
    ro, st = gw.rollout, gw.state
    if not ro.enabled:
        return "rollout: off (serve.rollout: false): a fixed candidate share, no looks"
    from hermes_lab.live.experiment import duration

    plan = " -> ".join(f"{s.ratio:.0%} for {duration(s.seconds)}" for s in ro.plan) + " -> 100%"
    clock = f", clock x{ro.K:g} (--time-scale)" if ro.K != 1 else ""
    where = (
        f"stage {st['stage'] + 1} ({st['ratio']:.0%}), since {duration(st['stage_starts'][-1])} into the experiment"
        if ro.running
        else st["status"]
    )
    return f"rollout: {plan}, a look every {duration(gw.cfg.ab.look_every)}{clock}; now {where}"


def main(argv: list[str] | None = None) -> int:
    from hermes_lab.core.command import run_module

    return run_module("hermes_lab.live.serve", add_arguments, run_cli, argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
