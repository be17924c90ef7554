"""A chat request's tools, tool calls and tool results → the chat template's messages.

A template that takes ``tools`` (it names the variable: Qwen, Llama 3.1+, Mistral, Hermes
…) gets them as HF's ``apply_chat_template`` passes them: ``tools`` as OpenAI function
definitions, assistant ``tool_calls`` with their arguments as objects, ``tool`` messages
with their ``tool_call_id``. A template that does not (SmolLM2, the bundled model) gets a
system message listing the tools and the Hermes ``<tool_call>`` format, the assistant's
earlier calls written in that format, and tool results as the ``tool`` role's text — so
any chat model can be offered tools, and ``auto`` reads what it writes with the Hermes
parser.
"""

from __future__ import annotations

import json
from typing import Any

_TOOLS_PROMPT = """You can call functions to help answer. Their signatures, as JSON:
<tools>
{tools}
</tools>
To call one, write a JSON object with the function's name and its arguments between \
<tool_call> and </tool_call>, like this:
<tool_call>
{{"name": "function_name", "arguments": {{"argument": "value"}}}}
</tool_call>
You may make several calls, each in its own <tool_call> block."""


def takes_tools(template: str | None) -> bool:
    """Does the chat template render a ``tools`` variable?"""
    return template is not None and "tools" in template


def arguments_object(arguments: str) -> Any:
    """A call's arguments (JSON text) as the object templates expect; the text itself
    when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that offers ``tools`` to a model whose template does not."""
    return _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def written_calls(calls: list[dict[str, Any]]) -> str:
    """Earlier tool calls of the assistant, written as the tools prompt asks."""
    return "".join(
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in calls
    )


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> None:
    """Offer ``tools`` in the first system message (one is added when there is none)."""
    text = tools_prompt(tools)
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}".lstrip()
    else:
        messages.insert(0, {"role": "system", "content": text})
