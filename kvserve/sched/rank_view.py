"""What the ranks know of each request, kept on the scheduler's side so that each step's
``SchedulerOutput`` carries only what changed (vLLM v1's new/cached request split).

``RankView.fill`` writes a step's batch into its output: a request the ranks have not seen
as ``NewRequestData`` (``Scheduler.finish`` forgets an id, so a known id is the same
request); one they know as its
tokens since, the blocks appended to its tables, and its whole tables when they changed
otherwise. ``forget`` (a request finished) puts its id on the next step's
``finished_ids`` so that the ranks drop their copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sched.output import NewRequestData, SchedulerOutput


@dataclass
class _Known:
    num_tokens: int  # how many of its tokens they have
    tables: list[list[int]]  # their copy of its block tables (one per group)


class RankView:
    """The scheduler's record of the ranks' request state (see the module docstring)."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._known: dict[str, _Known] = {}
        self._finished: list[str] = []  # forgotten since the last fill

    def held_ids(self) -> set[str]:
        """The ids the ranks keep a copy of between steps: those they know and those
        forgotten since the last step (they drop them at the next)."""
        return set(self._known) | set(self._finished)

    def forget(self, request_id: str) -> None:
        """``request_id`` finished: the ranks drop it at the next step (no-op when they
        never saw it)."""
        if self._known.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def fill(self, out: SchedulerOutput, batch: list[tuple[Request, int]]) -> None:
        """Write ``batch`` ((request, new tokens) in batch order) into ``out``: its
        scheduled tokens, new and cached request data, the finished ids since the last
        call, and the grammar masks of the requests this step samples. Records what the
        ranks will know after it."""
        out.finished_ids, self._finished = self._finished, []
        cached = out.cached
        for req, n in batch:
            rid = req.request_id
            out.num_scheduled_tokens[rid] = n
            tables = self.kv.block_tables(rid)
            known = self._known.get(rid)
            if known is None:
                self._known[rid] = _Known(req.num_tokens, [list(t) for t in tables])
                out.new_requests.append(_whole(req, tables))
            else:
                cached.request_ids.append(rid)
                cached.num_computed_tokens.append(req.num_computed_tokens)
                # tokens only grow while a request lives (finish_request cuts and ends it)
                assert req.num_tokens >= known.num_tokens, f"{rid}: tokens went back"
                cached.new_token_ids.append(req.token_slice(known.num_tokens, req.num_tokens))
                known.num_tokens = req.num_tokens
                cached.new_block_ids.append(_appended(known, tables, cached.tables, rid))
            if req.guide is not None and req.num_computed_tokens + n == req.num_tokens:
                out.grammar_masks[rid] = req.guide.mask()


def _whole(req: Request, tables: list[list[int]]) -> NewRequestData:
    return NewRequestData(
        req.request_id,
        req.token_slice(0, req.num_tokens),
        req.num_prompt_tokens,
        req.params,
        req.seed,
        req.eos_token_ids,
        req.bad_words_ids,
        [list(t) for t in tables],
        req.num_computed_tokens,
    )


def _appended(
    known: _Known, tables: list[list[int]], whole: dict[str, list[list[int]]], rid: str
) -> list[list[int]] | None:
    """The blocks appended to each of ``tables`` since ``known``'s copy (None: none), or
    None with the tables put in ``whole`` when they changed otherwise; updates the copy."""
    old = known.tables
    grown = False
    changed = len(tables) != len(old)
    if not changed:
        for t, o in zip(tables, old, strict=True):
            if len(t) < len(o) or t[: len(o)] != o:
                changed = True
                break
            grown = grown or len(t) > len(o)
    if changed:
        known.tables = [list(t) for t in tables]
        whole[rid] = [list(t) for t in tables]
        return None
    if not grown:
        return None
    tails = [t[len(o) :] for t, o in zip(tables, old, strict=True)]
    for o, tail in zip(old, tails, strict=True):
        o.extend(tail)
    return tails
