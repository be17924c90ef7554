"""Engine outputs → OpenAI response objects: final choices, streaming deltas, logprobs.

Streaming holds back the last ``len(longest stop string) - 1`` characters (and any trailing
U+FFFD of an unfinished UTF-8 sequence) until the request finishes, so the concatenated
deltas always equal the non-streaming text.
"""

from __future__ import annotations

from typing import Any

from kvserve.model.tokenizer import Tokenizer
from kvserve.request import RequestOutput
from kvserve.sampling import Logprob, SamplingParams
from kvserve.server.tools.stream import ToolCallStream


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChoiceState:
    """One output sequence of a response, updated with each engine snapshot."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer | None,
        params: SamplingParams,
        chat: bool,
        return_token_ids: bool = False,
        echo: str = "",
        tools: ToolCallStream | None = None,
    ):
        self.index = index
        self.tools = tools  # reads tool calls out of a chat choice's text
        self._tools_from: int | None = None
        self._echo = echo  # completions ``echo``: the prompt text, sent before the output
        self._echo_sent = not echo
        self.return_token_ids = return_token_ids
        self._ids_sent = 0  # token ids already streamed (with return_token_ids)
        self.prompt_token_ids: list[int] = []
        self.tok = tokenizer
        self.params = params
        self.chat = chat
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.last_token_time: float | None = None
        self._sent = 0  # characters of text already streamed
        self._lp_sent = 0  # logprob entries already streamed
        self._offset = 0  # completions text_offset of the next token
        self._hold = max((len(s) for s in params.stop_strings), default=1) - 1

    def resume_after(self, delivered: list[int], num_chars: int) -> None:
        """The client already has the output tokens ``delivered`` and this many text
        characters: stream only what follows them. A choice whose tool calls are read out
        of its text instead recomputes what the primary had sent — the parse of the
        delivered tokens' text up to the same held-back end — since a router counts only
        content characters, not the tool-call text around them."""
        self._ids_sent = len(delivered)
        self._sent = max(0, num_chars - len(self._echo))  # the client has the echo too
        self._echo_sent = True
        if self.tools is not None and self.tok is not None:
            text = self.tok.decode(delivered, skip_special_tokens=self.params.skip_special_tokens)
            self._sent = self._visible_end(text, 0)
        self._tools_from = self._sent  # the tool-call stream catches up silently

    def delivered_text(self, delivered: list[int]) -> str:
        """The text a client has that received the output tokens ``delivered`` (and
        every delta of theirs): their text up to the end the stream had shown then (not
        the tail a stop string or an unfinished character held back)."""
        if self.tok is None:
            return ""
        text = self.tok.decode(delivered, skip_special_tokens=self.params.skip_special_tokens)
        return text[: self._visible_end(text, 0)]

    def _visible_end(self, text: str, sent: int) -> int:
        """How much of an unfinished output's ``text`` may be sent: all but the tail a stop
        string could still claim and an unfinished UTF-8 character."""
        end = len(text) - self._hold
        while end > sent and text[end - 1] == "\ufffd":
            end -= 1
        return max(end, sent)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, out: RequestOutput) -> dict[str, Any] | None:
        """Take a snapshot; return the streaming delta choice, or None if nothing is new."""
        comp = out.outputs[0]
        self.text, self.token_ids = comp.text, comp.token_ids
        self.prompt_token_ids = out.prompt_token_ids
        self.num_cached_tokens = out.num_cached_tokens
        if comp.logprobs is not None:
            self.logprobs = comp.logprobs
        if out.finished:
            self.finish_reason, self.stop_reason = comp.finish_reason, comp.stop_reason
            end = len(self.text)
        else:
            end = self._visible_end(self.text, self._sent)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            if self._tools_from is not None:  # a resumed stream: what the client has
                self.tools.step(self.text[: self._tools_from], False)
                self._tools_from = None
            delta, calls = self.tools.step(self.text[: max(end, self._sent)], out.finished)
            self.finish_reason = self._reason(self.finish_reason)
        else:
            delta = self.text[self._sent : end] if end > self._sent else ""
        if not self._echo_sent:
            delta, self._echo_sent = self._echo + delta, True
        new_lps = self.logprobs[self._lp_sent :]
        new_ids = self.token_ids[self._ids_sent :] if self.return_token_ids else []
        if not delta and not calls and not new_lps and not new_ids and not out.finished:
            return None
        self._ids_sent = len(self.token_ids)
        first = self._lp_sent
        self._sent = max(self._sent, end)
        self._lp_sent = len(self.logprobs)
        lp = self._render_logprobs(first, new_lps) if self.params.logprobs is not None else None
        if self.chat:
            choice = {
                "index": self.index,
                "delta": {"content": delta} if delta or not calls else {},
                "logprobs": lp,
                "finish_reason": self.finish_reason,
            }
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice = {
                "index": self.index,
                "text": delta,
                "logprobs": lp,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
        if self.return_token_ids:
            choice["token_ids"] = new_ids
        return choice

    @property
    def final_reason(self) -> str | None:
        """The finish reason as the response reports it (``tool_calls`` after calls)."""
        return self._reason(self.finish_reason)

    def _reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for a choice that stopped after calling tools."""
        if reason == "stop" and self.tools is not None and self.tools.called:
            return "tool_calls"
        return reason

    def role_delta(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def final_choice(self) -> dict[str, Any]:
        lp = None
        if self.params.logprobs is not None:
            self._offset = 0
            lp = self._render_logprobs(0, self.logprobs)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
            if self.tools is not None:
                message["content"], calls = self.tools.message(self.text)
                if calls:
                    message["tool_calls"] = calls
            choice = {
                "index": self.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": self._reason(self.finish_reason),
            }
        else:
            choice = {
                "index": self.index,
                "text": self._echo + self.text,
                "logprobs": lp,
                "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason,
            }
        if self.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
        return choice

    # ---- logprobs -----------------------------------------------------------------------
    def _piece(self, token_id: int) -> str:
        if self.tok is None:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (part of a UTF-8 character for byte-level pieces)."""
        if self.tok is None:
            return list(self._piece(token_id).encode())
        return list(self.tok.token_bytes(token_id))

    def _render_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> Any:
        n_top = self.params.logprobs or 0
        if self.chat:
            content = []
            for k, entry in enumerate(entries):
                tid = self.token_ids[first + k]
                piece = self._piece(tid)
                top = sorted(
                    (lp for t, lp in entry.items() if lp.rank <= n_top), key=lambda x: x.rank
                )
                top_ids = sorted(
                    (t for t, lp in entry.items() if lp.rank <= n_top), key=lambda t: entry[t].rank
                )
                content.append(
                    {
                        "token": piece,
                        "logprob": entry[tid].logprob,
                        "bytes": self._bytes(tid),
                        "top_logprobs": [
                            {
                                "token": self._piece(t),
                                "logprob": lp.logprob,
                                "bytes": self._bytes(t),
                            }
                            for t, lp in zip(top_ids, top, strict=True)
                        ],
                    }
                )
            return {"content": content}
        tokens, token_lps, tops, offsets = [], [], [], []
        for k, entry in enumerate(entries):
            tid = self.token_ids[first + k]
            piece = self._piece(tid)
            tokens.append(piece)
            token_lps.append(entry[tid].logprob)
            tops.append(
                {
                    self._piece(t): lp.logprob
                    for t, lp in entry.items()
                    if lp.rank <= n_top or t == tid
                }
            )
            offsets.append(self._offset)
            self._offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
