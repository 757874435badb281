"""Tool-call text <-> messages, malformed output, the oracle, OpenAI wire conversion."""

from __future__ import annotations

import pytest

from apprentice.config import PolicyConfig
from apprentice.policies import make_policy
from apprentice.policies.openai_compat import parse_openai_message, to_openai_messages
from apprentice.policies.oracle import OraclePolicy
from apprentice.policies.toolcalls import (
    assistant_message,
    calls_of,
    parse_assistant,
    render_assistant,
    render_call,
)

ROUND_TRIP = [
    assistant_message("", [{"name": "search", "arguments": {"query": "Velmar river"}}]),
    assistant_message("Opening it.", [{"name": "open", "arguments": {"title": "Ångström \"quoted\""}}]),
    assistant_message("", [{"name": "move", "arguments": {"direction": "up", "steps": 2}},
                           {"name": "answer", "arguments": {"text": "a\nb", "meta": {"k": [1, None, True]}}}]),
    assistant_message("", [{"name": "look", "arguments": {}}]),
    assistant_message("The answer is 42."),
]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_render_parse_round_trip(msg):
    parsed, err = parse_assistant(render_assistant(msg))
    assert err is None
    assert parsed == msg


def test_render_matches_chat_template_and_trl_parser_agrees(smol_tokenizer_dir):
    from trl.chat_template_utils import parse_response

    from apprentice.lm.modeling import load_tokenizer

    tok = load_tokenizer(smol_tokenizer_dir)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for msg in ROUND_TRIP:
        prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template([*history, msg], tokenize=False)
        # what the model must generate to reproduce the template's rendering of msg
        assert full == prompt + render_assistant(msg) + "<|im_end|>\n"
        ids = tok(render_assistant(msg) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        prefix = tok(prompt, add_special_tokens=False)["input_ids"]
        trl_msg = parse_response(tok, ids, prefix=prefix)
        assert calls_of(trl_msg) == calls_of(msg)
        assert (trl_msg.get("content") or "").strip() == msg["content"]


def test_text_after_end_of_turn_is_ignored():
    text = render_call("open", {"title": "X"}) + "<|im_end|>\n<|im_start|>user\n<tool_call>"
    msg, err = parse_assistant(text)
    assert err is None and calls_of(msg) == [("open", {"title": "X"})]


def test_arguments_as_json_string_are_accepted():
    msg, err = parse_assistant('<tool_call>\n{"name": "open", "arguments": "{\\"title\\": \\"X\\"}"}\n</tool_call>')
    assert err is None and calls_of(msg) == [("open", {"title": "X"})]


MALFORMED = {
    "unclosed": ('<tool_call>\n{"name": "open", "arguments": {"title": "X"}}', "unclosed"),
    "stray_close": ('{"name": "open"}</tool_call>', "stray"),
    "bad_json": ('<tool_call>\n{"name": "open", "arguments": {"title": X}}\n</tool_call>', "not valid JSON"),
    "truncated_json": ('<tool_call>\n{"name": "open", "argu\n</tool_call>', "not valid JSON"),
    "list": ('<tool_call>\n["open", {"title": "X"}]\n</tool_call>', "must be an object"),
    "no_name": ('<tool_call>\n{"arguments": {"title": "X"}}\n</tool_call>', "must be an object"),
    "args_not_object": ('<tool_call>\n{"name": "open", "arguments": [1]}\n</tool_call>', "must be an object"),
    "extra_keys": ('<tool_call>\n{"name": "open", "arguments": {}, "id": 3}\n</tool_call>', "unexpected keys"),
    "second_bad": (render_call("look", {}) + '\n<tool_call>\n{oops}\n</tool_call>', "tool call 2"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_output_becomes_parse_error_not_exception(case):
    text, fragment = MALFORMED[case]
    msg, err = parse_assistant(text)
    assert err is not None and fragment in err
    assert "tool_calls" not in msg
    assert msg == {"role": "assistant", "content": text.strip()}


def test_oracle_follows_plan_by_assistant_turn_count():
    plan = [{"name": "search", "arguments": {"query": "q"}}, {"name": "answer", "arguments": {"text": "A"}}]
    conv0 = [{"role": "user", "content": "go"}]
    conv1 = [*conv0, assistant_message("", plan[:1]), {"role": "tool", "name": "search", "content": "r"}]
    conv2 = [*conv1, assistant_message("", plan[1:]), {"role": "user", "content": "more?"}]
    oracle = OraclePolicy()
    t0, t1, t2 = oracle.act([conv0, conv1, conv2], [[], [], []], contexts=[{"oracle_plan": plan}] * 3)
    assert calls_of(t0.message) == [("search", {"query": "q"})]
    assert calls_of(t1.message) == [("answer", {"text": "A"})]
    assert t1.parse_error is None and parse_assistant(t1.raw)[0] == t1.message
    assert not t2.tool_calls and t2.extra["plan_exhausted"]
    with pytest.raises(ValueError, match="oracle_plan"):
        oracle.act([conv0], [[]])


def test_openai_wire_round_trip_assigns_matching_ids():
    conv = [{"role": "user", "content": "u"},
            assistant_message("", [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]),
            {"role": "tool", "name": "a", "content": "ra"}, {"role": "tool", "name": "b", "content": "rb"}]
    wire = to_openai_messages(conv)
    ids = [c["id"] for c in wire[1]["tool_calls"]]
    assert [m["tool_call_id"] for m in wire[2:]] == ids and len(set(ids)) == 2
    assert wire[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'


def test_openai_message_parsing_handles_bad_arguments_and_text_calls():
    ok, err = parse_openai_message({"content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "open", "arguments": '{"title": "X"}'}}]})
    assert err is None and calls_of(ok) == [("open", {"title": "X"})]
    bad, err = parse_openai_message({"content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "open", "arguments": '{"title": '}}]})
    assert err and "not valid JSON" in err and "tool_calls" not in bad
    text, err = parse_openai_message({"content": render_call("look", {})})
    assert err is None and calls_of(text) == [("look", {})]


def test_make_policy_oracle_and_helpful_errors():
    assert make_policy(PolicyConfig(kind="oracle")).policy_id == "oracle"
    with pytest.raises(ValueError, match="needs a model"):
        make_policy(PolicyConfig(kind="hf"))
    with pytest.raises(ValueError, match="base_url"):
        make_policy(PolicyConfig(kind="openai", model="m"))
