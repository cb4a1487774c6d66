"""A user's own chat model, end to end: real families' chat templates and tool-call formats (issue 58).

For qwen2_5, qwen3, llama3_1, llama3_2, gptoss (TRL's templates) and hermes3 (a Hermes 3 style ChatML tool template
TRL does not know: ``model.tool_parser: hermes``), a tiny random model of the family's architecture whose tokenizer
carries its real template and special tokens, teacher-forced to answer 20 conversations with tool calls and, after
the tool results, an answer (tests/families.py). TRL's own GRPOTrainer (tools=the test's functions) plays the
conversations first; its prompt and completion ids are the reference:

- the loop's rendering (``policy.turn``) and reader (``policy.formats``) give TRL's ids and TRL's parse;
- ``hermes-lab serve`` (a real subprocess on 127.0.0.1, the official openai SDK, streamed and not) answers
  ``tool_calls`` equal to TRL's parse of the same tokens, and logs the ids GRPOTrainer sampled, which the turn
  trainer (``train.turns``) takes as they are (slow: a gateway per family);
- a tool-result turn re-rendered is the concatenation TRL trains on, or ``describe`` says it is not;
- a tokenizer without a template, or a template no reader can parse, is a named error (doctor, round start).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from hermes_lab.policy import formats, turn

from families import (
    FAMILIES,
    TOOL_FUNCS,
    build_family,
    conversation,
    tool_results,
    tool_schemas,
    write_script,
)
from repo_paths import REPO

N = 20  # conversations per family
CACHE = Path(tempfile.gettempdir()) / "hermes-lab-families"  # the built families, by recipe hash
TRL_KNOWN = ("qwen2_5", "qwen3", "llama3_1", "llama3_2", "gptoss")


class Played:
    """One family's model dir, tokenizer, script and GRPOTrainer's rollout of the N conversations."""

    def __init__(self, name: str, tmp: Path):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        fam = FAMILIES[name]
        self.name, self.fam = name, fam
        self.dir = tmp / name
        shutil.copytree(build_family(name, CACHE), self.dir)
        tok = AutoTokenizer.from_pretrained(self.dir)
        self.reader = formats.prepare(tok, fam.tool_parser)  # as train.grpo prepares it before GRPOTrainer
        self.tok = tok
        model = AutoModelForCausalLM.from_pretrained(self.dir, trust_remote_code=True)
        self.convs = [conversation(i, fam.multi_call) for i in range(N)]
        users = [[{"role": "user", "content": c["user"]}] for c in self.convs]
        args = GRPOConfig(
            output_dir=str(tmp / f"{name}-trl"),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=300,
            use_cpu=True,
            report_to=[],
            bf16=False,
        )
        tr = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": u} for u in users]),
            processing_class=tok,
            tools=TOOL_FUNCS,
        )
        self.trainer = tr
        stops = set(tr.eos_token_ids)

        def completion(msgs: list[dict], answer: dict) -> list[int]:
            """The family's rendering of ``answer`` after ``msgs``, as tokens the model emits, to its stop token."""
            kw = dict(tools=tool_schemas(), tokenize=False, chat_template=tr.chat_template)
            head = tok.apply_chat_template(msgs, add_generation_prompt=True, **kw)
            full = tok.apply_chat_template([*msgs, answer], **kw)
            assert full.startswith(head), name
            ids = tok(full[len(head) :], add_special_tokens=False)["input_ids"]
            end = next(i for i, t in enumerate(ids) if t in stops)
            return ids[: end + 1]

        from trl.chat_template_utils import parse_response

        script, self.turns = [], []
        for c, u in zip(self.convs, users):
            (p1,), _, _ = tr._tokenize_prompts([u])
            p1 = list(p1)
            c1 = completion(u, {"role": "assistant", "content": "", "tool_calls": c["calls"]})
            msg = parse_response(tok, c1, prefix=p1, tools=TOOL_FUNCS)
            results = tool_results(msg["tool_calls"])
            p2 = p1 + c1 + list(tr._get_tool_suffix_ids(results))
            c2 = completion([*u, msg, *results], {"role": "assistant", "content": c["answer"]})
            answer = parse_response(tok, c2, prefix=p2, tools=TOOL_FUNCS)
            script += [(p1, c1), (p2, c2)]
            self.turns.append(
                SimpleNamespace(user=u, p1=p1, c1=c1, msg=msg, results=results, p2=p2, c2=c2, answer=answer)
            )
        write_script(self.dir, script)
        out = tr._generate_and_score_completions([{"prompt": u} for u in users])
        self.trl = []
        for i in range(N):
            p = [t for t, m in zip(out["prompt_ids"][i].tolist(), out["prompt_mask"][i].tolist()) if m]
            c = [t for t, m in zip(out["completion_ids"][i].tolist(), out["completion_mask"][i].tolist()) if m]
            self.trl.append((p, c))


@pytest.fixture(scope="module", params=list(FAMILIES))
def played(request, tmp_path_factory):
    return Played(request.param, tmp_path_factory.mktemp("families"))


def calls_of(msg: dict) -> list[tuple[str, dict]]:
    """(name, arguments as objects) of a message's tool calls, OpenAI's (arguments as JSON text) or TRL's."""
    out = []
    for c in msg.get("tool_calls") or []:
        f = c["function"] if isinstance(c, dict) else c.function
        name, args = (f["name"], f["arguments"]) if isinstance(f, dict) else (f.name, f.arguments)
        out.append((name, json.loads(args) if isinstance(args, str) else args))
    return out


# ------------------------------------------------------------------------------ the loop renders and reads as TRL
def test_the_loop_renders_and_reads_what_grpotrainer_samples(played):
    """GRPOTrainer's rollout (its _tokenize_prompts, the forced model's completions, its tool loop) is the script;
    the loop's rendering, continuation and reader give the same ids and the same parse, conversation by
    conversation, and the turn trainer's rendered rows are TRL's prompts."""
    from hermes_lab.train.turns import turn_prompts

    tok, tools = played.tok, tool_schemas()
    assert played.reader.source == ("tool_parser:hermes" if played.name == "hermes3" else "trl")
    stable = []
    for t, (trl_p, trl_c) in zip(played.turns, played.trl):
        assert trl_p == t.p1 and trl_c == t.p2[len(t.p1) :] + t.c2  # TRL sampled the script: the reference
        assert turn.prompt_ids(tok, t.user, tools) == t.p1
        mine = turn.parse(tok, t.c1, t.p1, tools, completion_form=False)
        assert calls_of(mine) == calls_of(t.msg) and calls_of(mine)  # TRL's parse, and a call
        assert turn.continue_ids(tok, t.p1, t.c1, t.results) == t.p2
        final = turn.parse(tok, t.c2, t.p2, tools, completion_form=False)
        assert final["content"] == t.answer["content"] and "tool_calls" not in final
        # a record of the conversation without logged tokens: the turn trainer renders its rows
        echoed = turn.chat_message(turn.to_openai(mine, "r"))
        msgs = [*t.user, echoed, *t.results, turn.chat_message(turn.to_openai(final, "s"))]
        rec = {"messages": msgs, "tools": tools, "reward": 1.0}
        rows = turn_prompts(rec, "all", tok, budget=4000)
        assert rows[0]["prompt_ids"] == t.p1 and rows[0]["prompt_source"] == "rendered"
        stable.append(rows[1]["prompt_ids"] == t.p2)  # re-rendered after the tool results: TRL's concatenation?
    # multi-turn with tool results: re-rendering is prefix-stable, or doctor's line names it as not
    assert all(stable) or not any(stable), stable
    assert formats.describe(tok, played.fam.tool_parser)["rerender_stable"] is all(stable)


def test_describe_names_template_reader_tools_and_prefix(played):
    d = formats.describe(played.tok, played.fam.tool_parser)
    want = "custom:" if played.name == "hermes3" else f"trl:{played.name}"
    assert d["template"].startswith(want) and d["error"] is None and d["renders_tools"]
    assert d["reader"] == played.reader.source
    # Qwen3's template drops earlier turns' reasoning: not prefix-preserving, rendered with TRL's training copy
    assert d["prefix_preserving"] is (played.name != "qwen3")
    assert d["render"] == ("trl:qwen3_training" if played.name == "qwen3" else "own")
    assert (played.trainer.chat_template is None) is (d["render"] == "own")


# ------------------------------------------------------------------------------------------- named errors
def test_no_template_and_unknown_format_are_named_errors(tmp_path):
    from transformers import AutoTokenizer

    src = build_family("hermes3", CACHE)
    tok = AutoTokenizer.from_pretrained(src)
    with pytest.raises(formats.ChatFormatError, match=r"unknown_format.*model.tool_parser"):
        formats.check(tok)  # a template TRL does not know, no tool_parser: never answers read as text
    bare = AutoTokenizer.from_pretrained(src)
    bare.chat_template = None
    with pytest.raises(formats.ChatFormatError, match="no_chat_template"):
        formats.check(bare)
    wrong = AutoTokenizer.from_pretrained(src)
    with pytest.raises(formats.ChatFormatError, match="unparseable"):  # Llama's JSON reader on ChatML calls
        formats.check(wrong, "llama3_json")
    d = formats.describe(AutoTokenizer.from_pretrained(src))
    assert d["reader"] is None and "unknown_format" in d["error"]
    with pytest.raises(formats.ChatFormatError, match="unknown_tool_parser"):
        formats.parser_template(tok, "nope")


@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'),
        ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]'),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        ),
    ],
)
def test_each_tool_parser_reads_its_format(parser, text):
    """model.tool_parser's readers (vLLM's names) on the format each parser is named for, closed by the eos."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_family("hermes3", CACHE))
    tok.response_template = formats.parser_template(tok, parser)
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    msg = tok.parse_response(text + tok.eos_token, prefix=prompt)
    assert calls_of(msg) == [("get_weather", {"city": "Oslo", "days": 2})]
    assert tok.parse_response("plain answer" + tok.eos_token, prefix=prompt)["content"] == "plain answer"


# ------------------------------------------------------------------------------------------------- served
@pytest.mark.slow
def test_the_gateway_serves_what_trl_trains(played, tmp_path):
    """hermes-lab serve on the family's model (in-process arm): the openai SDK's tool_calls (streamed and not) are
    TRL's parse of the same tokens; the log's prompt and completion ids are GRPOTrainer's, and the turn trainer
    trains on them as they are."""
    from gateway_process import Gateway
    from openai import OpenAI

    from hermes_lab.config.schema import load_config
    from hermes_lab.logs.gateway import gateway_trajectories
    from hermes_lab.train.turns import trainer_class, turn_prompts

    args = ["--baseline", str(played.dir), "--candidate", str(played.dir), "--ratio", "0"]
    args += ["--set", "model.trust_remote_code=true", "--set", "serve.rollout=false"]
    args += ["--set", f"round.runs_dir={tmp_path / 'runs'}"]
    if played.fam.tool_parser:
        args += ["--set", f"model.tool_parser={played.fam.tool_parser}"]
    gw = Gateway(tmp_path, args).start()
    try:
        client = OpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0)
        for i, t in enumerate(played.turns):
            stream = i % 2 == 1
            first = _ask(client, t.user, stream)
            assert first["finish_reason"] == "tool_calls", (played.name, i, first)
            assert calls_of(first["message"]) == calls_of(t.msg)  # TRL's parse of the same tokens
            results = [
                {"role": "tool", "tool_call_id": c["id"], "content": r["content"]}
                for c, r in zip(first["message"]["tool_calls"], t.results)
            ]
            second = _ask(client, [*t.user, first["message"], *results], stream)
            assert second["message"]["content"] == t.answer["content"] and not second["message"].get("tool_calls")
    finally:
        gw.stop()
    cfg = load_config(None, {"round.runs_dir": str(tmp_path / "runs")})
    gateway_trajectories(gw.log_dir, tmp_path / "joined", cfg)
    lines = [
        json.loads(x) for p in (tmp_path / "joined").glob("*.conversations.jsonl") for x in p.read_text().splitlines()
    ]
    assert len(lines) == N
    by_user = {rec["messages"][0]["content"]: rec for rec in lines}
    rows = []
    for t, (trl_p, trl_c) in zip(played.turns, played.trl):
        rec = by_user[t.user[0]["content"]]
        logged = [x["tokens"] for x in rec["meta"]["turns"]]
        assert logged[0]["prompt_ids"] == trl_p and logged[0]["completion_ids"] == t.c1
        assert logged[1]["prompt_ids"] == trl_p + trl_c[: len(t.p2) - len(t.p1)] and logged[1]["spliced"]
        assert logged[1]["prompt_ids"][len(trl_p) :] + logged[1]["completion_ids"] == trl_c  # GRPOTrainer's
        got = turn_prompts(rec, "all", played.tok, budget=4000)
        assert [r["prompt_source"] for r in got] == ["logged", "logged"]
        assert [r["prompt_ids"] for r in got] == [x["prompt_ids"] for x in logged]
        rows += got
    from datasets import Dataset

    ds = Dataset.from_list(rows)
    loop = trainer_class(ds)
    ids, _, _ = loop._tokenize_prompts(SimpleNamespace(processing_class=played.tok), [r["prompt"] for r in rows])
    assert ids == [r["prompt_ids"] for r in rows]  # the turn trainer samples after the logged tokens


def _ask(client, messages: list[dict], stream: bool) -> dict:
    """One chat completion as {message, finish_reason}; a stream's deltas joined as the SDK's users join them."""
    kw = dict(model="hermes", messages=messages, tools=tool_schemas(), max_tokens=300, temperature=0.9)
    if not stream:
        r = client.chat.completions.create(**kw)
        return {
            "message": r.choices[0].message.model_dump(exclude_none=True),
            "finish_reason": r.choices[0].finish_reason,
        }
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] = d.id or c["id"]
            if d.function:
                c["function"]["name"] += d.function.name or ""
                c["function"]["arguments"] += d.function.arguments or ""
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {"message": msg, "finish_reason": finish}


def _params(tmp_path: Path, base: Path, extra: str = "") -> Path:
    p = tmp_path / "params.yaml"
    runs = tmp_path / "runs"
    p.write_text(f"model:\n  base_model: {base}\n{extra}round:\n  runs_dir: {runs}\n")
    return p


def test_doctor_says_template_reader_tools_and_prefix(tmp_path):
    """doctor's chat format row: PASS with the template, reader, tools and prefix facts; FAIL naming the error."""
    from hermes_lab.cli import doctor
    from hermes_lab.config.schema import load_config

    qwen3 = build_family("qwen3", CACHE)
    c = doctor._format_check(load_config(_params(tmp_path, qwen3)))
    assert c.status == doctor.PASS, c
    assert "template trl:qwen3, reader trl, renders tools, not prefix-preserving" in c.detail
    assert "rendered with trl:qwen3_training" in c.detail
    hermes3 = build_family("hermes3", CACHE)
    c = doctor._format_check(load_config(_params(tmp_path, hermes3)))
    assert c.status == doctor.FAIL and "unknown_format" in c.detail and "reader none" in c.detail
    c = doctor._format_check(load_config(_params(tmp_path, hermes3, "  tool_parser: hermes\n")))
    assert c.status == doctor.PASS and "reader tool_parser:hermes" in c.detail and "custom:" in c.detail
    bare = tmp_path / "bare"
    shutil.copytree(hermes3, bare)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    c = doctor._format_check(load_config(_params(tmp_path, bare)))
    assert c.status == doctor.FAIL and "no_chat_template" in c.detail
    c = doctor._format_check(load_config(_params(tmp_path, tmp_path / "nowhere")))
    assert c.status == doctor.WARN and "no tokenizer on this machine" in c.detail
    assert doctor._format_check(load_config(None)).status == doctor.PASS  # the embedded policy: nothing loaded


def test_a_round_on_an_unreadable_format_stops_before_its_first_stage(tmp_path):
    """The round's start: a named error (one line, exit 2), no round directory made."""
    from hermes_lab.round import runner

    hermes3 = build_family("hermes3", CACHE)
    params = _params(tmp_path, hermes3)
    with pytest.raises(formats.ChatFormatError, match="unknown_format"):
        runner.run_round(str(params), quiet=True)
    assert not list((tmp_path / "runs").glob("round-*"))
    assert runner.main(["--params", str(params)]) == 2


def test_the_documented_vllm_flags_are_the_formats(played):
    """docs/gpu.md's row for the family is formats.vllm_flags; where the loop implements vLLM's parser, that parser
    reads the family's own tool call exactly as TRL's reader does (what vLLM serves is what is trained)."""
    doc = (REPO / "docs" / "gpu.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith(f"| {played.name} "))
    flags = formats.vllm_flags(played.tok, played.fam.tool_parser)
    import trl

    shown = " ".join(flags).replace(str(Path(trl.__file__).parent), "<trl>")
    assert f"`{shown}`" in row and played.reader.source in row
    parser = flags[flags.index("--tool-call-parser") + 1]
    if parser in formats.TOOL_PARSERS:
        from transformers import AutoTokenizer

        other = AutoTokenizer.from_pretrained(played.dir)
        other.response_template = formats.parser_template(other, parser)
        for t in played.turns[:6]:
            assert calls_of(other.parse_response(t.c1, prefix=t.p1)) == calls_of(t.msg)
