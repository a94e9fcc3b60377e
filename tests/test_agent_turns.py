"""The proxy's turn logic without a model: tool-call parsing (Hermes, Llama-3, malformed calls), and the
chat-template rule: a template that drops an earlier <think> (Qwen3, R1) is detected, and the turn keeps the
recorded prefix or starts a new sequence as `agent.template_rule` says."""

from __future__ import annotations

import json

import pytest

from areal_jax.agents import tool_calls
from areal_jax.agents.messages import RequestError, key, normalize
from areal_jax.agents.prompts import ChatRenderer
from areal_jax.agents.requests import chat_request
from areal_jax.agents.sessions import Session, TokenSequence
from areal_jax.agents.turns import plan_chat
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.tokenizer import HFTokenizer
from tests.test_agent_proxy import tool_tokenizer_dir

# Qwen3's rule, reduced: an assistant turn before the last user message loses its <think>...</think>.
THINK_DROPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and '</think>' in m.content and loop.index0 < ns.last_user %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    tools_dir = tool_tokenizer_dir(tmp_path_factory.mktemp("tools"))
    think_dir = tool_tokenizer_dir(tmp_path_factory.mktemp("think"))
    config = json.loads((think_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_DROPPING_TEMPLATE
    (think_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer.from_dir(tools_dir), HFTokenizer.from_dir(think_dir)


# ---------------------------------------------------------------------------------------------- tool calls


def test_hermes_calls_are_parsed_and_a_malformed_one_is_a_call_the_agent_can_answer():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}\n</tool_call>'
    )
    content, calls = tool_calls.parse(text, "hermes")
    assert content == "Let me compute."
    assert calls == [
        tool_calls.ToolCall("calculator", '{"expression": "6*7"}'),
        tool_calls.ToolCall("lookup", '{"key": "a"}'),
    ]
    _, (bad,) = tool_calls.parse('<tool_call>{"name": "calculator", "arguments": {"expr": 6*7}}</tool_call>', "hermes")
    assert bad.name == "calculator" and bad.error and "6*7" in bad.arguments
    _, (nameless,) = tool_calls.parse("<tool_call>oops</tool_call>", "hermes")
    assert nameless.name == tool_calls.MALFORMED_TOOL and nameless.arguments == "oops"
    _, (cut,) = tool_calls.parse('<tool_call>\n{"name": "calculator", "arguments": {}}', "hermes")
    assert cut.error == "unterminated <tool_call>" and cut.name == "calculator"
    assert tool_calls.parse("no calls here", "hermes") == ("no calls here", [])


def test_llama3_calls_are_parsed():
    content, calls = tool_calls.parse('<|python_tag|>{"name": "lookup", "parameters": {"key": "b"}}', "llama3")
    assert content == "" and calls == [tool_calls.ToolCall("lookup", '{"key": "b"}')]
    _, two = tool_calls.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "llama3")
    assert [c.name for c in two] == ["a", "b"] and two[1].arguments == '{"x": 1}'
    _, (bad,) = tool_calls.parse('{"name": "a", "parameters": {oops', "llama3")
    assert bad.name == "a" and bad.error
    assert tool_calls.parse("The answer is 4.", "llama3") == ("The answer is 4.", [])
    assert tool_calls.resolve_format("auto", "...<|eot_id|>...") == "llama3"
    assert tool_calls.resolve_format("auto", "<|im_start|>") == "hermes"


def test_requests_are_checked_at_the_boundary():
    base = SamplingParams(temperature=1.0, max_new_tokens=8)
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match="temperature"):
        chat_request({"messages": user, "temperature": 0.5}, base, True, max_n=64)
    with pytest.raises(RequestError, match="role"):
        chat_request({"messages": [{"role": "robot", "content": "x"}]}, base, True, max_n=64)
    with pytest.raises(RequestError, match="tool_choice"):
        tools = [{"type": "function", "function": {"name": "calculator"}}]
        chat_request({"messages": user, "tools": tools, "tool_choice": 3}, base, True, max_n=64)
    with pytest.raises(RequestError, match=r"^n: .*\[1, 4\] \(rollout.workflow.agent.max_n\)"):
        chat_request({"messages": user, "n": 5}, base, True, max_n=4)
    with pytest.raises(RequestError, match=r"^tools\[1\].type: got 'web_search'"):
        tools = [{"type": "function", "function": {"name": "a"}}, {"type": "web_search"}]
        chat_request({"messages": user, "tools": tools}, base, True, max_n=64)
    with pytest.raises(RequestError, match=r"^tools\[0\].function"):  # Anthropic's tool shape on the OpenAI route
        chat_request({"messages": user, "tools": [{"name": "a", "input_schema": {}}]}, base, True, max_n=64)
    request = chat_request(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3, "stop": "x"},
        base,
        True,
        max_n=64,
    )
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert request.sampling.max_new_tokens == 3 and request.sampling.stop_strings == ("x",)


# ---------------------------------------------------------------------------------------------- the template rule


def _recorded(tokenizer, history, reply_text):
    """A session holding one recorded turn: `history` answered by the model with `reply_text`."""
    prompt = tokenizer.apply_chat_template(history)
    produced = [*tokenizer.encode(reply_text), tokenizer.eos_id]
    reply = normalize({"role": "assistant", "content": reply_text}, len(history))
    seq = TokenSequence(
        ids=[*prompt, *produced],
        logprobs=[0.0] * len(prompt) + [-1.0] * len(produced),
        versions=[-1] * len(prompt) + [0] * len(produced),
        model=[False] * len(prompt) + [True] * len(produced),
        prompt_length=len(prompt),
        conversation=(*(key(normalize(m, i)) for i, m in enumerate(history)), key(reply)),
        messages=(*(normalize(m, i) for i, m in enumerate(history)), reply),
        produced=tuple(produced),
        turns=1,
    )
    session = Session("s", external=False)
    session.add(None, seq)
    return session, seq


def _next_turn(history, reply_text, *new):
    messages = [*history, {"role": "assistant", "content": reply_text}, *new]
    return chat_request({"messages": messages}, SamplingParams(), True, max_n=64)


def test_a_template_that_keeps_history_continues_the_recorded_ids(tokenizers):
    tokenizer, _ = tokenizers
    history = [{"role": "user", "content": "What is 2+2?"}]
    session, seq = _recorded(tokenizer, history, "<think>add</think>4")
    request = _next_turn(history, "<think>add</think>4", {"role": "user", "content": "Sure?"})
    plan = plan_chat(session, request, ChatRenderer(tokenizer), "split", "hermes")
    assert plan.parent is seq and not plan.diverged
    # the model's own ids, then the rest of the turn end (its eos was produced), the user turn, the prompt
    assert plan.prompt_ids()[: len(seq.ids)] == seq.ids
    assert tokenizer.decode(plan.context) == "\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_drops_an_earlier_think_diverges_and_the_rule_decides(tokenizers):
    _, tokenizer = tokenizers
    history = [{"role": "user", "content": "What is 2+2?"}]
    session, seq = _recorded(tokenizer, history, "<think>add</think>4")
    request = _next_turn(history, "<think>add</think>4", {"role": "user", "content": "Sure?"})
    renderer = ChatRenderer(tokenizer)

    kept = plan_chat(session, request, renderer, "keep_prefix", "hermes")
    assert kept.diverged and kept.parent is seq  # the model sees its own think: one sequence of what it saw
    assert kept.prompt_ids()[: len(seq.ids)] == seq.ids

    split = plan_chat(session, request, renderer, "split", "hermes")
    assert split.diverged and split.parent is None  # a new sequence: the template's own rendering
    assert split.prompt_ids() == tokenizer.apply_chat_template(request.messages)
    assert "add" not in tokenizer.decode(split.prompt_ids())

    # a tool reply is not a new user query: Qwen3 keeps the think, no divergence
    tool_request = _next_turn(history, "<think>add</think>4", {"role": "tool", "content": "4"})
    assert not plan_chat(session, tool_request, renderer, "split", "hermes").diverged


def test_an_edited_history_starts_a_new_sequence(tokenizers):
    tokenizer, _ = tokenizers
    history = [{"role": "user", "content": "What is 2+2?"}]
    session, _ = _recorded(tokenizer, history, "4")
    request = _next_turn(history, "5", {"role": "user", "content": "Sure?"})  # not what the model said
    plan = plan_chat(session, request, ChatRenderer(tokenizer), "keep_prefix", "hermes")
    assert plan.parent is None and plan.prompt_ids() == tokenizer.apply_chat_template(request.messages)
