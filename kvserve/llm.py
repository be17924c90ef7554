"""Offline API shaped like vLLM's: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from kvserve.config import EngineArgs
from kvserve.engine.gc_heap import freeze_startup_heap, unfreeze_heap
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output import OutputProcessor
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
                out.append(list(p["prompt_token_ids"]))
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
    """An engine plus a run-to-completion loop for batches of prompts.

    Keyword arguments are ``EngineArgs`` fields (``dtype``, ``kv_cache_memory``,
    ``block_size``, ``max_num_seqs`` …).
    """

    def __init__(self, model: str, **kwargs: Any):
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(EngineArgs)}
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.outputs = OutputProcessor(self.engine.tokenizer)
        self._counter = itertools.count()
        freeze_startup_heap()  # no full collections walking the model (close() undoes it)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Flush queued KV store writes and close the store (``kv_store=`` only); give the
        process's frozen startup objects back to the garbage collector."""
        self.engine.close()
        unfreeze_heap()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is text, a list of token ids, or ``{"prompt_token_ids": [...]}``.
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
                base = next(self._counter)
                ids = []
                for i in range(p.n):
                    rid = f"{base}-{i}"
                    seed = child_seed(p.seed, i)
                    req = self.engine.add_request(rid, prompt, p, seed=seed)
                    self.outputs.add_request(rid, req.prompt, req.prompt_token_ids, p)
                    ids.append(rid)
                groups.append(ids)
        except Exception:
            for ids in groups:
                for rid in ids:
                    self.engine.abort_request(rid)
                    self.outputs.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups)
        with tqdm(total=total, desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                outs, stops = self.outputs.process(self.engine.step())
                for hit in stops:  # a stop string ended it: the engine stops it now
                    self.engine.finish_request(hit.request_id, hit.num_output_tokens)
                for out in outs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [self._merge(g, finished) for g in groups]

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
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"{self.engine.model_config.model} has no tokenizer for chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt, chat_template)
            prompts.append(tok.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm)
