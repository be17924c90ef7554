"""The failover resume's rules (``ha.resume``): which state a stream resumes from, at which
epoch, and how much stored KV a replay may restore."""

from __future__ import annotations

import msgspec

from kvserve.ha import resume
from kvserve.ha.record import SessionRecord
from kvserve.sampling import SamplingParams


def _record(**kw) -> SessionRecord:
    base = {"session_id": "s", "tenant": "t", "prompt_token_ids": [1, 2, 3],
            "params": SamplingParams(max_tokens=8, seed=7), "seed": 7}  # fmt: skip
    return SessionRecord(**{**base, **kw})


def test_the_primary_state_is_taken_only_for_this_very_request():
    request = resume.from_request("s", "t", None, [1, 2, 3], SamplingParams(max_tokens=8, seed=7),
                                  False)  # fmt: skip
    replicated = _record(output_token_ids=[9, 9], stored_tokens=16, seed=7)
    assert resume.choose_record(request, replicated) is replicated
    assert resume.choose_record(request, None) is request
    for other in (
        msgspec.structs.replace(replicated, prompt_token_ids=[1, 2]),  # another turn
        msgspec.structs.replace(replicated, tenant="u"),
        msgspec.structs.replace(replicated, params=SamplingParams(max_tokens=9, seed=7)),
    ):
        assert resume.choose_record(request, other) is request


def test_a_request_without_a_seed_gets_one():
    greedy = resume.from_request("s", "t", "salt", [4], SamplingParams(max_tokens=2), True)
    assert isinstance(greedy.seed, int) and greedy.ephemeral and greedy.cache_salt == "salt"
    assert greedy.output_token_ids == [] and greedy.prefill_from is None
    seeded = resume.from_request("s", "t", None, [4], SamplingParams(max_tokens=2, seed=5), False)
    assert seeded.seed == 5


def test_the_takeover_epoch():
    assert resume.seen_epoch(3, 9) == 3  # the router's reading wins
    assert resume.seen_epoch(None, 9) == 9
    assert resume.seen_epoch(None, None) == 0


def test_how_much_stored_kv_a_replay_restores():
    bs = 16
    # built from the client's request: nothing was computed, restore whatever is stored
    assert resume.restore_limit(_record(), 40, bs, batch_invariant=False) is None
    record = _record(prefill_from=20, stored_tokens=32)
    assert resume.restore_limit(record, 40, bs, batch_invariant=True) is None
    assert resume.restore_limit(record, 40, bs, batch_invariant=False) == 16  # its cached part
    whole = msgspec.structs.replace(record, stored_tokens=48)  # covers the prompt
    assert resume.restore_limit(whole, 40, bs, batch_invariant=False) == 48
