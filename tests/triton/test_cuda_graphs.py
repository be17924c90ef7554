"""CUDA graphs' bookkeeping, on CPU: the buckets, the static buffers a replay reads (real
rows copied in, padding rows writing nothing), and an engine whose decode steps go
through ``DecodeGraphs`` giving the eager engine's tokens. The capture is
``ReplayByCall`` (a replay runs the forward again over the same buffers, what a graph
replay computes); the Triton backend runs under its interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.worker.cuda_graphs import CudaCapture, DecodeGraphs, ReplayByCall, capture_sizes
from kvserve.worker.model_runner import ModelRunner

CUDA = torch.cuda.is_available()  # scripts/gpu_check.sh runs these on a GPU, capturing
DEV = "cuda" if CUDA else "cpu"
# bf16 on CPU: the GEMMs are batch-invariant there, so a padded bucket gives the same bits
DTYPE = "float32" if CUDA else "bfloat16"


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256  # bounded


class CountingReplay:
    """Records the bucket of every replay (a real CUDA capture on a GPU)."""

    def __init__(self) -> None:
        self.replays: list[int] = []
        self.inner = CudaCapture(torch.device(DEV)) if CUDA else ReplayByCall()

    def capture(self, forward):
        replay_inner = self.inner.capture(forward)

        def replay():
            out = replay_inner()
            self.replays.append(out.shape[0])
            return out

        return replay


def _graphs(engine, capture, sizes=(1, 2, 4, 8)) -> DecodeGraphs:
    runner = engine.runner
    groups = engine.kv_spec.groups
    return DecodeGraphs(
        runner.model,
        runner.kv_caches,
        runner.device,
        list(sizes),
        -(-engine.max_model_len // engine.kv.block_size),
        1 if groups is None else len(groups.windows),
        engine.max_model_len - 1,
        capture,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_decodes_through_graphs_with_the_eager_tokens(model_dirs, arch, monkeypatch):
    """Three sequences (a bucket of 4: one padding row) decode through the graphs; the
    tokens are the eager engine's, bf16, and the KV bookkeeping holds."""
    kw = dict(dtype=DTYPE, device=DEV, attention_backend="triton", swap_space=0, enforce_eager=True)
    prompts = random_prompts([5, 23, 40], seed=3)

    def generate(engine) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8))
        done = run_to_end(engine)
        engine.kv.check_integrity()
        return [done[str(i)] for i in range(len(prompts))]

    eager = generate(make_engine(model_dirs[arch], **kw))
    engine = make_engine(model_dirs[arch], **kw)
    capture = CountingReplay()
    runner = engine.runner
    graphs = _graphs(engine, capture)
    graph_runner = ModelRunner(
        runner.model, runner.kv_caches, runner.device, runner.builder, graphs
    )
    monkeypatch.setattr(engine, "runner", graph_runner)
    assert generate(engine) == eager
    assert capture.replays == [4] * 7  # 7 decode steps of 3 rows, in the bucket of 4


def test_padding_rows_write_nothing_and_rows_match_eager(model_dirs):
    """One replay of 3 rows in the bucket of 4: the hidden states and every cache equal
    an eager forward of the 3 rows on a copy of the caches (the padding row's slot is -1:
    no write anywhere)."""
    engine = make_engine(
        model_dirs["llama"], dtype=DTYPE, device=DEV, attention_backend="triton", enforce_eager=True
    )
    for i, p in enumerate(random_prompts([9, 17, 33], seed=4)):
        engine.add_request(str(i), p, greedy(4))
    for _ in range(3):  # prefill, then a first decode step
        engine.step()
    out = engine.scheduler.schedule()
    assert list(out.num_scheduled_tokens.values()) == [1, 1, 1]
    runner = engine.runner
    runner.requests.apply(out)  # as the runner does first
    inputs = runner.builder.build(out, runner.requests)
    eager_caches = [c.clone() for c in runner.kv_caches]
    graphs = _graphs(engine, CudaCapture(torch.device(DEV)) if CUDA else ReplayByCall())
    assert graphs.eligible(inputs.input_ids, inputs.meta)
    got = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
    with torch.inference_mode():
        want = runner.model(inputs.input_ids, inputs.positions, eager_caches, inputs.meta)
    same = (lambda a, b: torch.allclose(a, b, atol=1e-5)) if CUDA else torch.equal
    assert same(got, want)
    for a, b in zip(runner.kv_caches, eager_caches, strict=True):
        assert same(a, b)
    first = next(iter(out.num_scheduled_tokens))
    one = dataclasses.replace(out, num_scheduled_tokens={first: 1})
    prefill = runner.builder.build(one, runner.requests)
    prefill.meta.num_decodes = 0  # a prefill row is never replayed
    assert not graphs.eligible(prefill.input_ids, prefill.meta)
