"""A continuing turn's prompt (``responses.history``): the previous turn's own token ids
then the rest of the rendering — or, when the rendering no longer begins with them, the
conversation tokenized whole. And ``ResponsesRequest.chat``: items → chat messages."""

from __future__ import annotations

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.model.tokenizer import load_tokenizer
from kvserve.server.protocol import ChatMessage
from kvserve.server.responses.history import prompt_ids
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.record import new_response_id, session_of

TOK = load_tokenizer(DEFAULT_MODEL_DIR)


def test_a_turn_continues_from_the_previous_turns_own_tokens():
    first = ResponsesRequest(input="Hello there", instructions="Be brief.")
    prompt = prompt_ids(TOK, first.chat([]), None)
    # the model's output, with its end-of-turn token, tokenized its own way
    output = [*TOK.encode("General Kenobi", add_special_tokens=False), TOK.eos_token_id]
    previous = prompt + output
    history = [ChatMessage(role="user", content="Hello there"),
               ChatMessage(role="assistant", content="General Kenobi")]  # fmt: skip
    second = ResponsesRequest(input="And then?", instructions="Be brief.")
    ids = prompt_ids(TOK, second.chat(history), previous)
    # this template ends a turn with <|end|>, not with the EOS the output stopped at
    assert ids[: len(previous) - 1] == previous[:-1]
    tail = "General Kenobi<|end|><|user|>And then?<|end|><|assistant|>"
    assert TOK.decode(ids, skip_special_tokens=False).endswith(tail)
    # an output that stopped at the template's own end-of-turn token is kept whole
    end = TOK.encode("<|end|>", add_special_tokens=False)
    kept = [*prompt, *output[:-1], *end]
    assert prompt_ids(TOK, second.chat(history), kept)[: len(kept)] == kept
    # new instructions: the conversation is rendered whole (its start differs)
    changed = ResponsesRequest(input="And then?", instructions="Be long.")
    whole = prompt_ids(TOK, changed.chat(history), previous)
    assert whole[: len(previous)] != previous
    assert whole == TOK.encode(changed.chat(history).prompt_text(TOK), add_special_tokens=False)


def test_items_become_chat_messages():
    body = ResponsesRequest.model_validate({
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "instructions": "sys",
        "text": {"format": {"type": "json_object"}},
        "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
    })  # fmt: skip
    chat = body.chat([ChatMessage(role="user", content="before")])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "user", "assistant", "tool"]
    assert chat.messages[2].content == "ab"
    assert [c.id for c in chat.messages[3].tool_calls] == ["c1", "c2"]  # one message
    assert chat.messages[4].tool_call_id == "c1"
    assert chat.response_format.type == "json_object"
    assert chat.tool_choice.function.name == "f"
    # an assistant's text, then its calls (OpenAI's output order): one message
    said = ResponsesRequest.model_validate({"input": [
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]}).chat([])  # fmt: skip
    assert [(m.role, m.content, len(m.tool_calls or [])) for m in said.messages] == [
        ("assistant", "Checking.", 1)
    ]


def test_ids_name_their_conversation():
    first = new_response_id()
    second = new_response_id(first)
    assert first != second and session_of(first) == session_of(second)
    assert session_of(new_response_id()) != session_of(first)
    assert session_of("resp_foreign") is None
    assert session_of(new_response_id("resp_foreign")) is not None
