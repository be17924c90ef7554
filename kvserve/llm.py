"""Offline API shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineArgs
from kvserve.engine.core_client import CoreClient, InprocClient
from kvserve.engine.core_mp import SyncMPClient
from kvserve.engine.gc_heap import freeze_startup_heap, unfreeze_heap
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.messages import (
    Abort,
    AddRequest,
    AddResult,
    FinishStopped,
    Outputs,
    ResetPrefixCache,
)
from kvserve.engine.output import OutputProcessor
from kvserve.engine.requests import encode_prompt
from kvserve.errors import EngineDeadError, EngineError
from kvserve.model.tokenizer import load_tokenizer
from kvserve.request import RequestOutput
from kvserve.sampling import SamplingParams, child_seed

PromptType = str | Sequence[int] | dict[str, Any]


def _normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]  # a single token-id list
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append([int(t) for t in p["prompt_token_ids"]])
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, str):
            out.append(p)
        else:
            out.append([int(t) for t in p])
    return out


class LLM:
    """A ``CoreClient`` plus a run-to-completion loop for batches of prompts.

    Keyword arguments are ``EngineArgs`` fields (``dtype``, ``kv_cache_memory``,
    ``block_size``, ``max_num_seqs`` …). ``engine_process=True`` runs the engine core in
    its own process, as the server does (the same messages, through ZeroMQ); the default
    runs it in this process, where ``engine`` is the ``LLMEngine`` itself.
    """

    def __init__(self, model: str, *, engine_process: bool = False, **kwargs: Any):
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        args = EngineArgs(model=model, **kwargs)
        self.client: CoreClient
        if engine_process:
            self.client = SyncMPClient.start(args)
        else:
            self.client = InprocClient(LLMEngine(args))
        info = self.client.info
        if isinstance(self.client, InprocClient):
            self.tokenizer = self.client.engine.tokenizer
        else:
            self.tokenizer = load_tokenizer(info.model_dir)
        self.outputs = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        freeze_startup_heap()  # no full collections walking the model (close() undoes it)

    @property
    def engine(self) -> LLMEngine:
        """The engine (in-process only; raises AttributeError with ``engine_process``)."""
        if not isinstance(self.client, InprocClient):
            raise AttributeError("the engine runs in its own process (engine_process=True)")
        return self.client.engine

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Flush queued KV store writes and close the store (``kv_store=`` only), stop an
        engine process; give the process's frozen startup objects back to the garbage
        collector."""
        self.client.shutdown()
        unfreeze_heap()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request uses (e.g. before timing a cold run);
        returns how many."""
        return self.client.call(ResetPrefixCache(), int)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}``. Raises
        EngineError (a ValueError) for a prompt the engine refuses; nothing runs on then.
        """
        plist = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(plist)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(plist):
            raise ValueError(f"{len(plist)} prompts but {len(params)} sampling params")
        groups: list[list[str]] = []
        try:
            for prompt, p in zip(plist, params, strict=True):
                groups.append([])  # filled before each send: an abort covers what was sent
                self._add(prompt, p, groups[-1])
            finished = self._run(groups, use_tqdm)
        except BaseException:
            self._abort([rid for ids in groups for rid in ids])
            raise
        return [self._merge(g, finished) for g in groups]

    def _add(self, prompt: str | list[int], p: SamplingParams, rids: list[str]) -> None:
        """Send one prompt's ``n`` sequences to the core; each request id is appended to
        ``rids`` before its send."""
        text = prompt if isinstance(prompt, str) else None
        if text is not None:
            info = self.client.info
            ids = encode_prompt(self.tokenizer, info.model, info.max_model_len, text, p)
        else:
            ids = [int(t) for t in prompt]  # (numpy or torch integers: plain ints)
        base = next(self._counter)
        for i in range(p.n):
            rid = f"{base}-{i}"
            self.outputs.add_request(rid, text, ids, p)
            rids.append(rid)
            self.client.send(AddRequest(rid, ids, p, child_seed(p.seed, i)))

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Read the core's messages until every request finished; raises EngineError when
        the core refused one (the caller aborts the rest)."""
        pending = {rid for ids in groups for rid in ids}
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(pending), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                msg = self.client.get_output()
                if isinstance(msg, AddResult):
                    if msg.error is not None and msg.request_id in pending:
                        raise (RuntimeError if msg.internal else EngineError)(msg.error)
                    continue
                if not isinstance(msg, Outputs):
                    continue
                outs, stops = self.outputs.process(msg.outputs)
                for hit in stops:  # a stop string ended it: the engine stops it now
                    self.client.send(FinishStopped(hit.request_id, hit.num_output_tokens))
                for out in outs:
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        bar.update(1)
        return finished

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests in the core and forget them here (a dead core: nothing to do)."""
        for rid in request_ids:
            self.outputs.abort(rid)
        if request_ids:
            with contextlib.suppress(EngineDeadError):
                self.client.send(Abort(request_ids))

    @staticmethod
    def _merge(ids: list[str], finished: dict[str, RequestOutput]) -> RequestOutput:
        first = finished[ids[0]]
        outputs = []
        for i, rid in enumerate(ids):
            comp = finished[rid].outputs[0]
            outputs.append(dataclasses.replace(comp, index=i))
        rid = ids[0].rsplit("-", 1)[0]
        return RequestOutput(rid, first.prompt, first.prompt_token_ids, outputs, True)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one or more conversations and generate."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"{self.client.info.model} has no tokenizer for chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt, chat_template)
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)
