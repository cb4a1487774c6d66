"""hermes_lab.rewards.registry: the registry, the module:function escape hatch, the NaN/inf guard, the system reward
(= tasks.verify), the local comparison judge, and the API judge through a real HTTP server
(tests/fake_openai.py). Fast: no model, no training."""

from __future__ import annotations

import difflib
import logging
import math
import re
import uuid

import pytest

from hermes_lab.config.schema import REWARD_TYPES, ConfigError, load_config
from hermes_lab.rewards import registry as R
from hermes_lab.tasks import suite as T

from fake_openai import judge_score
from repo_paths import REPO

USER_YAML = REPO / "params" / "hermes_grpo_lora.yaml"
KEY = "sk-test-REWARDS-5c1d9e7a42"


def cfg_with(**overrides):
    return load_config(None, {k.replace("__", "."): v for k, v in overrides.items()})


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A small user module on sys.path (a unique name: sys.modules must not serve a stale copy)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import math\n"
        "CALLS = []\n"
        "NOT_CALLABLE = 3\n"
        "def length_reward(prompts, completions, **kw):\n"
        "    CALLS.append(sorted(kw))\n"
        "    return [float(len(c)) for c in completions]\n"
        "def my_checker(prompts, completions, **kw):\n"
        "    return [5.0 if c.strip() == 'ok' else 1.0 for c in completions]\n"
        "def nan_reward(prompts, completions, **kw):\n"
        "    return [1.0] * (len(completions) - 1) + [math.nan]\n"
        "def inf_reward(prompts, completions, **kw):\n"
        "    return [math.inf] + [1.0] * (len(completions) - 1)\n"
        "def short_reward(prompts, completions, **kw):\n"
        "    return [1.0] * (len(completions) - 1)\n"
        "def none_reward(prompts, completions, **kw):\n"
        "    return [None] * len(completions)\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


# ------------------------------------------------------------------------------------------- registry
def test_registry_names_and_default_functions():
    assert set(R.REGISTRY) == {"system", "comparison", "tests", "tool_call", "group_comparison"}
    assert list(R.REGISTRY) == list(REWARD_TYPES)  # config checks reward.types against the names it declares
    funcs, weights = R.get_reward_funcs(cfg_with())
    assert [f.__name__ for f in funcs] == ["system", "comparison"]  # TRL logs rewards/<name>/mean
    assert weights == [1.0, 1.0]
    funcs, weights = R.get_reward_funcs(load_config(REPO / "params" / "embedded.yaml"))
    assert [f.__name__ for f in funcs] == ["system", "tests", "comparison"] and weights == [1.0, 1.0, 0.25]


def test_unknown_reward_name_lists_valid_names():
    with pytest.raises(ConfigError) as e:  # config.py knows the registry: refused at load, before any stage
        cfg_with(reward__types=["system", "bleu"])
    msg = str(e.value)
    assert "'bleu'" in msg and "reward.types" in msg
    assert "system" in msg and "comparison" in msg and "module:function" in msg
    cfg = cfg_with()
    cfg.reward.types = ["system", "bleu"]  # a config built in code, past the checks: the registry says the same
    with pytest.raises(R.RewardError, match="'bleu'.*system, comparison"):
        R.get_reward_funcs(cfg)


def test_module_function_escape_hatch(user_module):
    funcs, weights = R.get_reward_funcs(
        cfg_with(reward__types=["system", f"{user_module}:length_reward"], reward__weights=[1.0, 0.5])
    )
    assert [f.__name__ for f in funcs] == ["system", "length_reward"] and weights == [1.0, 0.5]
    out = funcs[1](
        prompts=["up cat=", "up dog="], completions=["CAT", "no"], reference=["CAT", "DOG"], ref_reward=[5.0, 5.0]
    )
    assert out == [3.0, 2.0]
    import importlib

    assert importlib.import_module(user_module).CALLS == [["ref_reward", "reference"]]  # dataset columns reach it


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_module_xyz:f", "cannot be imported"),
        ("{mod}:missing", "cannot be imported"),
        ("{mod}:NOT_CALLABLE", "not callable"),
    ],
)
def test_bad_module_function_specs(user_module, spec, match):
    with pytest.raises(R.RewardError, match=match):
        R.get_reward_funcs(cfg_with(reward__types=[spec.format(mod=user_module)]))
    with pytest.raises(ConfigError, match="package.module:function"):  # not even a spec: refused at load
        cfg_with(reward__types=[f"{user_module}:"])


def test_reward_system_module_function(user_module):
    funcs, _ = R.get_reward_funcs(cfg_with(reward__types=["system"], reward__system=f"{user_module}:my_checker"))
    assert funcs[0].__name__ == "system"
    assert funcs[0](prompts=["x", "y"], completions=["ok", "nope"]) == [5.0, 1.0]
    with pytest.raises(R.RewardError, match="reward.system"):
        R.get_reward_funcs(cfg_with(reward__system="no_such_module_xyz:check"))


# ------------------------------------------------------------------------------------------ the guard
@pytest.mark.parametrize("fn, bad", [("nan_reward", "nan"), ("inf_reward", "inf")])
def test_nan_and_inf_rewards_raise_with_diagnosis(user_module, fn, bad):
    funcs, _ = R.get_reward_funcs(cfg_with(reward__types=[f"{user_module}:{fn}"]))
    with pytest.raises(R.RewardError) as e:
        funcs[0](prompts=["up cat=", "up dog="], completions=["CAT", "DOG"])
    msg = str(e.value)
    assert f"reward '{fn}' returned {bad}" in msg
    assert "NaN/inf reward poisons the GRPO advantage" in msg and "normalise or clip" in msg
    assert "up " in msg  # names the prompt that produced it


def test_wrong_length_raises(user_module):
    funcs, _ = R.get_reward_funcs(cfg_with(reward__types=[f"{user_module}:short_reward"]))
    with pytest.raises(R.RewardError, match="returned 2 values for 3 completions"):
        funcs[0](prompts=["a", "b", "c"], completions=["a", "b", "c"])


def test_none_passes_the_guard_and_samples_are_logged(user_module):
    samples = R.SampleLog(maxlen=3)
    samples.step = 7
    funcs, _ = R.get_reward_funcs(cfg_with(reward__types=[f"{user_module}:none_reward", "system"]), samples)
    assert funcs[0](prompts=["p"], completions=["c"]) == [None]
    assert funcs[1](prompts=["up cat=", "up cat="], completions=["CAT", "CA"]) == [5.0, 2.0]
    rows = list(samples.rows)
    assert [r["reward_fn"] for r in rows] == ["none_reward", "system", "system"]
    assert rows[1] == {"step": 7, "reward_fn": "system", "prompt": "up cat=", "completion": "CAT", "reward": 5.0}


# ------------------------------------------------------------------------------------------- system
def test_system_reward_equals_tasks_verify():
    (fn,), _ = R.get_reward_funcs(cfg_with(reward__types=["system"]))
    tasks_ = T.generate_tasks(25, split="any", seed=3)
    prompts, responses = [], []
    for t in tasks_:
        for r in (t.answer, f" {t.answer}\n", t.answer + ".", t.answer[::-1], "", "zzz"):
            prompts.append(t.prompt)
            responses.append(r)
    got = fn(prompts=prompts, completions=responses)
    want = [T.verify(p, r) for p, r in zip(prompts, responses)]
    assert got == want
    assert got.count(5.0) >= 50  # exact answers (stripped) pass; the rest get partial credit below 3
    assert all(v < 3 for v, r, t in zip(got, responses, prompts) if v != 5.0)


def test_system_reward_scale_and_conversational_completions():
    (fn,), _ = R.get_reward_funcs(cfg_with(reward__types=["system"], reward__scale=10))
    t = T.generate_tasks(1, seed=0)[0]
    conv = [[{"role": "assistant", "content": t.answer}]]  # TRL's conversational format
    assert fn(prompts=[t.prompt], completions=conv) == [10.0]


def test_system_reward_none_for_unknown_prompts():
    (fn,), _ = R.get_reward_funcs(cfg_with(reward__types=["system"]))
    out = fn(prompts=["write a poem", "up cat=", "up ="], completions=["roses", "CAT", "x"])
    assert out == [None, 5.0, None]
    # responses with no reference (A/B traffic): unknown prompts count 0
    assert R.score_responses(cfg_with(), ["write a poem", "up cat="], ["roses", "CAT"]) == [0.0, 5.0]


# ----------------------------------------------------------------------------------- local comparison
def _sim(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def test_local_comparison_judge():
    (fn,), _ = R.get_reward_funcs(cfg_with(reward__types=["comparison"], reward__model="local"))
    refs = ["time(rome)", "time(rome)", "time(rome)", "time(rome)", "time(rome)"]
    comps = ["time(rome)", "time(oslo)", "time(rome)", "xyz", "time(oslo)"]
    ref_rewards = [5.0, 5.0, 1.0, 1.0, None]
    out = fn(prompts=["tool time rome="] * 5, completions=comps, reference=refs, ref_reward=ref_rewards)
    # passed reference: similarity * scale
    assert out[0] == 5.0
    assert out[1] == pytest.approx(round(5 * _sim("time(oslo)", "time(rome)"), 4)) and 0 < out[1] < 5
    # failed reference: being like it is penalised, being different earns up to half the scale
    assert out[2] == 0.0
    assert out[3] == pytest.approx(round(2.5 * (1 - _sim("xyz", "time(rome)")), 4)) and out[3] > 2.0
    assert out[3] > out[2]
    # unknown ref_reward: the reference counts as a pass
    assert out[4] == out[1]
    # no reference column: not applicable
    assert fn(prompts=["p", "q"], completions=["a", "b"]) == [None, None]


def test_local_judge_threshold_uses_success_threshold():
    assert R.local_judge("abc", "abc", 3.0, 5, 3.0) == 5.0  # 3 is a success
    assert R.local_judge("abc", "abc", 2.99, 5, 3.0) == 0.0  # just below: a failed reference
    assert R.local_judge("abc", "abc", 4.0, 5, 4.5) == 0.0


# ------------------------------------------------------------------------------------- API comparison
@pytest.fixture
def judge_env(fake_openai, monkeypatch, tmp_path):
    fake_openai.api_key = KEY
    monkeypatch.setenv("TAOTOKEN_BASE_URL", fake_openai.url)
    monkeypatch.setenv("TAOTOKEN_API_KEY", KEY)
    monkeypatch.setenv("HERMES_REWARD_MODEL", "judge-1")
    monkeypatch.setenv("HERMES_POLICY_MODEL", "some/policy")
    return fake_openai


def test_api_comparison_judge_through_the_fake_server(judge_env, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    # the user's YAML as is: reward.model / base_url from the environment, the key from TAOTOKEN_API_KEY
    cfg = load_config(USER_YAML, {"round.runs_dir": str(tmp_path / "runs")})
    assert cfg.reward.model == "judge-1" and cfg.reward.base_url == judge_env.url
    samples = R.SampleLog()
    funcs, _ = R.get_reward_funcs(cfg, samples)
    comparison = funcs[1]
    prompts = ["rev abcd=", "rev abcd=", "sort 3142=", "up cat="]
    comps = ["dcba", "dcab", "4321", "zzz"]
    refs = ["dcba", "dcba", "1234", "CAT"]
    out = comparison(prompts=prompts, completions=comps, reference=refs, ref_reward=[5.0, 5.0, 5.0, 1.0])
    assert out == [float(judge_score(c, r)) for c, r in zip(comps, refs)]
    assert out[0] == 5.0 and out[1] < 5.0
    chats = [r for r in judge_env.requests if r.path == "/v1/chat/completions"]
    assert len(chats) == 4
    for r in chats:
        assert r.headers["authorization"] == f"Bearer {KEY}"
        assert r.body["model"] == "judge-1"
    assert any(
        re.search(r"<<<REFERENCE (\w+)>>>\ndcba\n<<<END REFERENCE \1>>>", r.body["messages"][-1]["content"])
        for r in chats
    )
    tags = {re.search(r"<<<TASK (\w+)>>>", r.body["messages"][-1]["content"])[1] for r in chats}
    assert len(tags) == 4  # a fresh nonce per call: no completion can know the marker that ends its block
    # answers are cached under runs_dir: the same batch again asks nothing
    out2 = comparison(prompts=prompts, completions=comps, reference=refs)
    assert out2 == out and judge_env.count("/v1/chat/completions") == 4
    assert (tmp_path / "runs" / "cache" / "judge.jsonl").is_file()
    # the system reward of the same config still works offline
    assert funcs[0](prompts=["rev abcd="], completions=["dcba"]) == [5.0]
    printed = capsys.readouterr()
    for text in (
        printed.out,
        printed.err,
        caplog.text,
        repr(funcs),
        str(list(samples.rows)),
        (tmp_path / "runs" / "cache" / "judge.jsonl").read_text(),
    ):
        assert KEY not in text


def test_api_comparison_judge_needs_a_reference(judge_env, tmp_path):
    cfg = load_config(USER_YAML, {"round.runs_dir": str(tmp_path)})
    funcs, _ = R.get_reward_funcs(cfg)
    with pytest.raises(R.RewardError, match="'reference' column"):
        funcs[1](prompts=["up cat="], completions=["CAT"])
    assert judge_env.count("/v1/chat/completions") == 0


def test_api_comparison_judge_wrong_key_is_an_auth_error_without_the_key(judge_env, tmp_path, monkeypatch, capsys):
    from hermes_lab.llm import client as api

    wrong = "sk-wrong-REWARDS-0000111122"
    monkeypatch.setenv("TAOTOKEN_API_KEY", wrong)
    cfg = load_config(USER_YAML, {"round.runs_dir": str(tmp_path), "reward.judge_retries": 0})
    funcs, _ = R.get_reward_funcs(cfg)
    with pytest.raises(api.ApiAuthError) as e:
        funcs[1](prompts=["up cat="], completions=["CAT"], reference=["CAT"])
    assert "401" in str(e.value)
    printed = capsys.readouterr()
    for text in (str(e.value), printed.out, printed.err):
        assert wrong not in text and KEY not in text


def test_scores_are_finite_floats_on_scale():
    (fn,), _ = R.get_reward_funcs(cfg_with(reward__types=["system"]))
    ts = T.generate_tasks(10, seed=1)
    out = fn(prompts=[t.prompt for t in ts], completions=[t.answer + "!" for t in ts])
    assert all(isinstance(v, float) and math.isfinite(v) and 0 <= v < 3 for v in out)


# ------------------------------------------------------------------------------------ hardening (issue 16)
def test_a_failed_judgement_falls_back_per_sample_and_is_counted(judge_env, tmp_path):
    """A 429 after the retries used to raise out of the reward function and end training."""
    cfg = load_config(
        USER_YAML,
        {"round.runs_dir": str(tmp_path), "reward.judge_retries": 0, "reward.judge_concurrency": 1},
    )
    funcs, _ = R.get_reward_funcs(cfg)
    comparison = funcs[1]
    faults = R.judge_faults(funcs)
    judge_env.fail_429 = 1  # the first request of the batch fails
    prompts = ["rev abcd="] * 3 + ["up cat="] * 2
    comps, refs = ["dcba", "dcab", "xxxx", "CAT", "CAX"], ["dcba"] * 3 + ["CAT"] * 2
    out = comparison(prompts=prompts, completions=comps, reference=refs)
    siblings = [float(judge_score(c, r)) for c, r in zip(comps[1:3], refs[1:3])]
    assert out[0] == pytest.approx(sum(siblings) / 2)  # its group's mean: the judge moves it neither way
    assert out[1:] == [float(judge_score(c, r)) for c, r in zip(comps[1:], refs[1:])]
    judge_env.chat_reply = "I cannot decide."  # unparsable: a whole group fails
    out = comparison(prompts=["sort 3142="] * 2, completions=["1234", "4321"], reference=["1234"] * 2)
    assert out == [None, None]  # TRL: not applicable, so the group is ranked by the system reward alone
    d = faults.to_dict()
    assert (d["judge_samples"], d["judge_failures"], d["imputed_from_group"], d["system_reward_only"]) == (7, 3, 1, 2)
    assert d["judge_failed_requests"] == 3 and d["by_kind"] == {"ApiStatusError": 1, "JudgeParseError": 2}
    assert "429" in d["first_errors"][0] and KEY not in str(d)


def test_too_many_judge_failures_stop_training_with_a_clear_error(judge_env, tmp_path):
    cfg = load_config(USER_YAML, {"round.runs_dir": str(tmp_path), "reward.max_judge_failure_rate": 0.25})
    funcs, _ = R.get_reward_funcs(cfg)
    judge_env.chat_reply = "no idea"
    prompts = [f"rev {c}=" for c in "abcdefgh"]
    assert funcs[1](prompts=prompts, completions=["x"] * 8, reference=["y"] * 8) == [None] * 8  # 8 < 16: no verdict
    with pytest.raises(
        R.RewardError, match=r"failed on 16 of the last 16 samples \(100% > reward.max_judge_failure_rate 25%\)"
    ):
        funcs[1](prompts=prompts, completions=["z"] * 8, reference=["y"] * 8)
    assert R.judge_faults(R.get_reward_funcs(cfg_with(reward__types=["system"]))[0]) is None  # local: no counter
