"""Reward functions for GRPO: one registry, plain functions ``(prompts, completions, **kwargs) -> list[float]``.

Stage: train (also used by ab_run and validate to score responses). Reads nothing on its own; the API
judge caches its answers under ``runs/cache/judge.jsonl``.

Every reward lies on the user's 0..scale range (reward.scale, 5 by default):

- ``system``: system feedback, "the tests pass". ``reward.system: verifier`` uses the embedded task
  verifiers (``hermes_lab.tasks.suite.score_tasks``; the code family's runs its hidden tests in the sandbox);
  ``reward.system: "pkg.module:function"`` plugs in the user's own checker with the same signature. A prompt the
  verifier does not know scores None, which TRL treats as "not applicable" for that function rather than as
  zero. With ``tests`` in ``reward.types`` too, a row that carries tests is the tests reward's alone (the
  verifier scores it None), so no completion is rewarded twice for the same tests.
- ``tests``: the task's tests run on the completion's code in the sandbox (``hermes_lab.rewards.tests``).
- ``comparison``: comparison feedback, the completion judged against the logged reference response
  (the best response prep found for that prompt). With ``reward.model`` set to a model id it asks an
  OpenAI-compatible judge (``hermes_lab.llm.judge.ApiJudge``: batched, concurrent, retried, cached); with no
  model or ``local`` it uses the local judge below, so the embedded default runs offline. A judge fault
  is per sample (``JudgeFaults``: a documented fallback, counted in health.json); training stops only
  when the failure share passes ``reward.max_judge_failure_rate``.
- ``"pkg.module:function"`` in ``reward.types``: any user function, the open-r1/TRL escape hatch.

Local judge, deliberately simple: similarity to a reference that passed earns up to ``scale``;
similarity to a reference that failed is penalised (being *different* from a known-bad answer earns up
to half the scale), because logged references come from a noisy policy. It is weaker evidence than
the verifier, which is why the embedded default weights it lower.

Every function is wrapped by a guard: a NaN or infinite reward stops training with a diagnosis (TRL
would otherwise nan-average it away or, worse, propagate a NaN loss).
"""

from __future__ import annotations

import difflib
import importlib
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from hermes_lab.config.schema import HermesConfig
from hermes_lab.rewards.tests import make_tests_reward
from hermes_lab.tasks import suite as T

RewardFn = Callable[..., list[float | None]]


class RewardError(RuntimeError):
    """A reward function misbehaved (bad name, NaN/inf, wrong length)."""


def _text(c: Any) -> str:
    # TRL passes strings for standard prompts and [{"role", "content"}] lists for conversational ones
    if isinstance(c, list):
        return "".join(m.get("content", "") for m in c if isinstance(m, dict))
    return str(c)


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise RewardError(f"{what} '{spec}': use 'package.module:function'")
    try:
        obj = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"{what} '{spec}' cannot be imported: {e}") from None
    if not callable(obj):
        raise RewardError(f"{what} '{spec}' is not callable")
    return obj


# ------------------------------------------------------------------------------------------ factories
def make_system_reward(cfg: HermesConfig) -> RewardFn:
    scale = float(cfg.reward.scale)
    if cfg.reward.system != "verifier":
        user = import_callable(cfg.reward.system, "reward.system")

        def system(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
            return user(prompts=prompts, completions=completions, **kw)

        return system

    defer = "tests" in cfg.reward.types

    def system(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
        rows = kw.get("tests") if defer else None
        known = [
            (i, t)
            for i, p in enumerate(prompts)
            if (t := T.parse_prompt(_text(p))) is not None and not (rows is not None and rows[i])
        ]
        scores = T.score_tasks([t for _, t in known], [_text(completions[i]) for i, _ in known], scale)
        out: list[float | None] = [None] * len(prompts)
        for (i, _), v in zip(known, scores):
            out[i] = v
        return out

    return system


def local_judge(completion: str, reference: str, ref_reward: float | None, scale: float, threshold: float) -> float:
    sim = difflib.SequenceMatcher(None, completion.strip(), (reference or "").strip()).ratio()
    if ref_reward is None or ref_reward >= threshold:
        return round(scale * sim, 4)
    return round(0.5 * scale * (1.0 - sim), 4)


def make_comparison_reward(cfg: HermesConfig) -> RewardFn:
    r = cfg.reward
    scale, thr = float(r.scale), float(r.success_threshold)
    if r.model and r.model != "local":
        from hermes_lab.llm.judge import ApiJudge

        judge = ApiJudge.from_config(cfg)
        stats = JudgeFaults(r.max_judge_failure_rate, r.judge_failure_window, judge.stats)

        def comparison(
            prompts: list[Any], completions: list[Any], reference: list[str] | None = None, **kw: Any
        ) -> list[float | None]:
            if reference is None:
                raise RewardError("comparison reward needs a 'reference' column in the GRPO dataset (prep writes it)")
            texts = [_text(p) for p in prompts]
            scores, errors = judge.score_or_none(texts, [_text(c) for c in completions], list(reference))
            out = stats.fill(texts, scores, errors)
            stats.check()  # raises RewardError once the failure share passes reward.max_judge_failure_rate
            return out

        comparison.judge_stats = stats  # type: ignore[attr-defined]  (train writes it into health.json)
        return comparison

    def comparison(
        prompts: list[Any],
        completions: list[Any],
        reference: list[str] | None = None,
        ref_reward: list[float] | None = None,
        **kw: Any,
    ) -> list[float | None]:
        if reference is None:
            return [None] * len(completions)
        rr = ref_reward if ref_reward is not None else [None] * len(completions)
        return [local_judge(_text(c), ref, rw, scale, thr) for c, ref, rw in zip(completions, reference, rr)]

    return comparison


REGISTRY: dict[str, Callable[[HermesConfig], RewardFn]] = {
    "system": make_system_reward,
    "comparison": make_comparison_reward,
    "tests": make_tests_reward,
}


# -------------------------------------------------------------------------------------- judge faults
class JudgeFaults:
    """Per-sample judge failures: the fallback, the counts, and the stop when there are too many.

    Fallback for a sample whose judgement failed (a 429 or 5xx after the retries, a timeout, a reply
    without a score): the mean comparison score of the same prompt's other completions in this batch
    when any of them was judged, so the missing judgement moves neither way within its GRPO group; None
    when the whole group failed, which TRL reads as "not applicable": the group is then ranked by the
    system reward alone. (A None next to judged siblings would not do: TRL sums the weighted rewards with
    nansum, so that completion alone would lose the comparison term and get a spurious negative advantage.)

    Training stops with a RewardError when more than ``max_rate`` of the last ``window`` judged samples
    failed (decided once 16 samples, or the whole window if smaller, have been seen)."""

    MIN_DECIDE = 16

    def __init__(self, max_rate: float, window: int, request_stats: dict[str, int] | None = None):
        self.max_rate, self.window = float(max_rate), max(1, int(window))
        self.recent: deque[bool] = deque(maxlen=self.window)
        self.request_stats = request_stats if request_stats is not None else {}
        self.samples = self.failures = self.imputed = self.left_to_system = 0
        self.by_kind: dict[str, int] = {}
        self.first_errors: list[str] = []

    def fill(self, prompts: list[str], scores: list[float | None], errors: list[Any]) -> list[float | None]:
        """The scores with the fallback applied to failed samples; counts them."""
        ok: dict[str, list[float]] = {}
        for p, v, e in zip(prompts, scores, errors):
            if e is None and v is not None:
                ok.setdefault(p, []).append(float(v))
        out: list[float | None] = []
        for p, v, e in zip(prompts, scores, errors):
            failed = e is not None
            self.samples += 1
            self.recent.append(failed)
            if not failed:
                out.append(v)
                continue
            self.failures += 1
            kind = type(e).__name__
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
            if len(self.first_errors) < 5:
                from hermes_lab.core.redaction import redact

                self.first_errors.append(redact(str(e))[:300])
            sib = ok.get(p)
            if sib:
                self.imputed += 1
                out.append(round(sum(sib) / len(sib), 4))
            else:
                self.left_to_system += 1
                out.append(None)
        return out

    @property
    def rate(self) -> float:
        return self.failures / self.samples if self.samples else 0.0

    def recent_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def check(self) -> None:
        n = len(self.recent)
        if n < min(self.MIN_DECIDE, self.window) or self.recent_rate() <= self.max_rate:
            return
        first = self.first_errors[0] if self.first_errors else "?"
        raise RewardError(
            f"the comparison judge failed on {sum(self.recent)} of the last {n} samples "
            f"({self.recent_rate():.0%} > reward.max_judge_failure_rate {self.max_rate:.0%}); first error: {first}. "
            "Check the judge (hermes-lab doctor), then continue with --resume from the last checkpoint."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "judge_requests": int(self.request_stats.get("requests", 0)),
            "judge_cache_hits": int(self.request_stats.get("cache_hits", 0)),
            "judge_failed_requests": int(self.request_stats.get("failed", 0)),
            "judge_samples": self.samples,
            "judge_failures": self.failures,
            "judge_failure_rate": round(self.rate, 4),
            "imputed_from_group": self.imputed,
            "system_reward_only": self.left_to_system,
            "by_kind": dict(self.by_kind),
            "first_errors": list(self.first_errors),
            "max_failure_rate": self.max_rate,
            "window": self.window,
        }


# ------------------------------------------------------------------------------------------ the guard
class SampleLog:
    """Keeps the last completions with their rewards: the 'sample completions' table of a run."""

    def __init__(self, maxlen: int = 256):
        self.rows: deque[dict[str, Any]] = deque(maxlen=maxlen)
        self.step = 0


def _guard(fn: RewardFn, name: str, samples: SampleLog | None) -> RewardFn:
    def guarded(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
        out = list(fn(prompts=prompts, completions=completions, **kw))
        if len(out) != len(completions):
            raise RewardError(f"reward '{name}' returned {len(out)} values for {len(completions)} completions")
        for i, v in enumerate(out):
            if v is not None and not math.isfinite(float(v)):
                raise RewardError(
                    f"reward '{name}' returned {v} for prompt {_text(prompts[i])[:80]!r} / completion "
                    f"{_text(completions[i])[:80]!r}. A NaN/inf reward poisons the GRPO advantage and the loss: "
                    f"look for reward outliers in the data, normalise or clip the reward, then rerun."
                )
        if samples is not None:
            for p, c, v in zip(prompts, completions, out):
                samples.rows.append(
                    {"step": samples.step, "reward_fn": name, "prompt": _text(p), "completion": _text(c), "reward": v}
                )
        return out

    guarded.__name__ = name  # TRL logs rewards/<__name__>/mean
    guarded.judge_stats = getattr(fn, "judge_stats", None)  # type: ignore[attr-defined]
    guarded.sandbox = getattr(fn, "sandbox", None)  # type: ignore[attr-defined]
    return guarded


def judge_faults(funcs: list[RewardFn]) -> JudgeFaults | None:
    """The judge-fault counter of a config's reward functions (None without an API judge)."""
    return next((f.judge_stats for f in funcs if getattr(f, "judge_stats", None) is not None), None)


def sandbox_tally(funcs: list[RewardFn]) -> Any:
    """The tests reward's ``SandboxTally`` among a config's reward functions (None without a tests reward)."""
    return next((f.sandbox for f in funcs if getattr(f, "sandbox", None) is not None), None)


def get_reward_funcs(cfg: HermesConfig, samples: SampleLog | None = None) -> tuple[list[RewardFn], list[float]]:
    """The reward functions and weights of a config, each guarded. Unknown names list the valid ones."""
    funcs: list[RewardFn] = []
    for name in cfg.reward.types:
        if name in REGISTRY:
            fn, label = REGISTRY[name](cfg), name
        elif ":" in name:
            fn, label = import_callable(name, "reward.types entry"), name.rsplit(":", 1)[1]
        else:
            raise RewardError(
                f"unknown reward '{name}' in reward.types. Valid names: "
                f"{', '.join(REGISTRY)}, or 'package.module:function'"
            )
        funcs.append(_guard(fn, label, samples))
    weights = list(cfg.reward.weights) if cfg.reward.weights else [1.0] * len(funcs)
    return funcs, weights


def score_responses(cfg: HermesConfig, prompts: list[str], responses: list[str]) -> list[float]:
    """The round's reward for logged responses with no reference (A/B traffic, validation): system feedback."""
    fn = make_system_reward(cfg)
    return [0.0 if v is None else float(v) for v in fn(prompts=prompts, completions=responses)]
