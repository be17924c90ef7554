"""Engine-core deltas → ``RequestOutput``: incremental detokenization and stop strings.

This runs on the client side of the engine core (the API-server process, or the offline
``LLM`` in-process), so text work never holds the engine core's loop. Contract:

- ``add_request`` registers a request before its first delta arrives.
- ``process(deltas)`` appends each delta's tokens, decodes only the new tail of the text
  (O(new tokens) per step, not O(output)), and checks stop strings in the new text. It
  returns the cumulative ``RequestOutput`` of every request that changed, and the requests
  a stop string ended (``StopStringHit``): the caller must tell the engine core to finish
  them (``LLMEngine.finish_request``) — the core does not see text.
- A finished request's state is dropped; later deltas for it are ignored (the core may
  have produced a token more before it learned of the stop).

Text equals ``tokenizer.decode(output_token_ids)`` once the request finishes: a token that
completes an unfinished UTF-8 sequence waits until the sequence is whole, and whatever is
still pending is flushed at the end. A stop token (EOS, ``stop_token_ids``) is not text
unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.messages import FINISH_STOP, EngineCoreOutput
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import CompletionOutput, RequestOutput
from kvserve.sampling import Logprob, SamplingParams


class IncrementalDetokenizer:
    """Decodes a growing token list a few tokens at a time (the prefix/read-offset method):
    each step decodes ``ids[prefix:]`` and keeps what extends ``ids[prefix:read]``, where
    ``ids[prefix:read]`` are the tokens of the previous chunk (the left context that merges
    spaces and byte tokens the way a whole decode does)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # decoding restarts here (a few tokens before ``_read``)
        self._read = 0  # text of ids[:_read] has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete ("" while a UTF-8 sequence is open)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        # the tokens just emitted are the left context of the next decode
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text of tokens still pending (an unfinished sequence decodes to U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]


@dataclass(frozen=True)
class StopStringHit:
    """A stop string ended a request after ``num_output_tokens`` tokens."""

    request_id: str
    num_output_tokens: int


@dataclass
class _State:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class OutputProcessor:
    """Per-request output state on the client side of the engine core (one thread)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Track a request; ``output_token_ids`` are tokens it already has (a stream resumed
        after a failover continues after them: its outputs include them and their text)."""
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        state = _State(request_id, prompt, prompt_token_ids, params, detok)
        if output_token_ids:
            state.token_ids = list(output_token_ids)
            if detok is not None:
                state.text = detok.push(list(output_token_ids))
        self._states[request_id] = state

    def abort(self, request_id: str) -> None:
        """Forget a request (no-op when unknown)."""
        self._states.pop(request_id, None)

    def process(
        self, deltas: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[StopStringHit]]:
        outputs: list[RequestOutput] = []
        hits: list[StopStringHit] = []
        for d in deltas:
            s = self._states.get(d.request_id)
            if s is None:
                continue
            hit = self._update(s, d)
            if hit is not None:
                hits.append(hit)
            if s.finish_reason is not None:
                del self._states[d.request_id]
            outputs.append(self._output(s))
        return outputs, hits

    def _update(self, s: _State, d: EngineCoreOutput) -> StopStringHit | None:
        p = s.params
        s.token_ids.extend(d.new_token_ids)
        if d.new_logprobs:
            s.logprobs.extend(d.new_logprobs)
        if d.prompt_logprobs is not None:
            s.prompt_logprobs = d.prompt_logprobs
        s.num_cached_tokens = d.num_cached_tokens
        if d.finished:
            s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
        if s.detok is None:
            return None
        new = d.new_token_ids
        token_stopped = d.finish_reason == FINISH_STOP and not p.include_stop_str_in_output
        if token_stopped and new:
            new = new[:-1]  # the stop token (EOS or stop_token_ids) is not text
        prev = len(s.text)
        s.text += s.detok.push(new) if new else ""
        if d.finished:
            s.text += s.detok.flush()
        if not p.stop_strings or (d.finished and d.finish_reason != FINISH_STOP and not new):
            return None
        for stop in p.stop_strings:
            at = s.text.find(stop, max(0, prev - len(stop) + 1))
            if at >= 0:
                s.text = s.text[: at + (len(stop) if p.include_stop_str_in_output else 0)]
                s.finish_reason, s.stop_reason = FINISH_STOP, stop
                return StopStringHit(s.request_id, len(s.token_ids))
        return None

    @staticmethod
    def _output(s: _State) -> RequestOutput:
        p = s.params
        completion = CompletionOutput(
            index=0,
            text=s.text,
            token_ids=list(s.token_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if p.logprobs is not None else None,
        )
        return RequestOutput(
            s.request_id,
            s.prompt,
            s.prompt_token_ids,
            [completion],
            s.finish_reason is not None,
            prompt_logprobs=s.prompt_logprobs if p.prompt_logprobs is not None else None,
            num_cached_tokens=s.num_cached_tokens,
        )
