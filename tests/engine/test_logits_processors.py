"""Logits processors in the sampler: logit_bias, penalties, allowed ids, bad words, grammar
masks — each does what OpenAI / vLLM document, and a row's token depends on that row only."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_engine, run_to_end

from kvserve.default_model import DEFAULT_MODEL_DIR
from kvserve.errors import EngineError
from kvserve.sampling import SampleRow, SamplingParams, StructuredSpec, sample
from kvserve.sampling.processors import process_logits, unpack_bitmask

V = 64


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _row(pos: int = 0, **kw) -> SampleRow:
    extra = {k: kw.pop(k) for k in ("suppress", "mask", "output_ids", "prompt_ids") if k in kw}
    return SampleRow(SamplingParams(**kw), 1, pos, **extra)


def test_logit_bias_minus_100_bans_and_plus_100_forces():
    for pos in range(100):
        logits = _logits(pos)
        top = int(logits.argmax())
        got = sample(logits.clone(), [_row(pos, logit_bias={top: -100.0})]).token_ids[0]
        assert got != top
        forced = (top + 7) % V
        got = sample(logits.clone(), [_row(pos, logit_bias={forced: 100.0})]).token_ids[0]
        assert got == forced


def test_allowed_token_ids_and_suppress():
    allowed = [3, 9, 40]
    for pos in range(100):
        t = sample(_logits(pos), [_row(pos, allowed_token_ids=allowed)]).token_ids[0]
        assert t in allowed
        top = int(_logits(pos).argmax())
        t = sample(_logits(pos), [_row(pos, temperature=0, suppress=(top,))]).token_ids[0]
        assert t != top


def test_frequency_and_presence_penalties_follow_openais_formula():
    logits = _logits(1)
    out = [5, 5, 5, 7]
    got = logits.clone()
    process_logits(got, [_row(0, frequency_penalty=0.5, presence_penalty=0.25, output_ids=out)])
    want = logits.clone()
    want[0, 5] -= 3 * 0.5 + 0.25
    want[0, 7] -= 1 * 0.5 + 0.25
    assert torch.allclose(got, want)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SampleRow(SamplingParams(repetition_penalty=2.0), 1, 0, prompt_ids=[0], output_ids=[1])
    process_logits(logits, [row])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_grammar_mask_allows_only_its_tokens_and_a_dead_row_keeps_the_grammar():
    allowed = [2, 33, 63]
    bits = torch.zeros(2, dtype=torch.int32)
    for t in allowed:
        bits[t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    assert unpack_bitmask(bits, V).nonzero().flatten().tolist() == allowed
    for pos in range(50):
        assert sample(_logits(pos), [_row(pos, mask=bits)]).token_ids[0] in allowed
        # every allowed token also banned by the bias: the grammar still decides
        row = _row(pos, mask=bits, logit_bias={t: -100.0 for t in allowed})
        assert sample(_logits(pos), [row]).token_ids[0] in allowed


def test_a_rows_processors_do_not_depend_on_the_other_rows():
    logits = _logits(3, rows=4)
    rows = [
        _row(9, frequency_penalty=1.0, output_ids=[1, 2, 2]),
        _row(9, logit_bias={4: 5.0}, temperature=0.7),
        _row(9, allowed_token_ids=[1, 2, 3], temperature=0),
        _row(9, repetition_penalty=1.3, prompt_ids=[0, 1], output_ids=[6]),
    ]
    together = sample(logits.clone(), rows).token_ids
    alone = [sample(logits[i : i + 1].clone(), [r]).token_ids[0] for i, r in enumerate(rows)]
    assert together == alone


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


def _constrained(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.8,
        seed=50 + i,
        max_tokens=96,
        structured=StructuredSpec("json", json.dumps(SCHEMA)),
        frequency_penalty=0.3,
        logit_bias={11: 2.0},
    )


def _other(i: int) -> SamplingParams:
    kinds = [
        {},
        {"presence_penalty": 1.0},
        {"repetition_penalty": 1.2, "bad_words": ["def"]},
        {"structured": StructuredSpec("regex", r"[a-z]{3,9}( [0-9]+)?")},
    ]
    return SamplingParams(temperature=0.9, seed=900 + i, max_tokens=24, **kinds[i % 4])


@pytest.mark.parametrize("preempt", [False, True])
def test_a_constrained_request_gives_the_same_tokens_alone_and_among_31_others(preempt):
    """Batch invariance of the whole path (grammar masks, penalties, bias) in bfloat16;
    with a cache too small for the batch, through recompute preemptions too (a preempted
    request's grammar state stays with its delivered tokens)."""
    engine = make_engine(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_memory="64MiB",
                         max_model_len=256)  # fmt: skip
    prompt = engine.tokenize("def parse(line):")
    engine.add_request("alone", prompt, _constrained(0))
    alone = run_to_end(engine)["alone"]
    if preempt:
        spec = engine.kv_spec
        engine = make_engine(DEFAULT_MODEL_DIR, dtype="bfloat16", max_model_len=256,
                             kv_cache_memory=24 * spec.bytes_per_block,
                             preemption_mode="recompute")  # fmt: skip
    engine.add_request("target", prompt, _constrained(0))
    for i in range(31):
        engine.add_request(f"o{i}", engine.tokenize(f"class C{i}:"), _other(i))
    got = run_to_end(engine)
    assert got["target"] == alone
    assert (engine.scheduler.num_preemptions > 0) == preempt
    text = engine.tokenizer.decode(alone, skip_special_tokens=True)
    value = json.loads(text)
    assert set(value) == {"name", "n", "tags"} and len(value["name"]) <= 8
    engine.check_integrity()


def test_a_resumed_constrained_stream_continues_exactly():
    """Failover: the record travels as JSON (the spec inside the params), the grammar is
    rebuilt from the delivered tokens, and the rest equals the uninterrupted run."""
    from kvserve.ha.record import SessionRecord

    engine = make_engine(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_memory="64MiB",
                         max_model_len=256)  # fmt: skip
    prompt = engine.tokenize("def parse(line):")
    req = engine.add_request("a", prompt, _constrained(3))
    want = run_to_end(engine)["a"]
    record = SessionRecord.from_json(SessionRecord.of_request(req, 16).to_json())
    assert record.params == req.params
    other = make_engine(DEFAULT_MODEL_DIR, dtype="bfloat16", kv_cache_memory="64MiB",
                        max_model_len=256)  # fmt: skip
    other.resume_request("b", record, want[:9])
    assert run_to_end(other)["b"] == want
    # a delivered token the grammar refuses is a refused resume, not a broken stream
    bad = engine.tokenize(" x")[:1]
    with pytest.raises(EngineError, match="grammar"):
        other.resume_request("c", record, bad)
