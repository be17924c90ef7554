"""A rank's own copy of the requests it runs: their tokens, block tables and what their
sampler rows need, kept up to date from each step's ``SchedulerOutput`` deltas.

``RankRequests.apply`` is the first thing a rank does with a step: forget the finished
requests, take the new ones whole, append the known ones' new tokens and blocks (or take
their tables whole when they changed otherwise). Every rank applies the same outputs in
the same order, so every rank's copy equals the scheduler's view of the ranks
(``sched.rank_view``) after the step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvserve.sampling import SampleRow
from kvserve.sched.output import NewRequestData, SchedulerOutput


@dataclass
class RankRequest(NewRequestData):
    """One request as a rank knows it: the fields it came with (``token_ids`` prompt then
    output, ``block_ids`` one table per KV group), kept up to date by ``apply``."""

    @classmethod
    def of(cls, new: NewRequestData) -> RankRequest:
        """This rank's copy of ``new`` (it takes the message's lists: they are its own)."""
        return cls(**{f.name: getattr(new, f.name) for f in fields(new)})

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def sample_row(self, mask: torch.Tensor | None) -> SampleRow:
        """The sampler's view of this request's next token: forbidden ids (EOS and stop
        ids under ``min_tokens``, bad words whose other tokens end the output), the
        grammar's ``mask`` (or None), and its tokens when a penalty needs them."""
        params = self.params
        tokens = self.token_ids
        n_out = len(tokens) - self.num_prompt_tokens
        suppress: set[int] = set()
        if n_out < params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            suppress = set(eos) | set(params.stop_token_ids or ())
        for word in self.bad_words_ids:
            head = word[:-1]
            if not head or (len(head) <= n_out and tokens[len(tokens) - len(head) :] == head):
                suppress.add(word[-1])
        repetition = params.repetition_penalty != 1.0
        return SampleRow(
            params,
            self.seed,
            len(tokens),
            tuple(sorted(suppress)),
            mask=mask,
            output_ids=tokens[self.num_prompt_tokens :] if params.penalized else None,
            prompt_ids=tokens[: self.num_prompt_tokens] if repetition else None,
        )


class RankRequests:
    """The requests a rank knows, by id."""

    def __init__(self) -> None:
        self._by_id: dict[str, RankRequest] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __getitem__(self, request_id: str) -> RankRequest:
        return self._by_id[request_id]

    def ids(self) -> set[str]:
        return set(self._by_id)

    def apply(self, out: SchedulerOutput) -> None:
        """Bring the copies up to date with ``out`` (see the module docstring); takes
        the lists of ``out``'s new requests and whole tables as its own."""
        by_id = self._by_id
        for rid in out.finished_ids:
            by_id.pop(rid, None)
        for new in out.new_requests:
            by_id[new.request_id] = RankRequest.of(new)
        c = out.cached
        for rid, tokens, blocks, done in zip(
            c.request_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens, strict=True
        ):
            req = by_id[rid]
            req.token_ids.extend(tokens)
            req.num_computed_tokens = done
            if blocks is not None:
                for table, tail in zip(req.block_ids, blocks, strict=True):
                    table.extend(tail)
        for rid, tables in c.tables.items():
            by_id[rid].block_ids = tables
