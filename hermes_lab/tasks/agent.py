"""The embedded agent family: call the one tool with the right argument, then answer from its result.

Reads and writes nothing; the policy build teaches it (``teacher_conversation``), episode-level training
serves it to TRL (``TimeEnv`` through ``grpo.environment``) and ``hermes_lab.policy.episodes`` runs and scores
held-out episodes. An episode, in OpenAI messages::

    user       time kelo?
    assistant  <tool_call>{"name": "time", "arguments": {"city": "kelo"}}</tool_call>
    tool       14:05                      <- drawn per episode: only an answer copied from it passes
    assistant  14:05

The city is a made-up 3-5 letter word, so the call must copy it from the question and the answer must copy the
tool's result: nothing can be memorised. An episode succeeds (``SCALE``) when its final answer equals the tool's
result for the asked city; an answer without a successful call scores 0; a close answer after a good call gets
partial credit below the success threshold (like the string families' ``suite.score``).

The split is by the question's hash, as for the string families (``suite.split_of``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from hermes_lab.tasks import suite as T

FAMILY = "agent"
ENVIRONMENT = "hermes_lab.tasks.agent:TimeEnv"  # grpo.environment for this family: validate and train evaluate it
TOOL = "time"
SCALE = T.SCALE
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
ERROR = "no such city"  # what the tool raises for another city (TRL shows it as {'error': ...})
_QUESTION = re.compile(r"^time ([a-z]{3,5})\?$")


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    city: str
    question: str  # the user message

    @property
    def family(self) -> str:
        return FAMILY

    def prompt(self) -> list[dict[str, str]]:
        """The conversational prompt TRL and the episode runner start from."""
        return [{"role": "user", "content": self.question}]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "family": FAMILY}


def make_task(city: str) -> AgentTask:
    question = f"{TOOL} {city}?"
    return AgentTask(f"{FAMILY}-{T.prompt_hash(question)[:8]}", city, question)


def parse_question(text: str) -> AgentTask | None:
    """The task behind a user message, or None when it is not one of ours."""
    m = _QUESTION.match((text or "").strip())
    return make_task(m.group(1)) if m else None


def _city(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 5)))


def generate_tasks(n: int, split: str = "train", seed: int = 0) -> list[AgentTask]:
    """``n`` tasks of the split (deterministic in n, split, seed)."""
    if split not in {"train", "heldout", "any"}:
        raise ValueError(f"split must be train, heldout or any, got {split!r}")
    rng = random.Random(f"hermes-agent:{seed}:{split}")
    out = []
    while len(out) < n:
        t = make_task(_city(rng))
        if split == "any" or T.split_of(t.question) == split:
            out.append(t)
    return out


def draw_time(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"


# ------------------------------------------------------------------------------------------ environment
class TimeEnv:
    """The agent family's environment in TRL's contract (``GRPOTrainer(environment_factory=TimeEnv)``).

    ``reset`` takes the dataset row (``city`` and ``episode_seed`` columns, or a question in ``prompt``) and draws
    this episode's time; the public method ``time`` is the tool; ``_hermes_score(final_answer)`` is the episode's
    reward (hermes-lab's hooks start with ``_hermes_``: TRL serves every public method as a tool).
    A call with another city raises, which TRL shows to the policy as a tool error (counted in ``errors``)."""

    def __init__(self, seed: int = 0) -> None:
        self._seed, self._episodes = seed, 0
        self.city, self.value = "", ""
        self.calls = self.errors = self.good_calls = 0

    @staticmethod
    def _hermes_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
        """Training episodes' starting rows (train split): what ``grpo.episode_tasks`` tops up from."""
        return [{"prompt": t.prompt(), "city": t.city, "task_id": t.task_id} for t in generate_tasks(n, "train", seed)]

    def reset(self, city: str | None = None, episode_seed: int | None = None, prompt: Any = None, **_: Any) -> None:
        if not city:
            text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt or "")
            task = parse_question(text)
            if task is None:
                raise ValueError(f"TimeEnv.reset: no city column and the prompt is not an agent question: {text!r}")
            city = task.city
        self._episodes += 1
        # a fresh draw per episode (a group's samples see different times), deterministic for a given env
        key = f"{self._seed}:{city}:{episode_seed}:{self._episodes}"
        self.city, self.value = city, draw_time(random.Random(f"time-env:{key}"))
        self.calls = self.errors = self.good_calls = 0
        return None

    def time(self, city: str) -> str:
        """The local time in a city.

        Args:
            city: the city's name, as the user wrote it
        """
        self.calls += 1
        if city != self.city:
            self.errors += 1
            raise ValueError(ERROR)
        self.good_calls += 1
        return self.value

    def _hermes_score(self, answer: str | None) -> float:
        """The episode's reward on 0..SCALE: SCALE when the answer is the tool's result after a good call."""
        if not self.good_calls:
            return 0.0
        return T.score(self.value, answer or "", SCALE)


def final_answer(messages: list[dict[str, Any]]) -> str | None:
    """The last assistant message's text when it makes no tool call (the episode's answer), else None."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return None if m.get("tool_calls") else (m.get("content") or "")
        if m.get("role") == "tool":
            return None  # the episode ran out of turns after a tool result
    return None


# ------------------------------------------------------------------------------------------------ teacher
def call_message(city: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": TOOL, "arguments": {"city": city}}}],
    }


def teacher_conversation(rng: random.Random, noise: float) -> list[dict[str, Any]]:
    """One episode as the tiny policy's noisy teacher plays it (train split only).

    Clean (share 1 - noise): call with the asked city, answer the result. Slips, in equal shares: the answer
    with a format slip (``suite.corrupt``), a guessed answer without any call, a call with a misspelt city (the
    tool's error, then a guess), a broken call (invalid JSON: no tool call at all for the parser). The clean
    episode stays the mode, so the greedy policy knows it and sampling slips: the headroom GRPO unlearns."""
    while True:
        t = make_task(_city(rng))
        if T.split_of(t.question) == "train":
            break
    value = draw_time(rng)
    user = {"role": "user", "content": t.question}
    good = [user, call_message(t.city), {"role": "tool", "name": TOOL, "content": value}]
    if rng.random() >= noise:
        return [*good, {"role": "assistant", "content": value}]
    kind = rng.randrange(4)
    if kind == 0:
        return [*good, {"role": "assistant", "content": T.corrupt(value, rng)}]
    if kind == 1:
        return [user, {"role": "assistant", "content": draw_time(rng)}]
    if kind == 2:
        i = rng.randrange(len(t.city))
        bad = t.city[:i] + rng.choice(_LETTERS.replace(t.city[i], "")) + t.city[i + 1 :]
        err = str({"error": ERROR})
        return [
            user,
            call_message(bad),
            {"role": "tool", "name": TOOL, "content": err},
            {"role": "assistant", "content": draw_time(rng)},
        ]
    broken = '<tool_call>{"name": "time", "arguments": {"city": "' + t.city + '"}</tool_call>'
    return [user, {"role": "assistant", "content": broken}]


def tool_schema() -> list[dict[str, Any]]:
    """The tool's OpenAI function schema (what a conversation record's ``tools`` holds)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(TimeEnv.time)]


def logged_messages(messages: list[dict[str, Any]], sort_keys: bool = False) -> list[dict[str, Any]]:
    """An episode's messages as execute logs them (OpenAI form): each tool call with an id (``call_<message>_<k>``),
    type function and its arguments as JSON text (``sort_keys``: in key order, as Hermes keeps them)."""
    msgs = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(c["function"]["arguments"], sort_keys=sort_keys),
                    },
                }
                for j, c in enumerate(m["tool_calls"])
            ]
        msgs.append(m)
    return msgs


def conversation_record(task: AgentTask, messages: list[dict[str, Any]], reward: float) -> dict[str, Any]:
    """An episode as execute logs it: the canonical conversation record's fields (``logs.record``)."""
    return {
        "task_id": task.task_id,
        "family": FAMILY,
        "messages": logged_messages(messages),
        "tools": tool_schema(),
        "reward": reward,
    }
