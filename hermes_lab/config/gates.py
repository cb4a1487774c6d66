"""Config sections of the gates a candidate passes: ``review`` (human review agreement), ``validate`` (the
regression gate and the training diagnostics) and ``ab`` (the A/B test and its staged rollout).

Part of the config layer (``hermes_lab.config.schema`` builds ``HermesConfig`` from the sections and loads it):
each field with its help text and bounds, choices as ``Literal`` types, and the checks: ``review_problems``,
the rollout plan's (``ab_stage_problems``) and ``ab_warnings``. Reads and writes nothing.

    hermes-lab config --explain        # every key, with its choices and bounds
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

from hermes_lab.core.yaml_typed import field_with as _f


@dataclass
class ReviewSection:
    simulate: bool = _f(
        False, "Unattended rounds only: the task verifier acts as a simulated reviewer (labels marked simulated)."
    )
    min_labels: int = _f(
        0,
        "Labels needed before the agreement gate can decide (the whole queue when the queue is smaller). "
        "0: enough for a Wilson interval of +-max_ci_halfwidth around min_agreement (73 at 90% and 0.07).",
        ge=0,
    )
    max_ci_halfwidth: float = _f(
        0.07,
        "Precision the gate needs: the default min_labels gives a 95% Wilson interval this wide either side, "
        "and max_items is sized by it. Pass needs the interval entirely above min_agreement, blocked entirely "
        "below; otherwise the verdict is 'inconclusive: label N more' and the round waits.",
        gt=0,
        lt=0.5,
    )
    max_items: int = _f(
        0,
        "Cap on the review items the gate counts (the queue's first items, in prep's random order): a large "
        "10% sample need not be labelled whole. 0: enough for +-max_ci_halfwidth at 50% agreement (193).",
        ge=0,
    )
    min_agreement: float = _f(0.9, "Reward-model/human agreement needed to train.", ge=0, le=1)
    label_mode: Literal["score", "passfail"] = _f("score", "Label buttons: score (0..5) or passfail.")
    agreement_metric: Literal["threshold", "within1"] = _f(
        "threshold",
        "Raw agreement the gate compares with min_agreement: threshold "
        "(reward model and reviewer on the same side of reward.success_threshold) or "
        "within1 (|reward - label| <= 1; score labels only).",
    )
    min_kappa: float = _f(
        0.0,
        "Also block when Cohen's kappa on pass/fail is below this (0: report only). Kappa "
        "discounts chance agreement: with 95% passes on both sides, 90% raw agreement can be "
        "kappa ~0.",
        le=1,
    )
    kappa_weights: Literal["quadratic", "linear"] = _f(
        "quadratic",
        "Weights of the ordinal kappa on integer-binned scores: quadratic (a 5-vs-0 miss costs 25x a 1-point miss).",
    )


@dataclass
class ValidateSection:
    eval_tasks_per_family: int = _f(64, "Held-out tasks per family for the regression gate.", ge=1)
    gain_tasks_per_family: int = _f(
        200,
        "Held-out tasks per family of the train stage's before/after pass rate (2 samples each): the round's headline "
        "gain and its paired interval. 200 x 6 families resolves a later round's 3-point gain. The agent family's "
        "before/after episode success runs as many held-out episodes.",
        ge=1,
    )
    samples_per_task: int = _f(1, "Samples per task (sampled pass rate).", ge=1)
    tolerance: float = _f(
        0.05,
        "Non-inferiority margin: the candidate passes a family only if the upper confidence bound of its drop "
        "in pass rate (paired on the same tasks and seeds) is below this.",
        gt=0,
        lt=1,
    )
    temperature: float = _f(
        0.9, "Sampling temperature of the regression eval, the same for baseline and candidate.", gt=0, le=2
    )
    seed: int = _f(0, "Seed of the regression eval (task generation and sampling), the same for both arms.")
    alpha: float = _f(
        0.05,
        "One-sided error level of each family's upper bound on the drop (a family that regressed by the "
        "tolerance passes with probability <= alpha; every family must pass, so no multiplicity correction), "
        "and of the reward-trend test in the curve diagnostics.",
        gt=0,
        lt=1,
    )
    power_drop: float = _f(
        0.10, "Drop in pass rate whose chance of being stopped the gate reports per family (its power).", gt=0, le=1
    )
    min_power: float = _f(
        0.8,
        "Warn when a family's set is too small: a power_drop drop stopped, or an equally good candidate "
        "passed, less often than this.",
        gt=0,
        lt=1,
    )
    kl_spike_k: float = _f(
        6.0,
        "Diagnostics: a KL value more than k robust std (1.4826*MAD) above the rolling "
        "median of the previous steps is a spike.",
        gt=0,
    )
    kl_spike_min_jump: float = _f(
        0.02, "Diagnostics: a KL spike must also jump by at least this much (absolute).", ge=0
    )
    kl_spike_ratio: float = _f(
        3.0,
        "Diagnostics: a KL spike must also reach this many times the value the "
        "previous steps predict (per-batch KL wiggles 1.5x in a healthy run).",
        ge=1,
    )
    curve_window: int = _f(10, "Diagnostics: rolling window (logging steps) for the KL spike median/MAD.", ge=2)
    trend_window: float = _f(
        0.25,
        "Diagnostics: share of steps in the first/last window compared to decide whether the reward rises.",
        gt=0,
        le=0.5,
    )
    reward_outlier_z: float = _f(
        6.0,
        "Diagnostics: robust z (residual from a rolling median over MAD) past which a per-step reward is an outlier.",
        gt=0,
    )


@dataclass
class ABSection:
    traffic_ratio: float = _f(
        0.1, "Candidate share in the first stage: an alias of ab.stages[0][0] (set one, or both equal).", gt=0, le=1
    )
    stages: list[list[float]] = _f(
        [[0.1, 7200], [0.3, 14400], [1.0, 0]], "Rollout stages as [ratio, seconds]; a final ratio 1.0 means promoted."
    )
    request_rate: float = _f(
        0.25,
        "Simulated requests per second (ab.plan_power > 0: the planned rate instead); a live rollout (serve) "
        "takes it as the expected rate per experiment second, which tunes where its confidence sequence is "
        "tightest (never its validity).",
        gt=0,
    )
    plan_power: float = _f(
        0.0,
        "Simulated traffic (ab-run, ab.mode simulated): plan the request rate for this power, the chance that the "
        "staged rollout promotes a candidate ab.plan_effect points better (hermes_lab.ab.plan simulates the "
        "rollout's own test); the planned rate replaces ab.request_rate. 0: no plan, ab.request_rate as set.",
        ge=0,
        lt=1,
    )
    plan_effect: float = _f(
        0.0,
        "ab.plan_power: the gain to detect, in points of success share (reward >= reward.success_threshold). "
        "0: this round's held-out gain (train/eval.json gain_points), else ab.plan_fallback_effect.",
        ge=0,
        le=100,
    )
    plan_fallback_effect: float = _f(
        5.0,
        "ab.plan_power: the gain planned for when ab.plan_effect is 0 and no positive held-out gain is known.",
        gt=0,
        le=100,
    )
    plan_max_rate: float = _f(
        2.0,
        "ab.plan_power: cap on the planned rate (requests per simulated second; a rollout generates rate x "
        "stage lengths responses). When it binds the plan reports the power it reaches.",
        gt=0,
    )
    covariates: list[Literal["family_level", "opening_turn", "task", "history"]] = _f(
        ["family_level", "opening_turn", "task", "history"],
        "Regression adjustment of the sequential rule (request and conversation units, not user; "
        "hermes_lab.ab.adjust): what is known about a request before it is routed and predicts its reward, so"
        " the confidence sequence can leave that variance out. family_level: the embedded task's family and "
        "level. opening_turn: a conversation's opening turn (system prompt, number of tools, length of the "
        "first user message). task: the prompt itself (a conversation's first user message), whose mean the "
        "rule learns from the stage's earlier requests. history: the cell's and the task's mean reward in "
        "earlier logs (this round's execution log and ab.history_rounds rounds' A/B logs). Fitted on earlier "
        "looks only, so the guarantee holds; a request without any keeps the plain estimate. Empty: no "
        "adjustment.",
    )
    history_rounds: int = _f(
        3, "ab.covariates history: how many earlier rounds' A/B request logs give the prior (0: none).", ge=0, le=100
    )
    salt: str = _f("", "Per-experiment salt for the router (empty: the user's bucket formula bit for bit).")
    alpha: float = _f(0.05, "Significance level.", gt=0, lt=1)
    srm_alpha: float = _f(0.001, "Sample-ratio-mismatch threshold: below it, hold.", gt=0, lt=1)
    max_error_rate: float = _f(
        0.02, "Guardrail: candidate error rate above baseline by more than this rolls back.", ge=0, le=1
    )
    max_latency_ratio: float = _f(
        1.5, "Guardrail: candidate p95 latency over baseline p95 above this rolls back.", gt=0
    )
    rule: Literal["sequential", "user"] = _f(
        "sequential", "Decision rule: sequential (always-valid) or user (docs/SPEC.md's p<0.05 rule)."
    )
    mode: Literal["simulated", "live"] = _f(
        "simulated",
        "A round's A/B stage. simulated: ab-run on a simulated clock. live: the gateway (hermes-lab serve) runs "
        "the rollout on real traffic; the round waits ('awaiting live A/B', --resume) until it is decided.",
    )
    look_every: float = _f(
        900.0,
        "Seconds between two interim looks within a stage. Harm, guardrails and SRM are "
        "checked at every look; promotion only from the stage's planned end.",
        gt=0,
    )
    max_extension: float = _f(
        1.0,
        "An inconclusive stage is extended by up to this many times its planned length; "
        "still inconclusive then: the rollout stops at 'keep observing'.",
        ge=0,
    )
    min_per_arm: int = _f(
        30, "Units (conversations, requests, or users: ab.unit) each arm needs before any decision.", ge=2
    )
    guardrail_alpha: float = _f(
        0.01,
        "Error level of each guardrail's always-valid one-sided bound (error rate, p95 latency): a guardrail "
        "rolls back only when the candidate is worse by the margin AND the bound shows it is worse at all.",
        gt=0,
        lt=1,
    )
    unit: Literal["conversation", "request", "user"] = _f(
        "conversation",
        "Randomisation unit: conversation (every turn of an agent's conversation goes to the arm of its first "
        "turn; a single-turn request is a conversation of one turn), request (each request on its own), or user "
        "(requests of one user share an arm). Decisions count units: SRM, min_per_arm and the always-valid "
        "bounds use one observation per unit. The simulated ab-run's traffic is single-turn: conversation and "
        "request are the same there.",
    )
    num_users: int = _f(2000, "Simulated user pool when unit is user.", ge=1)
    task_split: Literal["heldout", "any", "train"] = _f(
        "heldout", "Tasks the simulated traffic draws: heldout (never trained on) or any."
    )
    latency_median_ms: float = _f(120.0, "Simulated latency: median of the lognormal base latency (ms).", gt=0)
    latency_sigma: float = _f(0.35, "Simulated latency: sigma of the lognormal base latency.", ge=0)
    latency_ms_per_char: float = _f(
        4.0, "Simulated latency: extra ms per response character (longer answers are slower).", ge=0
    )


def review_problems(rv: ReviewSection) -> list[str]:
    """The agreement metric must fit the labels: within1 compares scores."""
    if rv.agreement_metric == "within1" and rv.label_mode == "passfail":
        return ["review.agreement_metric within1 needs score labels: review.label_mode passfail gives only 0/5"]
    return []


def ab_stage_problems(stages: Any, where: str = "ab.stages") -> list[str]:
    """The rollout plan: [ratio, seconds] pairs; ratios in (0, 1], starting below 1, never decreasing."""
    if not stages or any(not isinstance(s, list) or len(s) != 2 for s in stages):
        return [f"{where} must be a list of [ratio, seconds] pairs, got {stages!r}"]
    ratios, secs = [s[0] for s in stages], [s[1] for s in stages]
    out = []
    if any(not 0 < r <= 1 for r in ratios) or ratios[0] >= 1 or any(b < a for a, b in itertools.pairwise(ratios)):
        out.append(
            f"{where} ratios must lie in (0, 1], start below 1 (a test needs a baseline) and never decrease "
            f"(a monotone ramp keeps candidate units candidates), got {ratios}"
        )
    if any(s < 0 for s in secs) or secs[0] <= 0:
        out.append(f"{where} seconds must be >= 0, and > 0 for the first stage (it is tested), got {secs}")
    return out


def ab_warnings(a: ABSection) -> list[str]:
    """A power plan where the gateway's traffic sets the rate: allowed, without effect."""
    if a.plan_power > 0 and a.mode == "live":
        return ["ab.plan_power plans simulated traffic only: with ab.mode live the gateway's traffic sets the rate"]
    return []
