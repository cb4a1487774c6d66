"""The live A/B gateway: an OpenAI-compatible server that routes each request to baseline or candidate.

Stage: validate (live A/B on real traffic). Reads the two arms (``hermes_lab.live.arms``: an upstream
OpenAI-compatible server, or ``hermes_lab.live.local``: a policy served in-process). Writes its log dir (default
``runs/live/<experiment>/``; ``hermes_lab.live.log``): requests.jsonl, tools.jsonl, feedback.jsonl, experiment.json.

    hermes-lab serve --params params/embedded.yaml --baseline embedded:tiny --candidate latest
    make serve                                  # the same on the embedded default
    hermes-lab agent --url http://127.0.0.1:8700 --requests 500     # drive it like a real agent

The server's parts: ``hermes_lab.live.routes`` (the routes; the endpoints but one), ``hermes_lab.live.handling``
(``POST /v1/chat/completions``: a request from its bytes to its answer), ``hermes_lab.live.records`` (a
request's record, durable before its answer's last byte).

Endpoints: ``GET /healthz``, ``GET /v1/models`` and ``/v1/models/{name}`` (``max_model_len``: the least of the arms'
context lengths, ``hermes_lab.live.routes``), ``GET /version``, ``POST /v1/chat/completions`` (non-streaming and
``stream: true``: SSE chunks passed through as they arrive; any model name is served unless ``serve.models`` lists
the accepted ones), ``POST /v1/feedback`` (``{"conversation_id" | "request_id", "reward", "source"?, "detail"?,
"close"?}``: it scores the whole conversation; 202; 404 unknown id; 422 bad body or reward outside 0..reward.scale),
``GET /v1/conversations/{id}`` (a conversation's turns, arm, state, reward; a request id finds its conversation),
``GET /v1/experiment`` (stage, ratio, counts, per-arm conversation statistics, the decision of
``hermes_lab.ab.stats``, the latest look's delta and interval).

Routing is the user's ABRouter bucket (``hermes_lab.ab.stats.bucket``, md5 of the unit id, ``ab.salt``) on the
unit. ``ab.unit: conversation``: a conversation's first turn is routed on its id (``hermes_lab.live.conversations``
links every later turn to it: an explicit id, else the message prefix), and every later turn goes to the same
arm; after a roll back (share 0) a candidate conversation's next turns go to the baseline, ``switched`` in the
log. ``ab.unit: request``: the ``X-Request-ID`` header (generated when absent); ``ab.unit: user``: the OpenAI
``user`` field or an ``X-Hermes-User`` header (a request with neither is its own unit). Every answer carries
``X-Request-ID``, ``X-Hermes-Conversation`` and ``X-Hermes-Arm``. A request's record (the turn's new messages,
the answer whole: text, tool calls assembled from the stream, reasoning, usage) is durable
(``serve.durability``) before the last byte of its answer goes out, so a kill -9 loses no answered request; a
restart on the same dir continues the experiment.

Security: binds 127.0.0.1 unless told otherwise; ``serve.api_key_env`` names the env var holding an
optional gateway key (Bearer); bodies over ``serve.max_body_bytes`` get 413; the client's Authorization
header is never logged nor forwarded, and an upstream's key goes only to that upstream.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import ConfigError, HermesConfig
from hermes_lab.core.layout import RunsLayout
from hermes_lab.live import experiment as X
from hermes_lab.live import log as L
from hermes_lab.live.arms import ARMS, ArmSpec
from hermes_lab.live.conversations import Tracker
from hermes_lab.live.handling import ChatHandling
from hermes_lab.live.local import ArmPool, build_arms
from hermes_lab.live.records import RequestRecords
from hermes_lab.live.routes import Routes

log = logging.getLogger("hermes_lab.serve")


def default_experiment(specs: dict[str, ArmSpec]) -> str:
    return f"{specs['baseline'].slug}-vs-{specs['candidate'].slug}"


class Gateway(Routes, ChatHandling, RequestRecords):
    """The experiment behind the server: arms, router, durable logs, in-memory tally."""

    def __init__(
        self,
        cfg: HermesConfig,
        specs: dict[str, ArmSpec],
        *,
        ratio: float | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        experiment: str | None = None,
        say: Any = print,
        pool: ArmPool | None = None,
    ):
        self.cfg, s = cfg, cfg.serve
        self.specs, self.say = specs, say
        self.name = experiment or s.experiment or default_experiment(specs)
        self.log_dir = Path(log_dir or s.log_dir or RunsLayout(cfg.round.runs_dir).experiment(self.name).root)
        self.stages, ratio = X.live_stages(cfg, self.log_dir, ratio)  # errors name the ab.* key
        self.public = s.public_model
        self.accepted = {self.public, *s.models} if s.models else None  # None: any model name is served
        self.unit, self.salt = cfg.ab.unit, cfg.ab.salt
        self.from_user = s.conversation_from_user
        self.convs = Tracker(s.conversation_idle_s, s.conversation_tool_wait_s, s.max_conversations)
        self.max_body = s.max_body_bytes
        self.scale = float(cfg.reward.scale)
        # first: a missing key fails before any state is written. A shared pool (the live flywheel's one
        # gateway, hermes_lab.live.switch) keeps its policies and worker; else they are this gateway's
        self.arms, self.worker = build_arms(cfg, specs, pool)
        ident = X.experiment_ident(cfg, {n: specs[n].describe() for n in ARMS}, self.name)
        self.state = X.open_experiment(self.log_dir, ident, self.stages, ratio, arm_specs=X.arm_specs(specs))
        self.stage, self.ratio = int(self.state["stage"]), float(self.state["ratio"])
        self.t0 = float(self.state["start_unix"])
        self.fallback = s.fallback == "baseline"
        self._auth: bytes | None = None
        if s.api_key_env:
            key = os.environ.get(s.api_key_env, "")
            if not key:
                raise ConfigError(f"serve.api_key_env names {s.api_key_env}, which is not set: export the gateway key")
            self._auth = f"Bearer {key}".encode()
        # the adjusted rule needs one reward row per unit: a request, or a conversation (its first turn's row)
        covs = cfg.ab.covariates if cfg.ab.unit != "user" else ()
        self.tally = L.Tally.from_dir(self.log_dir, s.feedback_source, covariates=covs)
        for cid, arm, turns, msgs, age in L.open_conversations(self.log_dir, s.conversation_tool_wait_s):
            if cid not in self.tally.conv_reward:  # a scored conversation was closed by its feedback
                self.convs.restore(cid, arm, turns, msgs, age)
        # the staged rollout on the (scaled) wall clock: it owns stage and ratio, the gateway routes with them
        self.rollout = X.LiveRollout(cfg, self.state, self.log_dir, self.tally, say)
        self.clock = self.rollout.clock
        self._looks: asyncio.Task | None = None
        self._warm: asyncio.Future | None = None
        self.rejected = 0
        self.req_log = self.fb_log = self.tools_log = None
        self.traces: Any = None
        self._decision: tuple[Any, dict[str, Any]] = (None, {})
        self.flywheel: Any = None  # the live flywheel's status (a callable), shown by /v1/experiment
        self._debug = log.isEnabledFor(logging.DEBUG)
        # generated request ids: a random per-process prefix and a counter (unique across restarts, and
        # cheaper than uuid4, whose urandom call showed up in the profile)
        self._rid_prefix, self._rid_seq = f"hl-{os.urandom(6).hex()}-", itertools.count(1)

    async def startup(self) -> None:
        s = self.cfg.serve
        self.req_log = L.LogWriter(self.log_dir / L.REQUESTS, s.durability, s.fsync_ms)
        self.fb_log = L.LogWriter(self.log_dir / L.FEEDBACK, s.durability, s.fsync_ms)
        self.tools_log = L.ToolsLog(self.log_dir, s.durability, s.fsync_ms)
        for a in self.arms.values():
            await a.start()
            if hasattr(a, "stated_length"):  # an upstream's own max_model_len: what GET /v1/models passes on
                a.context_length = await a.stated_length()
        # the decision's scipy/statsmodels imports take seconds: done now, off the loop, not at the first look
        self._warm = asyncio.get_running_loop().run_in_executor(None, X.warm_up)
        # the cyclic GC took 18% of the gateway's CPU (bench_gateway's load, timed by gc.callbacks): full collections
        # walking every object of the modules (the warm-up's scipy and statsmodels, a local arm's torch) again and
        # again, young ones every 700 allocations (a conversation's parsed request is hundreds). The objects there
        # once warm are frozen out of it, and a young collection waits for 20,000 allocations: 1%. Once per process:
        # a later experiment's gateway (the flywheel's hot swap) would freeze the drained one's garbage for good
        gc.set_threshold(max(gc.get_threshold()[0], 20_000), 20, 10)
        if not gc.get_freeze_count():
            self._warm.add_done_callback(lambda _: gc.freeze())
        if s.mlflow_traces:
            from hermes_lab.live.traces import TraceSink

            self.traces = TraceSink(self.cfg, self.name)
        self.rollout.start_clock()
        self.t0 = self.rollout.t0
        if self.rollout.next_look() is not None:
            self._looks = asyncio.create_task(self.rollout.run(self._moved))

    def _moved(self) -> None:
        """The rollout took a step: route with its stage and ratio from the next request on."""
        self.stage, self.ratio = int(self.state["stage"]), float(self.state["ratio"])

    async def shutdown(self) -> None:
        if self._looks is not None:
            if not self.rollout.reporting:  # the final report is being written: let it finish
                self._looks.cancel()
            await asyncio.gather(self._looks, return_exceptions=True)
        for a in self.arms.values():
            await a.close()
        for w in (self.req_log, self.fb_log, self.tools_log):
            if w is not None:
                w.close()
        if self.worker is not None:
            self.worker.close()
        if self.traces is not None:
            self.traces.close()
