"""Typed configuration: the user's hermes_grpo_lora.yaml, plus the workbench's own sections, and every check.

Reads one YAML file (``params/*.yaml``); writes nothing. Every stage module takes a ``HermesConfig``.

The user's file (model / lora / grpo / reward / data) is accepted exactly as docs/SPEC.md shows it. The
workbench adds optional sections (execute / conversations / review / validate / ab / round / serve / sandbox)
whose defaults fit the embedded task suite, so the user's file alone is a complete config. The sections are
declared by job, each with its fields' help texts and bounds and its own checks: ``config.training`` (model,
lora, grpo), ``config.scoring`` (reward, sandbox), ``config.round_data`` (data, execute, conversations),
``config.gates`` (review, validate, ab), ``config.serving`` (serve); round here, beside ``HermesConfig`` and
the loader. A rule that reads two sections lives beside the section it is about, the other's value passed in.

Rules, the way TRL's GRPOConfig documents itself and open-r1 maps YAML onto it:
- every field has a help text (``field_help`` / ``hermes-lab config --explain``);
- ``${VAR}`` and ``${VAR:-default}`` are filled from the environment; a missing variable is an error
  naming the variable, the key and the file line;
- an unknown key is an error naming it and listing the valid keys of its section;
- a bad value is an error naming the key. Every check lives in config/, next to the fields: types and choices
  (``Literal``) are enforced by the loader, ranges by each field's bounds (``_f(..., ge=2)``), the rest
  (cross-field, registry names, TRL's accepted values) by each section module's ``*_problems`` (errors) and
  ``*_warnings``, which ``config_problems`` runs in a fixed order. Every problem is reported, not just the
  first. ``config.check.check_config(cfg, deep=True)`` (``hermes-lab config --check``, and the round before
  its first stage) adds what needs TRL/PEFT imported: their own config classes built from ours.

Secrets never live here: ``api_key_env`` holds the *name* of the environment variable with the key.

    hermes-lab config --params params/hermes_grpo_lora.yaml      # print the resolved config
    hermes-lab config --check --params params/hermes_grpo_lora.yaml   # every problem, exit 0 / 2
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from hermes_lab.config.gates import (
    ABSection,
    ReviewSection,
    ValidateSection,
    ab_stage_problems,
    ab_warnings,
    review_problems,
)
from hermes_lab.config.round_data import (
    AgentSection,
    ConversationsSection,
    DataSection,
    ExecuteSection,
    conversations_problems,
    execute_problems,
    execute_warnings,
)
from hermes_lab.config.scoring import (
    REWARD_TYPES,
    RewardSection,
    SandboxSection,
    reward_problems,
    sandbox_problems,
    sandbox_warnings,
)
from hermes_lab.config.serving import ServeSection, serve_problems
from hermes_lab.config.training import (
    EMBEDDED_MODEL,
    GrpoSection,
    LoraSection,
    ModelSection,
    training_problems,
    trl_choices,
)
from hermes_lab.core import paths
from hermes_lab.core.yaml_typed import ConfigError, bound_problems, build, read_yaml
from hermes_lab.core.yaml_typed import field_with as _f

META = ("source", "explicit")  # HermesConfig fields that are not config keys


@dataclass
class RoundSection:
    runs_dir: str = _f("runs", "Where rounds, the MLflow store and the policies live.")
    simulated_clock: bool = _f(False, "Use a simulated clock (embedded flywheel: cooldown without waiting a day).")
    experiment: str = _f("hermes-lab", "MLflow experiment name.")
    registered_model: str = _f("hermes-policy", "MLflow registered model holding the 'champion' alias.")
    on_held: Literal["new", "continue"] = _f(
        "new",
        "A candidate whose A/B stage reached its hard end undecided ('candidate held: undecided'). new: the next "
        "round trains a new candidate from the champion. continue: the next round continues that experiment "
        "instead (the same candidate, its stage's data kept, its confidence sequence carried on for another "
        "stage length with extension; no training, so no cooldown). A continued experiment that ends undecided "
        "again is not continued twice.",
    )


@dataclass
class HermesConfig:
    model: ModelSection = field(default_factory=ModelSection, metadata={"help": "The policy."})
    lora: LoraSection = field(default_factory=LoraSection, metadata={"help": "PEFT LoraConfig."})
    grpo: GrpoSection = field(default_factory=GrpoSection, metadata={"help": "GRPO (TRL GRPOConfig)."})
    reward: RewardSection = field(default_factory=RewardSection, metadata={"help": "Reward functions."})
    data: DataSection = field(default_factory=DataSection, metadata={"help": "Data gates and distillation."})
    execute: ExecuteSection = field(default_factory=ExecuteSection, metadata={"help": "Execute step."})
    agent: AgentSection = field(
        default_factory=AgentSection, metadata={"help": "Who plays the agent family: the built-in loop or Hermes."}
    )
    conversations: ConversationsSection = field(
        default_factory=ConversationsSection,
        metadata={"help": "Agent conversations in prep: input shapes and the rewards of logs that carry none."},
    )
    review: ReviewSection = field(default_factory=ReviewSection, metadata={"help": "Human review gate."})
    validate: ValidateSection = field(default_factory=ValidateSection, metadata={"help": "Regression gate."})
    ab: ABSection = field(default_factory=ABSection, metadata={"help": "A/B test and rollout."})
    round: RoundSection = field(default_factory=RoundSection, metadata={"help": "Round orchestration."})
    serve: ServeSection = field(default_factory=ServeSection, metadata={"help": "Live A/B gateway (hermes-lab serve)."})
    sandbox: SandboxSection = field(
        default_factory=SandboxSection, metadata={"help": "Where and under which limits the tests reward runs code."}
    )
    source: str | None = field(default=None, metadata={"help": "File this config was read from."})
    explicit: frozenset[str] = field(
        default=frozenset(), metadata={"help": "Dotted keys set by the file or overrides."}, repr=False
    )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in META:
            d.pop(k, None)
        return d

    def flat_params(self) -> dict[str, Any]:
        """Flat 'section.key' -> value for MLflow params. Holds no secret: keys live in the env only."""
        out: dict[str, Any] = {}
        for sec, vals in self.to_dict().items():
            for k, v in vals.items():
                out[f"{sec}.{k}"] = v
        return out


# ------------------------------------------------------------------------------------------- checks


def config_problems(cfg: HermesConfig) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a built config: every section's bounds, then each section's own checks (its module's,
    beside its fields; another section's value passed in where a rule spans two), in a fixed order: the order of
    the messages a user reads."""
    errs: list[str] = []
    warns: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.name not in META:
            errs += bound_problems(f.name, getattr(cfg, f.name))
    m, r = cfg.model, cfg.reward
    # one rule, one wording for two sections' key names: here, before either section's own checks, as it ran
    for key, value in (("model.api_key_env", m.api_key_env), ("reward.api_key_env", r.api_key_env)):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value or ""):  # never echo it: it may be the key
            errs.append(f"{key} must be the NAME of an environment variable (letters, digits, _), not the key")
    errs += training_problems(m, cfg.lora, cfg.grpo, cfg.data.max_seq_len)
    errs += reward_problems(r)
    errs += execute_problems(cfg.execute)
    errs += review_problems(cfg.review)
    errs += ab_stage_problems(cfg.ab.stages)
    if not cfg.round.registered_model.strip() or "'" in cfg.round.registered_model:
        errs.append("round.registered_model must be a non-empty name without quotes")
    errs += serve_problems(cfg.serve)
    errs += conversations_problems(cfg.conversations)
    errs += sandbox_problems(cfg.sandbox)
    warns += sandbox_warnings(cfg.sandbox, r)
    warns += ab_warnings(cfg.ab)
    warns += execute_warnings(cfg.execute, cfg.data, m.base_model == EMBEDDED_MODEL)
    return errs, warns


def ab_stages(cfg: HermesConfig, ratio: float | None = None) -> list[list[float]]:
    """The rollout plan, with the first ratio replaced by ``ratio`` (ab_run --ratio), checked."""
    stages = [[float(x) for x in s] for s in cfg.ab.stages]
    if ratio is not None:
        stages[0][0] = float(ratio)
        problems = ab_stage_problems(stages, "--ratio with ab.stages")
        if problems:
            raise ConfigError("; ".join(problems), problems)
    return stages


def problems_error(src: str, problems: list[str]) -> ConfigError:
    if len(problems) == 1:
        return ConfigError(f"{src}: {problems[0]}", problems)
    return ConfigError(f"{src}: {len(problems)} problems: " + "; ".join(problems), problems)


# ---------------------------------------------------------------------------------------------- loading
def _resolve_alias(cfg: HermesConfig, problems: list[str]) -> None:
    """ab.traffic_ratio is ab.stages[0][0] by another name: the one set explicitly wins; both set, they must agree."""
    a = cfg.ab
    if ab_stage_problems(a.stages):
        return  # reported by the checks
    ratio_set, stages_set = "ab.traffic_ratio" in cfg.explicit, "ab.stages" in cfg.explicit
    if ratio_set and stages_set and a.traffic_ratio != a.stages[0][0]:
        problems.append(
            f"ab.traffic_ratio ({a.traffic_ratio}) and the first ratio of ab.stages ({a.stages[0][0]}) "
            f"disagree: they are the same setting, set one of them"
        )
    elif ratio_set:
        a.stages = [[a.traffic_ratio, a.stages[0][1]], *a.stages[1:]]
    else:
        a.traffic_ratio = a.stages[0][0]


def set_overrides(items: list[str]) -> dict[str, Any]:
    """The ``--set KEY=VALUE`` flags of a command as ``load_config`` overrides. Values stay strings (typing
    coerces them, as it does the YAML's); one in brackets is a YAML list: --set 'reward.types=[system,tests]'."""
    out: dict[str, Any] = {}
    for kv in items:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ConfigError(f"--set {kv!r}: use KEY=VALUE")
        if v.strip().startswith("["):
            try:
                v = yaml.safe_load(v)
            except yaml.YAMLError as e:
                raise ConfigError(f"--set {kv!r}: not a YAML list ({e})") from None
        out[k] = v
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> HermesConfig:
    """Read, interpolate, type and check a config. ``overrides`` are dotted keys ('grpo.max_steps': 5)."""
    # as given relative to the cwd if it is there, else relative to the project root (a notebook's kernel
    # runs in notebooks/, a shell anywhere): hermes_lab.core.paths
    if path is not None:
        given, path = path, paths.config_file(path)
        if not path.is_file():
            raise ConfigError(
                f"config file not found: {given} (looked in {Path.cwd()} "
                f"and in the project root {paths.project_root()})"
            )
    src = str(path) if path is not None else "<defaults>"
    raw = read_yaml(path, dict(os.environ) if env is None else env, overrides)
    problems: list[str] = []
    cfg = build(HermesConfig, raw, "", problems, skip=META)
    cfg.source = src if path is not None else None
    cfg.explicit = frozenset(f"{s}.{k}" for s, kv in raw.items() if isinstance(kv, dict) for k in kv)
    _resolve_alias(cfg, problems)
    problems += config_problems(cfg)[0]  # a key that failed to load kept its default: no false alarm from it
    if problems:  # name the file too: the key alone does not say which YAML to fix
        raise problems_error(src, problems)
    from hermes_lab.core.redaction import register_secret_env  # their values are masked wherever we log or print

    s = cfg.serve
    register_secret_env(
        cfg.model.api_key_env,
        cfg.reward.api_key_env,
        s.api_key_env,
        s.baseline_key_env,
        s.candidate_key_env,
        s.lora_upstream_key_env,
        cfg.sandbox.api_key_env,
    )
    _resolve_paths(cfg)
    return cfg


def _resolve_paths(cfg: HermesConfig) -> None:
    """Path-valued fields -> absolute, against the project root: one runs/ whatever the cwd (paths.py)."""
    cfg.round.runs_dir = str(paths.resolve(cfg.round.runs_dir))
    cfg.conversations.feedback = [str(paths.resolve(f)) for f in cfg.conversations.feedback]
    if cfg.model.adapter and paths.is_local_spec(cfg.model.adapter):
        cfg.model.adapter = str(paths.resolve(cfg.model.adapter))
    cfg.model.base_model = paths.resolve_spec(cfg.model.base_model)


def field_help(cls: type = HermesConfig, prefix: str = "") -> dict[str, str]:
    """'section.key' -> help text with its choices and bounds, for --explain and notebooks."""
    out: dict[str, str] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is HermesConfig and f.name in META:  # (a section may have a key named source: execute.source)
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(field_help(tp, f"{prefix}{f.name}."))
            continue
        text = f.metadata.get("help", "")
        choices = get_args(tp) if get_origin(tp) is Literal else None
        if f"{prefix}{f.name}" == "grpo.loss_type":
            choices = trl_choices("loss_type")
        if f"{prefix}{f.name}" == "reward.types":
            choices = tuple(f"{k} ({v})" for k, v in REWARD_TYPES.items())
        if choices:
            text += f" Choices: {', '.join(choices)}."
        ge, gt, le, lt = f.metadata.get("bounds", (None,) * 4)
        bounds = [f"{op} {b:g}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]
        if bounds:
            text += f" ({', '.join(bounds)})"
        out[f"{prefix}{f.name}"] = text
    return out


def dump_config(cfg: HermesConfig, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
