"""The prompt of a turn continuing a stored response: the previous turn's own token ids,
then the rest of the conversation's rendering.

The whole conversation is rendered by the chat template as always. When that text begins
with the previous turn's tokens decoded — the usual case: its prompt and output, the
end-of-turn token included (or left out, when it is an EOS the template does not render)
— the prompt is those very tokens followed by the rest of the text tokenized. The engine
then finds the previous turn's KV blocks by their hashes (computed from the same ids)
instead of recomputing the conversation, and the model sees exactly the tokens it
produced. When the rendering no longer begins with them (the instructions or tools
changed, a stop string cut the output, the template rewrites older turns), the rendered
conversation is tokenized whole: correct, with only the prefix cache's ordinary hits.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.protocol import ChatCompletionRequest


def prompt_ids(
    tok: Tokenizer, chat: ChatCompletionRequest, previous: Sequence[int] | None
) -> list[int]:
    """The prompt of ``chat``, continuing ``previous`` (token ids) when it can. Raises
    ValueError (no chat template, a template error)."""
    text = chat.prompt_text(tok)
    # the previous turn as it ran, then without its last token: a stop token the template
    # does not render (an EOS where the template ends a turn with its own marker)
    for ids in (list(previous or ()), list(previous or ())[:-1]):
        if not ids:
            break
        head = tok.decode(ids, skip_special_tokens=False)
        if text.startswith(head):
            return [*ids, *tok.encode(text[len(head) :], add_special_tokens=False)]
    return tok.encode(text, add_special_tokens=False)
