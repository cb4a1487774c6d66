"""What a policy argument names: one resolver for every flag that takes a policy or an adapter.

Foundation for the stages that load policies: ab_run (``--baseline`` / ``--candidate``), validate
(``--candidate-adapter`` / ``--baseline-adapter``), train (``--start-adapter``) and execute (``--adapter``),
and the same notebook parameters. Reads ``adapter_config.json`` / ``run.json`` of the directories it is
given, the MLflow registry (alias ``champion`` of ``round.registered_model``) and ``runs/state.json``;
writes only a downloaded champion, under ``<round.runs_dir>/cache/champion-vN/``, when the registry's copy
is not on disk already.

A policy is one of (``POLICY_KINDS``):
- a model dir (``config.json``: a full causal LM, e.g. the tiny policy under runs/policies/);
- a LoRA adapter dir (``adapter_config.json``; its base is read from it);
- a train output dir (``adapter/adapter_config.json`` inside: what ``python -m hermes_lab.train --output``
  wrote; the adapter inside is used);
- a hub id (``org/name``, nothing of that name on disk), ``embedded:tiny``;
- ``champion``: the adapter the registry alias points at, else the champion in runs/state.json, else
  (nothing promoted yet) the base policy, which is what is live then.
Flags that take an adapter accept the adapter kinds only (``ADAPTER_KINDS``). Anything else is a one-line
``ArmError`` naming the flag and the kinds it accepts, before any model is loaded.

    python -m hermes_lab.ab_run --baseline champion --candidate ./checkpoints/round-01 --duration 7200
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_lab.config.schema import EMBEDDED_MODEL, HermesConfig
from hermes_lab.core.command import CommandError
from hermes_lab.core.layout import RoundLayout, RunsLayout, TrainLayout

POLICY_KINDS = (
    "a model dir (config.json), a LoRA adapter dir (adapter_config.json), a train output dir (adapter/ inside), "
    f"a hub id (org/name), {EMBEDDED_MODEL} or champion"
)
ADAPTER_KINDS = "a LoRA adapter dir (adapter_config.json), a train output dir (adapter/ inside) or champion"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ArmError(CommandError):
    """A policy argument that names nothing loadable; the message names the flag and the accepted kinds."""

    def __init__(self, flag: str, spec: str, reason: str, kinds: str = POLICY_KINDS):
        self.flag, self.spec, self.reason, self.kinds = flag, spec, reason, kinds
        super().__init__(f"{flag} {spec!r}: {reason}. {flag} accepts {kinds}")

    def with_flag(self, flag: str) -> ArmError:
        return ArmError(flag, self.spec, self.reason, self.kinds)


@dataclass(frozen=True)
class ArmSpec:
    """A resolved policy: load ``base`` and stack ``adapter`` (None: the bare base) on it."""

    kind: str  # model dir, adapter dir, train output, hub id, embedded, champion
    base: str
    adapter: str | None
    spec: str  # as the user wrote it: reports and MLflow show this
    note: str = ""

    @property
    def label(self) -> str:
        return self.spec


def _adapter_base(adapter: Path) -> str:
    """The base model a PEFT adapter was trained on (adapter_config.json)."""
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{adapter / 'adapter_config.json'}: unreadable ({e})") from None
    return str(cfg.get("base_model_name_or_path") or "")


def _dir_arm(path: Path, spec: str, flag: str, kinds: str) -> ArmSpec:
    if (path / "adapter_config.json").is_file():
        return ArmSpec("adapter dir", _adapter_base(path), str(path), spec)
    adapter = TrainLayout(path).adapter
    if (adapter / "adapter_config.json").is_file():
        return ArmSpec("train output", _adapter_base(adapter), str(adapter), spec)
    if (path / "config.json").is_file():
        return ArmSpec("model dir", str(path), None, spec)
    raise ArmError(
        flag,
        spec,
        f"the directory {path} holds no model (config.json), LoRA adapter (adapter_config.json) or train "
        "output (adapter/adapter_config.json)",
        kinds,
    )


def champion(cfg: HermesConfig) -> tuple[str | None, str]:
    """(adapter dir or None, where it came from): the registry alias, else runs/state.json, else none."""
    from hermes_lab.core.state import FlywheelState, state_path

    adapter, note = _registry_champion(cfg)
    if adapter:
        return adapter, note
    state_champ = FlywheelState.load(state_path(cfg.round.runs_dir)).champion_adapter
    if state_champ and Path(state_champ, "adapter_config.json").is_file():
        return state_champ, f"champion from {state_path(cfg.round.runs_dir)}"
    return None, "no champion promoted yet: the base policy"


def _registry_champion(cfg: HermesConfig) -> tuple[str | None, str]:
    """The MLflow registry's champion adapter on local disk, or (None, why not)."""
    runs = Path(cfg.round.runs_dir)
    lay = RunsLayout(runs)
    # no store yet: nothing was ever registered (and opening one would create it: a second of migrations)
    if not os.environ.get("MLFLOW_TRACKING_URI") and not lay.mlflow_db.is_file():
        return None, "no MLflow store"
    import mlflow
    from mlflow.exceptions import MlflowException

    from hermes_lab.core import tracking

    name = cfg.round.registered_model
    try:
        mlflow.set_tracking_uri(tracking.tracking_uri(runs))
        mv = mlflow.MlflowClient().get_model_version_by_alias(name, "champion")
    except MlflowException as e:
        return None, f"no registry alias 'champion' on {name} ({e.error_code})"
    local = RoundLayout(runs / str(mv.tags.get("round", ""))).train.adapter
    if mv.tags.get("round") and (local / "adapter_config.json").is_file():  # the round's copy is still here
        return str(local), f"registry {name} v{mv.version} (alias champion)"
    dest = lay.champion_cache(mv.version)
    if not (TrainLayout(dest).adapter / "adapter_config.json").is_file():
        mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dest))
    found = next((p.parent for p in dest.rglob("adapter_config.json")), None)
    if found is None:
        return None, f"registry {name} v{mv.version} holds no adapter_config.json"
    return str(found), f"registry {name} v{mv.version} (alias champion), downloaded to {found}"


def resolve_arm(spec: str, flag: str, cfg: HermesConfig, base_dir: str | os.PathLike[str] | None = None) -> ArmSpec:
    """What ``spec`` (a value of ``flag``) names; ArmError otherwise. Relative paths resolve against
    ``base_dir`` (default: the cwd, a shell's convention; notebooks pass the project root)."""
    s = str(spec).strip()
    if not s:
        raise ArmError(flag, s, "is empty")
    if s == EMBEDDED_MODEL:
        return ArmSpec("embedded", s, None, s)
    if s == "champion":
        adapter, note = champion(cfg)
        base = _adapter_base(Path(adapter)) if adapter else cfg.model.base_model
        return ArmSpec("champion", base, adapter, s, note)
    path = Path(os.path.expanduser(s))
    if not path.is_absolute():
        path = Path(base_dir or os.getcwd()) / path
    if path.is_dir():
        return _dir_arm(path, s, flag, POLICY_KINDS)
    if path.exists():
        raise ArmError(flag, s, f"{path} is a file, not a policy directory")
    first = Path(s).parts[0] if Path(s).parts else ""
    local_prefix = first and (Path(base_dir or os.getcwd()) / first).is_dir()
    if _HUB_ID.match(s) and not s.startswith(("./", "../", "~")) and not local_prefix:
        return ArmSpec("hub id", s, None, s)
    raise ArmError(flag, s, f"no such directory ({path})")


def resolve_adapter(
    spec: str | None, flag: str, cfg: HermesConfig, base_dir: str | os.PathLike[str] | None = None
) -> str | None:
    """An adapter flag's value -> the adapter dir (None: empty spec, or 'champion' with none promoted)."""
    if spec is None or not str(spec).strip():
        return None
    try:
        arm = resolve_arm(spec, flag, cfg, base_dir)
    except ArmError as e:
        raise ArmError(flag, e.spec, e.reason, ADAPTER_KINDS) from None
    if arm.kind not in ("adapter dir", "train output", "champion"):
        raise ArmError(flag, arm.spec, f"names a {arm.kind}, not a LoRA adapter", ADAPTER_KINDS)
    return arm.adapter


def load_args(spec: Any) -> tuple[str, str | None]:
    """(base, adapter) for hermes_lab.policy.model.load_policy from an ArmSpec or a (base, adapter) pair."""
    if isinstance(spec, ArmSpec):
        return spec.base, spec.adapter
    base, adapter = spec
    return str(base), adapter


# ---------------------------------------------------------------------------- the round's two policies
def candidate_from_train_dir(train_dir: str | Path, cfg: Any) -> tuple[str, str]:
    """(base model, adapter dir) of a training output: run.json's, else model.base_model and train/adapter."""
    td = Path(train_dir)
    info: dict[str, Any] = {}
    rj = TrainLayout(td).run
    if rj.is_file():
        try:
            info = json.loads(rj.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{rj}: not valid JSON ({e.msg})") from None
    base = info.get("base_model") or cfg.model.base_model
    adapter = info.get("adapter") or str(TrainLayout(td).adapter)
    if not Path(adapter, "adapter_config.json").is_file():
        raise FileNotFoundError(f"candidate adapter not found: {adapter} (no adapter_config.json; did train run?)")
    return str(base), str(adapter)


def resolve_baseline(cfg: Any, explicit: str | None = None) -> tuple[str, str | None]:
    """(base model, adapter) of THE baseline: the policy both gates compare the candidate with -- the
    regression gate here and the A/B stage (``ab.run.resolve_arms``, the round's A/B parameters). An
    explicit adapter, else the live champion (runs/state.json), else model.adapter, else None (bare base)."""
    from hermes_lab.core.paths import project_root
    from hermes_lab.core.state import FlywheelState, state_path

    if explicit:  # an adapter, a train output dir or 'champion' (notebook parameters: project-relative)
        return cfg.model.base_model, resolve_adapter(explicit, "baseline_adapter", cfg, project_root())
    champ = FlywheelState.load(state_path(cfg.round.runs_dir)).champion_adapter
    return cfg.model.base_model, champ or cfg.model.adapter or None


def resolve_baseline_adapter(cfg: Any, explicit: str | None = None) -> str | None:
    """The baseline's adapter (``resolve_baseline``), None for the bare base."""
    return resolve_baseline(cfg, explicit)[1]


# ------------------------------------------------------------------------------------------- the comparison
