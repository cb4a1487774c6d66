"""hermes_lab.config.schema: the user's YAML as is, ${VAR} interpolation, unknown keys, bad values, help texts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hermes_lab.config.schema import ConfigError, HermesConfig, field_help, load_config

from repo_paths import REPO

USER_YAML = REPO / "params" / "hermes_grpo_lora.yaml"
EMBEDDED_YAML = REPO / "params" / "embedded.yaml"
CLI = REPO / ".venv" / "bin" / "hermes-lab"
USER_VARS = ("HERMES_POLICY_MODEL", "TAOTOKEN_BASE_URL", "HERMES_REWARD_MODEL")


@pytest.fixture
def user_env(monkeypatch):
    monkeypatch.setenv("HERMES_POLICY_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    monkeypatch.setenv("TAOTOKEN_BASE_URL", "https://api.example.test")
    monkeypatch.setenv("HERMES_REWARD_MODEL", "judge-model-1")


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def run_cli(*args: str, unset: tuple[str, ...] = (), extra_env: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(extra_env or {})
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


# ------------------------------------------------------------------------------------- the user's file
def test_user_file_accepted_as_is_and_typed(user_env):
    cfg = load_config(USER_YAML)
    assert isinstance(cfg, HermesConfig)
    assert cfg.model.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.model.base_url == "https://api.example.test"
    assert cfg.model.api_key_env == "TAOTOKEN_API_KEY"
    assert cfg.reward.model == "judge-model-1"
    assert cfg.reward.base_url == "https://api.example.test"
    assert cfg.grpo.learning_rate == 1e-5 and type(cfg.grpo.learning_rate) is float
    assert cfg.grpo.group_size == 8 and type(cfg.grpo.group_size) is int
    assert cfg.grpo.kl_coefficient == 0.04 and cfg.grpo.clip_range == 0.2 and cfg.grpo.temperature == 0.9
    assert cfg.lora.target_modules == ["q_proj", "v_proj", "k_proj", "o_proj"]
    assert cfg.lora.r == 16 and cfg.lora.lora_alpha == 32 and cfg.lora.bias == "none"
    assert cfg.reward.types == ["system", "comparison"] and cfg.reward.scale == 5
    assert cfg.data.cooldown_hours == 24 and cfg.data.min_samples == 500 and cfg.data.max_seq_len == 4096
    assert cfg.source == str(USER_YAML)


def test_learning_rate_without_dot_is_a_float(tmp_path):
    # PyYAML reads `1e-5` (no dot) as a string: it must still land as a float
    cfg = load_config(write(tmp_path, "grpo:\n  learning_rate: 1e-5\n"))
    assert cfg.grpo.learning_rate == 1e-5 and type(cfg.grpo.learning_rate) is float


def test_embedded_loads_without_env(monkeypatch):
    for name in (*USER_VARS, "TAOTOKEN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(EMBEDDED_YAML)
    assert cfg.model.base_model == "embedded:tiny"
    assert cfg.round.simulated_clock is True
    assert cfg.reward.types == ["system", "tests", "comparison"] and cfg.reward.weights == [1.0, 1.0, 0.25]


def test_overrides_apply_and_are_checked(user_env):
    cfg = load_config(USER_YAML, overrides={"grpo.max_steps": 5, "execute.num_tasks": "40"})
    assert cfg.grpo.max_steps == 5 and cfg.execute.num_tasks == 40
    with pytest.raises(ConfigError, match="grpo.group_size"):
        load_config(USER_YAML, overrides={"grpo.group_size": 1})


# ----------------------------------------------------------------------------------------- env vars
@pytest.mark.parametrize(
    "var,key",
    [("HERMES_POLICY_MODEL", "base_model"), ("TAOTOKEN_BASE_URL", "base_url"), ("HERMES_REWARD_MODEL", "model")],
)
def test_missing_env_var_names_var_key_and_line(user_env, monkeypatch, var, key):
    monkeypatch.delenv(var)
    # the first line of the file that uses it (TAOTOKEN_BASE_URL is used twice)
    line = next(i for i, text in enumerate(USER_YAML.read_text().splitlines(), 1) if "${" + var + "}" in text)
    assert line in (3, 4, 23)
    with pytest.raises(ConfigError) as ei:
        load_config(USER_YAML)
    msg = str(ei.value)
    assert var in msg
    assert f"'{key}'" in msg
    assert f"{USER_YAML}:{line}:" in msg
    assert "\n" not in msg


def test_empty_env_var_counts_as_missing(user_env, monkeypatch):
    monkeypatch.setenv("HERMES_REWARD_MODEL", "")
    with pytest.raises(ConfigError, match="HERMES_REWARD_MODEL"):
        load_config(USER_YAML)


def test_cli_missing_env_var_is_one_line_exit_2():
    r = run_cli("config", "--params", str(USER_YAML), unset=USER_VARS)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "HERMES_POLICY_MODEL" in lines[0] and "base_model" in lines[0]
    assert "hermes_grpo_lora.yaml:3" in lines[0]
    assert "Traceback" not in r.stderr


def test_cli_prints_resolved_user_config():
    r = run_cli(
        "config",
        "--params",
        str(USER_YAML),
        extra_env={
            "HERMES_POLICY_MODEL": "pol-x",
            "TAOTOKEN_BASE_URL": "https://u.test",
            "HERMES_REWARD_MODEL": "rm-y",
            "TAOTOKEN_API_KEY": "sk-secret-123456",
        },
    )
    assert r.returncode == 0, r.stderr
    assert "base_model: pol-x" in r.stdout and "model: rm-y" in r.stdout
    assert "sk-secret-123456" not in r.stdout


def test_default_syntax(tmp_path, monkeypatch):
    monkeypatch.delenv("HERMES_TEST_UNSET_VAR", raising=False)
    p = write(
        tmp_path,
        "model:\n  base_model: ${HERMES_TEST_UNSET_VAR:-embedded:tiny}\ngrpo:\n  max_steps: ${HERMES_TEST_STEPS:-7}\n",
    )
    cfg = load_config(p)
    assert cfg.model.base_model == "embedded:tiny"
    assert cfg.grpo.max_steps == 7
    monkeypatch.setenv("HERMES_TEST_STEPS", "11")
    monkeypatch.setenv("HERMES_TEST_UNSET_VAR", "my/model")
    cfg = load_config(p)
    assert cfg.grpo.max_steps == 11 and cfg.model.base_model == "my/model"


def test_env_argument_replaces_os_environ(tmp_path):
    p = write(tmp_path, "model:\n  base_model: ${ONLY_IN_ARG}\n")
    assert load_config(p, env={"ONLY_IN_ARG": "x/y"}).model.base_model == "x/y"
    with pytest.raises(ConfigError, match="ONLY_IN_ARG"):
        load_config(p, env={})


@pytest.mark.parametrize(
    "text",
    [
        "grpo:\n  group_size: 4  # set ${HERMES_NOT_SET_ANYWHERE} later\n",  # trailing comment
        "# needs ${HERMES_NOT_SET_ANYWHERE}\ngrpo:\n  group_size: 4\n",  # comment at column 0
        "grpo:\n  # ${HERMES_NOT_SET_ANYWHERE}\n  group_size: 4\n",  # indented comment line
    ],
)
def test_var_in_comment_is_not_interpolated(tmp_path, monkeypatch, text):
    monkeypatch.delenv("HERMES_NOT_SET_ANYWHERE", raising=False)
    assert load_config(write(tmp_path, text)).grpo.group_size == 4


def test_var_before_comment_still_interpolated(tmp_path, monkeypatch):
    monkeypatch.delenv("HERMES_NOT_SET_ANYWHERE", raising=False)
    p = write(tmp_path, "model:\n  base_model: ${HERMES_NOT_SET_ANYWHERE}  # ${ALSO_NOT_SET}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "HERMES_NOT_SET_ANYWHERE" in str(ei.value) and "ALSO_NOT_SET" not in str(ei.value)
    assert f"{p}:2:" in str(ei.value)


# -------------------------------------------------------------------------------------- unknown keys
def test_unknown_key_inside_section(tmp_path):
    p = write(tmp_path, "grpo:\n  group_sise: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "group_sise" in msg and "grpo" in msg and str(p) in msg
    assert "Valid keys:" in msg and "group_size" in msg and "kl_coefficient" in msg


def test_unknown_top_level_section(tmp_path):
    p = write(tmp_path, "grpoo:\n  group_size: 4\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "'grpoo'" in msg and str(p) in msg
    for section in ("model", "lora", "grpo", "reward", "data", "execute", "review", "validate", "ab", "round"):
        assert section in msg.split("Valid keys:")[1]


def test_cli_unknown_key_is_one_line_exit_2(tmp_path):
    p = write(tmp_path, "grpo:\n  group_sise: 4\n")
    r = run_cli("config", "--params", str(p))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "group_sise" in lines[0] and "group_size" in lines[0] and "Traceback" not in r.stderr


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "text,key",
    [
        ("grpo:\n  group_size: 1\n", "grpo.group_size"),
        ("grpo:\n  clip_range: 1.5\n", "grpo.clip_range"),
        ("grpo:\n  temperature: 0\n", "grpo.temperature"),
        ("grpo:\n  max_steps: lots\n", "grpo.max_steps"),
        ("grpo:\n  group_size: 8.5\n", "grpo.group_size"),
        ("grpo:\n  learning_rate: fast\n", "grpo.learning_rate"),
        ("lora:\n  target_modules: q_proj\n", "lora.target_modules"),
        ("grpo:\n  use_vllm: maybe\n", "grpo.use_vllm"),
        ("reward:\n  types: [system, comparison]\n  weights: [1.0]\n", "reward.weights"),
        ("data:\n  holdout_fraction: 1.5\n", "data.holdout_fraction"),
    ],
)
def test_bad_value_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text))
    assert key in str(ei.value)


def test_good_values_at_the_edges(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "grpo:\n  group_size: 2\n  temperature: 2\n  clip_range: 0.99\n"
            "reward:\n  types: [system]\n  weights: [2]\n",
        )
    )
    assert cfg.grpo.group_size == 2 and cfg.grpo.temperature == 2.0
    assert cfg.reward.weights == [2.0] and type(cfg.reward.weights[0]) is float


# -------------------------------------------------------------------------------------- help / explain
def test_every_field_has_help():
    helps = field_help()
    assert len(helps) > 50
    empty = [k for k, v in helps.items() if not v.strip()]
    assert not empty, f"fields without help text: {empty}"
    # every key of every section is covered, dotted
    cfg = HermesConfig()
    for sec, vals in cfg.to_dict().items():
        for k in vals:
            assert f"{sec}.{k}" in helps
    assert "source" not in helps


def test_cli_explain_lists_every_key():
    r = run_cli("config", "--explain")
    assert r.returncode == 0, r.stderr
    listed = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert set(field_help()) <= listed


# -------------------------------------------------------------------------------------------- secrets
def test_flat_params_hold_no_secret(user_env, monkeypatch):
    monkeypatch.setenv("TAOTOKEN_API_KEY", "sk-secret-123456")
    for path in (USER_YAML, EMBEDDED_YAML):
        flat = load_config(path).flat_params()
        assert "grpo.learning_rate" in flat and "model.api_key_env" in flat
        assert all("." in k for k in flat)
        leaked = {k: v for k, v in flat.items() if "sk-secret-123456" in str(v)}
        assert not leaked, leaked
        assert flat["model.api_key_env"] == "TAOTOKEN_API_KEY"
        assert flat["reward.api_key_env"] == "TAOTOKEN_API_KEY"
        assert "source" not in flat


# ---------------------------------------------------------------------- checks a round used to hit late
CROSS_FIELD = [  # (YAML, key named in the error): each failed a stage mid-round before it moved here
    ("grpo:\n  max_completion_length: 64\ndata:\n  max_seq_len: 64\n", "grpo.max_completion_length"),  # train
    ("reward:\n  types: [system, bleu]\n", "reward.types entry 'bleu'"),  # train: unknown reward function
    ("reward:\n  system: not a function\n", "reward.system"),  # train / ab / validate scoring
    ("reward:\n  scale: 5\n  success_threshold: 6\n", "reward.success_threshold"),  # nothing could pass
    ("reward:\n  model: judge-1\n  types: [comparison]\n", "reward.base_url"),  # train: the API judge
    ("execute:\n  families: [add, poetry]\n", "execute.families"),  # execute: unknown task family
    ("ab:\n  stages: [[0.3, 100], [0.1, 100]]\n", "ab.stages"),  # ab: a ramp that goes down
    ("ab:\n  stages: [[0.1, 0], [1.0, 0]]\n", "ab.stages"),  # ab: a first stage nobody tests
    ("ab:\n  traffic_ratio: 0.2\n  stages: [[0.1, 7200], [1.0, 0]]\n", "ab.traffic_ratio"),  # guessed before
    ("ab:\n  unit: session\n", "ab.unit"),  # ab: the choices come from the type
    ("review:\n  agreement_metric: within1\n  label_mode: passfail\n", "review.agreement_metric within1"),
    ("review:\n  kappa_weights: cubic\n", "review.kappa_weights"),  # review
    ("data:\n  max_line_bytes: 100\n", "data.max_line_bytes"),  # prep
    ("validate:\n  eval_tasks_per_family: 0\n", "validate.eval_tasks_per_family"),  # validate: empty set
    ("grpo:\n  loss_type: ppo\n", "grpo.loss_type"),  # train: TRL's own list, read from TRL
    ("round:\n  registered_model: it's\n", "round.registered_model"),  # the champion's registry search
    ("model:\n  api_key_env: sk-abc123-secret\n", "model.api_key_env"),  # a pasted key, not a variable name
    ("lora:\n  modules_to_save_learning_rate: 0.08\n", "lora.modules_to_save_learning_rate"),  # nothing at it
    ("lora:\n  modules_to_save_learning_rate: 0\n", "lora.modules_to_save_learning_rate"),  # its bound
]


@pytest.mark.parametrize("text,key", CROSS_FIELD, ids=[k for _, k in CROSS_FIELD])
def test_cross_field_and_late_errors_are_caught_at_load(tmp_path, text, key):
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text))
    assert key in str(ei.value)
    assert "sk-abc123-secret" not in str(ei.value)  # a key pasted by mistake is never echoed


def test_every_problem_is_listed_not_just_the_first(tmp_path):
    text = "grpo:\n  group_size: 1\n  group_sise: 4\nab:\n  unit: session\nreview:\n  min_agreement: 2\n"
    with pytest.raises(ConfigError) as ei:
        load_config(write(tmp_path, text))
    problems = ei.value.problems
    assert len(problems) == 4, problems
    for key in ("group_sise", "ab.unit", "grpo.group_size", "review.min_agreement"):
        assert any(key in p for p in problems), key
    assert "4 problems" in str(ei.value) and "\n" not in str(ei.value)


def test_choices_and_bounds_come_from_the_fields():
    helps = field_help()
    assert "Choices: conversation, request, user." in helps["ab.unit"] and "(>= 2)" in helps["grpo.group_size"]
    from hermes_lab.config.schema import trl_choices

    trl = trl_choices("loss_type")  # read from the installed TRL's GRPOConfig, not a copy of it
    assert trl is not None and {"grpo", "dr_grpo", "dapo", "bnpo"} <= set(trl)
    assert f"Choices: {', '.join(trl)}." in helps["grpo.loss_type"]
    cfg = load_config(None, {"ab.unit": "user", "grpo.loss_type": trl[-1]})
    assert cfg.ab.unit == "user" and cfg.grpo.loss_type == trl[-1]


def test_embedded_warns_when_a_round_cannot_have_enough_samples():
    from hermes_lab.config.check import check_config

    warnings = check_config(load_config(EMBEDDED_YAML, {"execute.num_tasks": 100}))
    assert (
        len(warnings) == 1
        and "execute.num_tasks 100 x execute.samples_per_task 4 < data.min_samples 500" in warnings[0]
    )
    assert check_config(load_config(EMBEDDED_YAML)) == []


@pytest.mark.slow
def test_cli_check_lists_every_problem_and_asks_trl_and_peft(tmp_path, user_env):
    bad = write(tmp_path, "lora:\n  task_type: CAUSAL\ngrpo:\n  use_vllm: true\n  loss_type: dapo\n")
    # three files in one command (one TRL import): the bad one first, and the good ones are still checked
    r = run_cli("config", "--check", "--params", str(bad), "--params", str(USER_YAML), "--params", str(EMBEDDED_YAML))
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip().startswith("error:")]
    assert any("lora.task_type" in e and "CAUSAL_LM" in e for e in errors), r.stderr  # PEFT's TaskType
    assert any("grpo.use_vllm" in e and "vllm is not installed" in e for e in errors), r.stderr
    assert r.stderr.startswith(f"{bad}: ") and "Traceback" not in r.stderr
    oks = [line for line in r.stdout.splitlines() if line.endswith(": ok") or ": ok (" in line]
    # the user's file as is, and the embedded default, pass
    assert [line.split(": ok")[0] for line in oks] == [str(USER_YAML), str(EMBEDDED_YAML)], r.stdout
