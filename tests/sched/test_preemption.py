"""Preemption by swap, recompute and auto on a real engine: same tokens as an unpreempted
run, the mode each victim got, the cost model's choice, and the swap space's bounds."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.kv.swap import SwapOut, SwapSpace
from kvserve.request import RequestStatus
from kvserve.sampling import SamplingParams
from kvserve.sched.cost import PreemptionCostModel, attention_pairs
from kvserve.sched.scheduler import SchedulerOutput
from kvserve.worker.swap import HostSwap

TIGHT = dict(kv_cache_memory=16 * 16 * 512, max_model_len=128)  # 16 blocks of 16 tokens


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got = run_to_end(engine)
    engine.check_integrity()
    assert engine.kv.pool.num_free == engine.kv.num_blocks
    return got


@pytest.fixture(scope="module")
def expected(llama_dir):
    """Greedy and sampled outputs of four requests with room to spare (no preemption)."""
    prompts = random_prompts([30, 25, 20, 18], seed=11)
    out = {}
    for name, params in {
        "greedy": greedy(40),
        "sampled": SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True),
    }.items():
        roomy = make_engine(llama_dir)
        out[name] = _run(roomy, prompts, params)
        assert roomy.scheduler.num_preemptions == 0
    return prompts, out


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_preempted_requests_finish_with_the_unpreempted_tokens(llama_dir, expected, mode, kind):
    prompts, want = expected
    params = (
        greedy(40)
        if kind == "greedy"
        else SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True)
    )
    tight = make_engine(llama_dir, preemption_mode=mode, **TIGHT)
    assert tight.kv.num_blocks == 16
    got = _run(tight, prompts, params)
    assert got == want[kind]
    modes = {m for (m, _, _) in tight.scheduler.preemptions}
    assert tight.scheduler.num_preemptions > 0
    if mode == "swap":
        assert modes == {"swap"}
    elif mode == "recompute":
        assert modes == {"recompute"}
    assert tight.swap is None or tight.swap.used_blocks == 0


def test_swap_preserves_kv_bytes_and_the_null_blocks():
    """Round trip through the swap space into different blocks: bit-identical K/V (int8
    data and scales included), null-block table entries kept as such."""
    from kvserve.model.kv_quant import kv_format

    fmt = kv_format("int8", torch.float32)
    from kvserve.model.kv_cache import KVCacheSpec

    spec = KVCacheSpec.for_format(2, 2, 8, fmt, 4)
    caches = spec.allocate(10, torch.device("cpu"), fmt)
    for c in caches:
        c.data.copy_(torch.randint(-127, 127, c.data.shape, dtype=torch.int8))
        c.scale.copy_(torch.rand(c.scale.shape).half())
    swap = SwapSpace(spec.bytes_per_block, 3 * spec.bytes_per_block)
    host = HostSwap(caches, 4, spec.bytes_per_block)
    before = [(c.data.clone(), c.scale.clone()) for c in caches]
    assert swap.reserve("big", [1, 2, 3, 4], null_block=0) is None  # 4 blocks > capacity 3
    out = SchedulerOutput(swap_out=[swap.reserve("r", [0, 5, 7], null_block=0)])
    assert out.swap_out == [SwapOut("r", [5, 7])]
    assert swap.used_bytes == 2 * spec.bytes_per_block and not swap.can_hold(2)
    assert swap.live("r") == [False, True, True]
    host.apply(out)
    for c in caches:  # the device blocks may be reused now: the host copy stands alone
        c.data.zero_()
        c.scale.zero_()
    host.apply(SchedulerOutput(swap_in=[swap.release("r", [8, 2], skip=0)]))
    assert host.held() == set()
    for c, (d, s) in zip(caches, before, strict=True):
        for src, dst in ((5, 8), (7, 2)):
            assert torch.equal(c.data[:, dst * 4 : dst * 4 + 4], d[:, src * 4 : src * 4 + 4])
            assert torch.equal(c.scale[:, dst * 4 : dst * 4 + 4], s[:, src * 4 : src * 4 + 4])
    assert swap.used_blocks == 2  # its room is free once the step ran
    swap.settle()
    assert swap.used_blocks == 0
    swap.check_integrity()


def test_auto_mode_follows_the_measured_costs(llama_dir):
    """The same victim is swapped when copies are measured fast and recomputed when they
    are measured slow; the crossover moves accordingly."""
    engine = make_engine(llama_dir, preemption_mode="auto", **TIGHT)
    policy = engine.scheduler.policy
    engine.add_request("a", random_prompts([60])[0], greedy(4))
    engine.step()  # prefill: 60 computed tokens, 4 blocks
    req = engine.requests["a"]
    fast = PreemptionCostModel(engine.kv_spec.bytes_per_token, decay=1.0)
    slow = PreemptionCostModel(engine.kv_spec.bytes_per_token, decay=1.0)
    for i in range(50):  # steps of 1 ms + 100 µs/token + 1 ns/attention pair
        n, start = 1 + (i * 37) % 200, (i * 53) % 300
        pairs = attention_pairs([(start, n)])
        for m in (fast, slow):
            m.observe_step(n, pairs, 1e-3 + 1e-4 * n + 1e-9 * pairs)
        nbytes = (1 + i % 8) << 20
        fast.observe_copy(nbytes, 2e-5 + nbytes / 1e11)  # 100 GB/s
        slow.observe_copy(nbytes, 2e-5 + nbytes / 1e6)  # 1 MB/s
    policy.cost = fast
    assert policy.mode_for(req) == "swap"
    policy.cost = slow
    assert policy.mode_for(req) == "recompute"
    assert fast.crossover_tokens(16) < 64
    assert slow.crossover_tokens(16) is None or slow.crossover_tokens(16) > 1000
    rates = fast.rates()
    assert rates["prefill_s_per_token"] == pytest.approx(1e-4, rel=0.1)
    assert rates["step_overhead_s"] == pytest.approx(1e-3, rel=0.1)
    assert rates["copy_bytes_per_s"] == pytest.approx(1e11, rel=0.1)


def test_swap_space_full_falls_back_to_recompute(llama_dir, expected):
    prompts, want = expected
    one_block = make_engine(llama_dir, **TIGHT).kv_spec.bytes_per_block
    tight = make_engine(llama_dir, preemption_mode="swap", swap_space=one_block, **TIGHT)
    got = _run(tight, prompts, greedy(40))
    assert got == want["greedy"]
    assert {m for (m, _, _) in tight.scheduler.preemptions} == {"recompute"}


def test_swapped_request_aborted_releases_its_swap_space(llama_dir):
    engine = make_engine(llama_dir, preemption_mode="swap", **TIGHT)
    for i, p in enumerate(random_prompts([30, 25, 20, 18], seed=11)):
        engine.add_request(f"r{i}", p, greedy(40))
    for _ in range(200):
        engine.step()
        swapped = [r for r in engine.scheduler.waiting if r.status is RequestStatus.SWAPPED]
        if swapped:
            break
    assert swapped, "no request was swapped out"
    assert engine.swap.used_blocks > 0
    for r in swapped:
        engine.abort_request(r.request_id)
    assert engine.swap.used_blocks == 0
    engine.check_integrity()
    run_to_end(engine)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_swap_in_shares_a_prefix_still_in_the_pool_instead_of_copying_it(llama_dir):
    """B shares A's 4-block prefix; B is swapped out and back: its prefix comes back as
    A's blocks (referenced, not copied into private duplicates) and its tokens are those
    of an unpreempted run."""
    from kvserve.sched.scheduler import SchedulerOutput

    prefix = random_prompts([64], seed=1)[0]
    tails = random_prompts([20, 20], seed=2)
    prompts = [prefix + t for t in tails]
    plain = make_engine(llama_dir)
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, greedy(30))
    want = run_to_end(plain)

    engine = make_engine(llama_dir, preemption_mode="swap")
    a = engine.add_request("r0", prompts[0], greedy(30))
    engine.step()  # A's prefix is in the prefix cache now
    b = engine.add_request("r1", prompts[1], greedy(30))
    engine.step()
    assert engine.kv.block_table("r1")[:4] == engine.kv.block_table("r0")[:4]
    out = SchedulerOutput()
    engine.scheduler._preempt(b, "pool", out, {})
    engine.runner.step(out)  # what the step that preempted B would have done
    assert b.status is RequestStatus.SWAPPED and engine.swap.used_blocks == 6
    used_before = engine.kv.pool.num_used
    engine.step()  # B comes back
    assert b.status is RequestStatus.RUNNING and engine.swap.used_blocks == 0
    assert engine.kv.block_table("r1")[:4] == engine.kv.block_table("r0")[:4]
    assert engine.kv.pool.num_used == used_before + 2  # only B's 2 private blocks came back
    engine.check_integrity()
    assert run_to_end(engine) == want
    assert a.is_finished
