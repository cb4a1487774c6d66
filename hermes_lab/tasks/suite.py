"""The embedded task suite: seeded synthetic tasks with verifiers that play "system feedback".

Reads and writes nothing; ``execute`` and the rewards call it. Families, easiest first:

| family    | prompt             | answer          | what it exercises            | levels (graded by)           |
|-----------|--------------------|-----------------|------------------------------|------------------------------|
| upper     | ``up cat=``        | ``CAT``         | string transformation        | 1-3: 3, 4, 5 letters         |
| reverse   | ``rev abcd=``      | ``dcba``        | string transformation        | 1-3: 3, 4, 5 letters         |
| sort      | ``sort 3142=``     | ``1234``        | list transformation          | 1-3: 3, 4, 5 digits          |
| tool      | ``tool time rome=``| ``time(rome)``  | tool-call-like formatting    | 1: one city, 2: two cities   |
| add       | ``add 12+7=``      | ``19``          | small arithmetic             | 1-3: 0, 1 or 2 two-digit operands |
| code      | ``py +3 *2=``      | ``(x+3)*2``     | code checked by hidden tests | 1-3: 1, 2 or 3 operations    |

Levels (``Task.level``) grade each family by length or operand size, so that mastering one level makes the
next reachable: a policy that sorts 4 digits gets 5 right now and then, which is a mixed GRPO group to
learn from, where a policy that fails every 5-digit sort gives no signal at all. The level is a function
of the prompt's input (``level_of``), so a logged prompt knows its level. ``generate_tasks`` cycles the
levels within each family, so every fixed held-out set spans all levels in equal shares.

Reward (0..5, the user's scale), computed from the prompt alone so any response can be scored:
- 5.0 when the response, stripped of surrounding whitespace, equals the answer: "the tests pass";
- otherwise partial credit ``2.5 * similarity`` (difflib ratio between response and answer), so a
  near miss scores more than garbage but never reaches the success threshold 3: success (>= 3) means
  exactly "passed", which keeps pass rate, success rate and the A/B success share the same thing.
- The code family (``hermes_lab.tasks.code``) is the exception that proves it: its response is code, run
  against the task's hidden tests in the local sandbox. 5.0 when every test passes, else ``2.5 * share`` of
  tests passed (a compile error, a timeout or a crash: 0). Any expression the tests accept passes, not only
  the canonical answer. ``score_tasks`` scores many responses at once (the sandbox runs them in parallel and
  runs a repeated response once); ``tests_of`` is the spec a trajectory record carries for the tests reward.

Task ids are ``<family>-<8 hex of sha1(prompt)>``: stable across runs, machines and seeds. The split is
by prompt hash too (``heldout`` when the hash falls in the last 15%), so held-out prompts never appear
in training data whatever the seed.
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from hermes_lab.tasks import code as C

SCALE = 5.0
FAMILIES = ("upper", "reverse", "sort", "tool", "add", "code")
DIFFICULTY = {"upper": 1, "reverse": 2, "sort": 2, "tool": 3, "add": 3, "code": 3}
HELDOUT_SHARE = 15  # percent of the prompt space held out for evaluation

LEVELS = {"upper": 3, "reverse": 3, "sort": 3, "tool": 2, "add": 3, "code": C.LEVELS}  # per family, 1 = easiest

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TOOLS = ("time", "weather", "news", "map")
_CITIES = ("rome", "oslo", "lima", "paris", "tokyo", "cairo", "delhi", "quito", "bern", "seoul", "dakar", "hanoi")
# level 2 of tool (two cities): short names only, so the answer fits the 16-token completion
_SHORT_TOOLS, _SHORT_CITIES = ("time", "news", "map"), ("rome", "oslo", "lima", "bern")
_LENGTHS = {1: (3, 3), 2: (4, 4), 3: (5, 5)}  # letters / digits per level of upper, reverse, sort
_PREFIX = {"upper": "up", "reverse": "rev", "sort": "sort", "tool": "tool", "add": "add", "code": "py"}
_PARSE = re.compile(r"^(up|rev|sort|tool|add|py) (.+)=$")


@dataclass(frozen=True)
class Task:
    task_id: str
    family: str
    prompt: str
    answer: str
    difficulty: int  # the family's (DIFFICULTY)
    level: int = 1  # within the family (LEVELS): by length or operand size

    def to_dict(self) -> dict:
        return asdict(self)


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = _LETTERS) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _make_input(family: str, rng: random.Random, level: int | None = None) -> str:
    """An input of ``family`` at ``level`` (None: a level drawn uniformly)."""
    level = rng.randint(1, LEVELS[family]) if level is None else level
    if not 1 <= level <= LEVELS[family]:
        raise ValueError(f"family {family!r} has levels 1-{LEVELS[family]}, got {level}")
    if family in ("upper", "reverse"):
        return _word(rng, *_LENGTHS[level])
    if family == "sort":
        return _word(rng, *_LENGTHS[level], alphabet="0123456789")
    if family == "tool":
        if level == 1:
            return f"{rng.choice(_TOOLS)} {rng.choice(_CITIES)}"
        return f"{rng.choice(_SHORT_TOOLS)} {' '.join(rng.sample(_SHORT_CITIES, 2))}"
    if family == "add":
        # level = how many operands have two digits (10-49); the others are 0-9
        big = set(rng.sample((0, 1), level - 1))
        a, b = (rng.randint(10, 49) if i in big else rng.randint(0, 9) for i in (0, 1))
        return f"{a}+{b}"
    if family == "code":
        return C.make_input(rng, level)
    raise KeyError(family)


def level_of(family: str, x: str) -> int:
    """The level of an input, from its length or operands (clamped to the family's levels)."""
    if family in ("upper", "reverse", "sort"):
        lvl = next((k for k, (lo, hi) in _LENGTHS.items() if len(x) <= hi), 3)
    elif family == "tool":
        lvl = 1 if len(x.split()) <= 2 else 2
    elif family == "code":
        lvl = C.level_of(x)
    else:
        lvl = 1 + sum(len(op.strip().lstrip("-")) >= 2 for op in x.split("+"))
    return max(1, min(lvl, LEVELS[family]))


def _solve(family: str, x: str) -> str:
    if family == "upper":
        return x.upper()
    if family == "reverse":
        return x[::-1]
    if family == "sort":
        return "".join(sorted(x))
    if family == "tool":
        tool, *args = x.split(" ")
        if not args:
            raise ValueError(f"tool call without an argument: {x!r}")
        return f"{tool}({','.join(args)})"
    if family == "add":
        a, b = x.split("+")
        return str(int(a) + int(b))
    if family == "code":
        if not C.valid(x):
            raise ValueError(f"not a code task input: {x!r}")
        return C.solve(x)
    raise KeyError(family)


def prompt_hash(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()


def split_of(prompt: str) -> str:
    return "heldout" if int(prompt_hash(prompt)[:8], 16) % 100 < HELDOUT_SHARE else "train"


def make_task(family: str, x: str) -> Task:
    prompt = f"{_PREFIX[family]} {x}="
    answer = _solve(family, x)
    return Task(f"{family}-{prompt_hash(prompt)[:8]}", family, prompt, answer, DIFFICULTY[family], level_of(family, x))


def parse_prompt(prompt: str) -> Task | None:
    """The task behind a prompt, or None when the prompt is not one of ours."""
    m = _PARSE.match(prompt.strip())
    if not m:
        return None
    family = {v: k for k, v in _PREFIX.items()}[m.group(1)]
    try:
        return make_task(family, m.group(2))
    except (ValueError, KeyError):
        return None


def check_families(families: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    fams = tuple(families) if families else FAMILIES
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise ValueError(f"unknown task family '{bad[0]}'. Valid families: {', '.join(FAMILIES)}")
    return fams


def generate_tasks(
    n: int, split: str = "train", seed: int = 0, families: list[str] | tuple[str, ...] | None = None
) -> list[Task]:
    """``n`` tasks, round-robin over families and, within a family, over its levels (so any set spans them
    in equal shares); deterministic in (n, split, seed, families)."""
    if split not in {"train", "heldout", "any"}:
        raise ValueError(f"split must be train, heldout or any, got {split!r}")
    fams = check_families(families)
    rng = random.Random(f"hermes-tasks:{seed}:{split}")
    out: list[Task] = []
    for i in range(n):
        fam = fams[i % len(fams)]
        level = 1 + (i // len(fams)) % LEVELS[fam]
        while True:
            t = make_task(fam, _make_input(fam, rng, level))
            if split == "any" or split_of(t.prompt) == split:
                break
        out.append(t)
    return out


def input_of(t: Task) -> str:
    """The task's input: the prompt without its family word and the trailing '='."""
    return t.prompt.split(" ", 1)[1][:-1]


def tests_of(t: Task) -> dict[str, Any] | None:
    """The hidden tests of a code task as a trajectory record carries them (``TestSpec.to_dict``); None for
    the other families, whose verifier is the comparison with the answer."""
    return C.spec(input_of(t)).to_dict() if t.family == "code" else None


def teacher_answer(t: Task, rng: random.Random) -> str:
    """A correct answer as the tiny policy's teacher writes it: for code, another correct form half the time."""
    return C.variant(input_of(t), rng) if t.family == "code" and rng.random() < 0.5 else t.answer


def score_tasks(tasks: list[Task], responses: list[str], scale: float = SCALE) -> list[float]:
    """Verifier rewards of many responses (one per task): code tasks through the sandbox, in parallel."""
    out = [0.0] * len(tasks)
    code_at = [i for i, t in enumerate(tasks) if t.family == "code"]
    for i, t in enumerate(tasks):
        if t.family != "code":
            out[i] = score(t.answer, responses[i], scale)
    if code_at:
        outcomes = C.run_tests([responses[i] for i in code_at], [input_of(tasks[i]) for i in code_at])
        for i, o in zip(code_at, outcomes):
            out[i] = float(scale) if o.kind == "passed" else round(0.5 * scale * o.share, 4)
    return out


def score(answer: str, response: str, scale: float = SCALE) -> float:
    """Verifier reward on 0..scale: ``scale`` when it passes, else 0.5*scale*similarity (< 3 on 5).
    (Not for the code family, whose answer is one of many that pass: ``score_tasks``.)"""
    resp = (response or "").strip()
    if resp == answer:
        return float(scale)
    if not resp:
        return 0.0
    sim = difflib.SequenceMatcher(None, resp, answer).ratio()
    return round(0.5 * scale * sim, 4)


def verify(prompt: str, response: str, scale: float = SCALE) -> float:
    """Reward for any response to one of our prompts; 0 for a prompt we do not know."""
    t = parse_prompt(prompt)
    return 0.0 if t is None else score_tasks([t], [response], scale)[0]


def family_of(prompt: str) -> str | None:
    t = parse_prompt(prompt)
    return None if t is None else t.family


def corrupt(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: what the 'noisy teacher' of the tiny policy says on a share of examples.

    Most (90%) are format slips (a trailing period, quotes, chatter): systematic errors real policies make
    and the kind GRPO is good at removing. The rest are content slips (a swapped, dropped, doubled or
    replaced character), which are harder to unlearn.
    """
    if rng.random() < 0.9:
        return rng.choice([answer + ".", f"'{answer}'", answer + " ok"])
    chars = list(answer)
    kind = rng.randrange(4)
    if kind == 0 and len(chars) >= 2:  # swap two neighbours
        i = rng.randrange(len(chars) - 1)
        if chars[i] != chars[i + 1]:
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
            return "".join(chars)
    if kind == 1 and len(chars) >= 2:  # drop one
        del chars[rng.randrange(len(chars))]
        return "".join(chars)
    if kind == 2:  # duplicate one
        i = rng.randrange(len(chars))
        chars.insert(i, chars[i])
        return "".join(chars)
    i = rng.randrange(len(chars))  # replace one
    pool = "0123456789" if chars[i].isdigit() else (_LETTERS.upper() if chars[i].isupper() else _LETTERS)
    chars[i] = rng.choice([c for c in pool if c != chars[i]] or pool)
    return "".join(chars)
