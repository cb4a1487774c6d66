"""Quiet by default: progress, verdicts and real problems only; ``--debug`` lets everything through.

Foundation, used by the command line (``hermes_lab.cli.main``), the round runner's papermill kernels, JupyterLab
(``hermes-lab lab``) and the notebooks' setup cell. Reads and writes nothing under runs/.

What is quieted, and why it is noise rather than news:
- httpx / httpcore log one INFO line per HTTP request (a remote judge makes thousands): WARNING and up
  only, unless debugging.
- ipykernel warns "Kernel is running over TCP without encryption" at every kernel start. That one is
  fixed, not hidden: kernels we start get CurveZMQ keys from jupyter_client (``transport_encryption =
  auto``, used when the kernelspec declares support and pyzmq has libsodium, as its wheels do), so the
  channel is encrypted and the kernel has nothing to warn about.
- transformers' FutureWarning on ``gradient_checkpointing`` came from our own GRPOConfig call, which now
  passes the new name (hermes_lab.train.grpo). TRL 1.16 and PEFT 0.21 still use ``model.is_gradient_checkpointing``
  and ``gradient_checkpointing_enable/disable`` (FutureWarnings at every training and adapter load): their
  calls, not ours, and nothing a user can act on, so ``third_party_deprecations()`` hides exactly those
  messages around our calls into them.
- MLflow logs "Creating initial MLflow database tables..." (INFO) when it opens a new SQLite store.
Warnings that mean something to the user (a training health guard, a bad record) are never filtered.

    hermes-lab --debug round --params params/embedded.yaml    # everything, also inside the stage kernels
    make round DEBUG=1                                          # the same
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

ENV_DEBUG = "HERMES_LAB_DEBUG"  # inherited by child processes: papermill kernels, JupyterLab's kernels
NOISY_LOGGERS = ("httpx", "httpcore", "mlflow.store.db.utils")
# FutureWarnings raised inside TRL / PEFT by their own calls into transformers 5 (not ours to fix)
# (with grpo.gradient_checkpointing on, PEFT and TRL also switch it with the old-named methods)
THIRD_PARTY_DEPRECATIONS = (
    r"`is_gradient_checkpointing` is deprecated",
    r"`gradient_checkpointing_(enable|disable)` is deprecated",
)


def debug_enabled() -> bool:
    return os.environ.get(ENV_DEBUG, "").strip().lower() in {"1", "true", "yes", "on"}


def configure(debug: bool | None = None) -> bool:
    """Set the logging levels for a quiet (or, with ``debug``, a verbose) run; returns whether debugging.

    ``debug=None`` follows ``$HERMES_LAB_DEBUG`` (how a kernel started by ``hermes-lab --debug`` knows)."""
    if debug is None:
        debug = debug_enabled()
    if debug:
        os.environ[ENV_DEBUG] = "1"  # the round's kernels and subprocesses inherit it
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("hermes_lab").setLevel(logging.DEBUG)  # e.g. every A/B request: id, arm, status
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        warnings.simplefilter("default")  # every warning once per location, deprecations included
    else:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    return debug


@contextlib.contextmanager
def third_party_deprecations() -> Iterator[None]:
    """Around our calls into TRL / PEFT: hide the deprecations they trigger (all shown with --debug)."""
    with warnings.catch_warnings():
        if not debug_enabled():
            for message in THIRD_PARTY_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        yield


def kernel_config() -> Any:
    """traitlets Config for the kernel managers we create (papermill, nbclient): an encrypted channel."""
    from traitlets.config import Config

    c = Config()
    if _curve_available():
        c.KernelManager.transport_encryption = "auto"
    return c


def kernel_args() -> list[str]:
    """The same setting as command-line options, for a Jupyter server (hermes-lab lab)."""
    return ["--KernelManager.transport_encryption=auto"] if _curve_available() else []


def _curve_available() -> bool:
    """pyzmq built with libsodium, and a jupyter_client that provisions keys (8.10+)."""
    try:
        import zmq
        from jupyter_client.manager import KernelManager
    except ImportError:  # pragma: no cover - both come with every kernel client
        return False
    return bool(zmq.has("curve")) and KernelManager.class_traits().get("transport_encryption") is not None
