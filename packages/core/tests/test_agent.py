"""The built-in multi-turn agent loop over a scripted engine: tool-call parsing, tools that work, raise
or hang, the loss mask, the episode's end, and that the sampled ids reach the sample unchanged."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from slime_rl.core.agent import MultiTurnGenerate, TurnTemplate, call_tool, load_tools, parse_tool_calls
from slime_rl.core.agent.tool_calls import ToolCall
from slime_rl.core.contracts import GenerateOutput, SamplingParams
from slime_rl.core.infra.plugins import PluginError
from slime_rl.core.sample import Sample, SampleStatus
from slime_rl.core.testing import chat_tokenizer
from slime_rl.core.testing.standins import FixedWeightsEngine

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- parsing


def test_parse_tool_calls_reads_hermes_blocks():
    text = ('I will add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("add", {"a": 2, "b": 3}, None), ("python", {"code": "print(1)"}, None)]
    assert parse_tool_calls("The answer is 5.") == []


@pytest.mark.parametrize("body,expect", [("{not json", "not valid JSON"), ('{"arguments": {}}', 'no "name"'),
                                         ('{"name": "add", "arguments": [1]}', "must be a JSON object")])
def test_parse_tool_calls_keeps_malformed_calls_with_the_reason(body, expect):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert expect in call.error


# ---------------------------------------------------------------- tools


def test_load_tools_names_them_by_attribute():
    tools = load_tools(["agent_tools:add", "agent_tools:slow_echo"])
    assert sorted(tools) == ["add", "slow_echo"]


@pytest.mark.parametrize("specs,expect", [
    (["agent_tools:add", "agent_tools:add"], "already listed"),
    (["agent_tools:not_callable"], "not a callable"),
    (["agent_tools:nope"], "has no attribute"),
    (["calculator"], "give `module:attr`"),
])
def test_load_tools_refuses_bad_entries_naming_them(specs, expect):
    with pytest.raises(PluginError, match=r"rollout.tools\[\d\]") as err:
        load_tools(specs)
    assert expect in str(err.value)


def test_tool_schemas_come_from_signatures_and_docstrings():
    from slime_rl.core.agent import tool_schemas

    (schema,) = tool_schemas(load_tools(["agent_tools:add"]))
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two numbers."
    assert schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "integer", "description": "the second number"}}


def test_builtin_python_tool_runs_the_models_code_in_the_sandbox():
    """A model's ``python`` call runs as another user in its own process: its output is the observation,
    and code that fails or hangs ends as an error text, never as an exception in the rollout."""
    from slime_rl.core.config import Config

    cfg = Config.model_validate({"rollout": {"sandbox": {"timeout_s": 2.0}}})
    tools = load_tools(["python"], cfg)

    async def calls():
        return await asyncio.gather(
            call_tool(tools, ToolCall("python", {"code": "import os; print(6 * 7, os.getuid() != 0)"}), 10),
            call_tool(tools, ToolCall("python", {"code": "while True: pass"}), 10),
            call_tool(tools, ToolCall("python", {"code": "raise ValueError('nope')"}), 10))

    ok, hung, raised = asyncio.run(calls())
    assert ok.text.strip() == "42 True" and not ok.error
    assert "timeout" in hung.text and "ValueError: nope" in raised.text


def test_call_tool_turns_every_failure_into_an_error_observation():
    tools = load_tools(["agent_tools:add", "agent_tools:slow_echo", "agent_tools:explode", "agent_tools:hang",
                        "agent_tools:hang_async"])

    async def calls():
        return await asyncio.gather(
            call_tool(tools, ToolCall("add", {"a": 2, "b": 3}), 5),
            call_tool(tools, ToolCall("slow_echo", {"text": "hi"}), 5),
            call_tool(tools, ToolCall("explode"), 5),
            call_tool(tools, ToolCall("hang"), 0.2),
            call_tool(tools, ToolCall("hang_async"), 0.2),
            call_tool(tools, ToolCall("add", {"c": 1}), 5),
            call_tool(tools, ToolCall("search", {}), 5),
            call_tool(tools, ToolCall("", error="the tool call is not valid JSON"), 5),
        )

    results = run(calls())
    assert [(r.text, r.error) for r in results[:2]] == [("5", False), ("hi", False)]
    assert results[2].text == "error: RuntimeError: the tool broke"
    assert results[3].text == "error: hang timed out after 0.2 s"
    assert results[4].text == "error: hang_async timed out after 0.2 s"
    assert results[5].text.startswith("error: TypeError:") and "'c'" in results[5].text
    assert results[6].text.startswith("error: no tool named 'search'")
    assert results[7].text == "error: the tool call is not valid JSON"
    assert all(r.error for r in results[2:])


# ---------------------------------------------------------------- the template


def test_turn_template_learns_chatml_closing(tok):
    template = TurnTemplate.from_tokenizer(tok)
    assert template.end_of_turn_ids == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert (template.closing, template.after_end_of_turn) == ("<|im_end|>\n", "\n")
    text = template.observation_text([{"role": "tool", "name": "add", "content": "5"}], ended_on_end_of_turn=True)
    assert text == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert template.observation_text([{"role": "tool", "content": "5"}], ended_on_end_of_turn=False).startswith(
        "<|im_end|>\n<|im_start|>tool")


# ---------------------------------------------------------------- the episode


class TextEngine(FixedWeightsEngine):
    """Answers turn k of every episode with ``turns[k]`` (text, tokenised here as the model's ids) followed by
    the end-of-turn id; records every request."""

    served_version = 3

    def __init__(self, tok, turns: list[str], *, end_with_eot: bool = True):
        self.tok, self.turns, self.end_with_eot = tok, turns, end_with_eot
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, input_ids, params, request_id=None):
        k = sum(1 for rid, _, _ in self.requests if rid.split("/")[0] == request_id.split("/")[0])
        self.requests.append((request_id, list(input_ids), params))
        ids = self.tok.encode(self.turns[min(k, len(self.turns) - 1)], add_special_tokens=False)
        if self.end_with_eot:
            ids.append(self.tok.eos_token_id)
        reason = "stop"
        if len(ids) > params.max_new_tokens:
            ids, reason = ids[:params.max_new_tokens], "length"
        self.sampled.append(ids)
        return GenerateOutput(ids, [-0.25] * len(ids), reason, 3, cached_tokens=len(input_ids) // 2)


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
PARAMS = SamplingParams(max_new_tokens=200)


def _prompt(tok) -> Sample:
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                   tokenize=False)
    return Sample(index=7, tokens=tok.encode(text, add_special_tokens=False))


def test_episode_appends_sampled_ids_unchanged_and_masks_observations(tok):
    engine = TextEngine(tok, [CALL, "The answer is 5."])
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:add"]), max_turns=4, tool_timeout=5)
    sample = _prompt(tok)
    prompt = list(sample.tokens)
    out = run(agent(sample, PARAMS, engine))
    assert out.status == SampleStatus.COMPLETED
    assert out.metadata | {} == {**out.metadata, "episode_end": "final_answer", "turns": 2, "tool_calls": 1,
                                 "tool_errors": 0}
    first, second = engine.sampled
    response = out.response_tokens
    observation = response[len(first):len(response) - len(second)]
    assert response == first + observation + second  # the engine's ids, as sampled
    assert out.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert out.rollout_log_probs == [-0.25] * len(first) + [0.0] * len(observation) + [-0.25] * len(second)
    assert tok.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    # the second turn's input is the whole trajectory so far, and both turns share a session
    assert engine.requests[1][1] == prompt + first + observation
    assert [rid.split("/")[1] for rid, _, _ in engine.requests] == ["1", "2"]
    assert len({rid.split("/")[0] for rid, _, _ in engine.requests}) == 1
    # each turn may stop on the end-of-turn id or the tool-call close
    params = engine.requests[0][2]
    assert "</tool_call>" in params.stop and tok.eos_token_id in params.stop_token_ids
    assert out.weight_version == 3
    assert out.metadata["cached_tokens"] == sum(len(ids) // 2 for _, ids, _ in engine.requests)
    # the whole trajectory is what the template renders for the same conversation
    conversation = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5."}]
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(out.tokens) + "\n" == rendered


def test_episode_ends_at_max_turns(tok):
    engine = TextEngine(tok, [CALL])
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:add"]), max_turns=3, tool_timeout=5)
    out = run(agent(_prompt(tok), PARAMS, engine))
    assert (out.status, out.metadata["episode_end"], out.metadata["turns"]) == (SampleStatus.COMPLETED, "max_turns", 3)
    assert out.metadata["tool_calls"] == 2  # the last turn's call never runs: nobody would read its result
    assert len(engine.requests) == 3


def test_episode_ends_at_the_context_limit(tok):
    engine = TextEngine(tok, [CALL])
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:add"]), max_turns=10, tool_timeout=5)
    out = run(agent(_prompt(tok), SamplingParams(max_new_tokens=60), engine))
    assert (out.status, out.metadata["episode_end"]) == (SampleStatus.TRUNCATED, "context_limit")
    assert out.response_length <= 60


def test_tool_that_hangs_or_raises_becomes_the_observation(tok):
    hang = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    engine = TextEngine(tok, [hang, '<tool_call>{"name": "explode", "arguments": {}}</tool_call>', "done"])
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:hang", "agent_tools:explode"]), max_turns=4,
                              tool_timeout=0.2)
    out = run(agent(_prompt(tok), PARAMS, engine))
    assert (out.status, out.metadata["episode_end"], out.metadata["tool_errors"]) == (
        SampleStatus.COMPLETED, "final_answer", 2)
    text = tok.decode(out.response_tokens)
    assert "error: hang timed out after 0.2 s" in text and "error: RuntimeError: the tool broke" in text


def test_turn_stopped_on_tool_call_close_gets_the_closing_as_observation(tok):
    engine = TextEngine(tok, [CALL, "5"], end_with_eot=False)
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:add"]), max_turns=4, tool_timeout=5)
    out = run(agent(_prompt(tok), PARAMS, engine))
    first = engine.sampled[0]
    observation = out.response_tokens[len(first):len(first) + out.loss_mask.count(0)]
    assert tok.decode(observation).startswith("<|im_end|>\n<|im_start|>tool\n5")


def test_aborted_episode_restarts_from_its_prompt(tok):
    engine = TextEngine(tok, ["The answer is 5."])
    agent = MultiTurnGenerate(tok, {}, max_turns=2)
    sample = _prompt(tok)
    prompt = list(sample.tokens)
    sample.append_response([5, 6], [-1.0, -1.0], trained=True)
    sample.status = SampleStatus.ABORTED
    out = run(agent(sample, PARAMS, engine))
    assert engine.requests[0][1] == prompt
    assert out.response_tokens == engine.sampled[0]


# ---------------------------------------------------------------- config and the rollout


def test_tools_without_the_agent_loop_are_refused():
    from slime_rl.core.config import Config, ConfigError, check_config

    cfg = Config.model_validate({"data": {"source": "agent_tools:add"}, "rollout": {"tools": ["agent_tools:add"]}})
    with pytest.raises(ConfigError, match="rollout.tools: only the built-in agent loop calls tools; set"
                                          " rollout.generate_fn=multi_turn"):
        check_config(cfg)


def test_rollout_runner_builds_multi_turn_and_reports_episode_metrics(tok, monkeypatch):
    from slime_rl.core.config import Config
    from slime_rl.core.run import rollout

    cfg = Config.model_validate({"rollout": {"generate_fn": "multi_turn", "tools": ["agent_tools:add"],
                                             "max_turns": 3, "max_response_len": 200}})
    with pytest.raises(PluginError, match="multi_turn renders tool results with the model's tokenizer"):
        rollout.RolloutRunner(cfg, TextEngine(tok, [CALL]), tok.decode)
    runner = rollout.RolloutRunner(cfg, TextEngine(tok, [CALL, "5"]), tok.decode, tok)
    assert isinstance(runner.generate_fn, MultiTurnGenerate) and runner.generate_fn.max_turns == 3
    samples = [run(runner.generate_fn(_prompt(tok), PARAMS, runner.engine)) for _ in range(2)]
    for s in samples:
        s.reward = 1.0
    metrics = runner._metrics([samples], 1.0)
    assert metrics["rollout/turns_mean"] == 2 and metrics["rollout/tool_calls_mean"] == 1
    assert metrics["rollout/episode_end_final_answer_frac"] == 1 and metrics["rollout/tool_error_frac"] == 0
    prompt = sum(s.metadata["prompt_tokens"] for s in samples)
    assert metrics["rollout/prefix_cache_hit_rate"] == pytest.approx(
        sum(s.metadata["cached_tokens"] for s in samples) / prompt)


def test_a_turn_with_several_calls_gets_all_results_in_order(tok):
    two = CALL + '<tool_call>{"name": "slow_echo", "arguments": {"text": "hi"}}</tool_call>'
    engine = TextEngine(tok, [two, "done"])
    agent = MultiTurnGenerate(tok, load_tools(["agent_tools:add", "agent_tools:slow_echo"]), max_turns=3,
                              tool_timeout=5, stop_on_tool_call=False)
    out = run(agent(_prompt(tok), PARAMS, engine))
    assert "</tool_call>" not in engine.requests[0][2].stop
    assert out.metadata["tool_calls"] == 2 and out.metadata["episode_end"] == "final_answer"
    observation = [t for t, m in zip(out.response_tokens, out.loss_mask, strict=True) if m == 0]
    assert tok.decode(observation) == ("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\nhi<|im_end|>\n"
                                       "<|im_start|>assistant\n")
