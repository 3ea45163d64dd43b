"""Property test: random arrivals, steps, aborts, preemptions (swap and recompute) and
finishes, with the prefix cache on, never leak a KV block on the GPU or CPU pool."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, block_key
from engine.policy import make_policy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

ops = st.lists(
    st.one_of(
        # (op, prompt length, max_tokens, prompt family): families share prefixes
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 3), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


def _check_invariants(bm: BlockManager, live: list[Request]) -> None:
    gpu_refs = [0] * bm.gpu.num_blocks
    cpu_refs = [0] * bm.cpu.num_blocks
    for r in live:
        for b in r.block_table:
            gpu_refs[b] += 1
        for b in r.cpu_block_table:
            cpu_refs[b] += 1
        assert not (r.block_table and r.cpu_block_table)
        if r.status == RequestStatus.RUNNING:
            assert len(r.block_table) * bm.block_size >= r.num_computed_tokens
    for pool, refs in ((bm.gpu, gpu_refs), (bm.cpu, cpu_refs)):
        assert refs == [b.ref_count for b in pool.blocks]
        assert sorted(pool.free_queue) == [i for i, n in enumerate(refs) if n == 0]
    _check_cache(bm)


def _check_cache(bm: BlockManager) -> None:
    """Every cached block's key is the hash of its parent key, its tokens and a salt."""
    for key, block_id in bm.gpu.cached.items():
        block = bm.gpu.blocks[block_id]
        assert block.block_hash == key
        assert len(block.token_ids) == bm.block_size
        assert key == block_key(block.parent_hash, block.token_ids, None)  # salt: tenant None here


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(3, 24), num_cpu_blocks=st.integers(0, 12),
       block_size=st.sampled_from([1, 2, 4, 16]), budget=st.integers(1, 64), max_seqs=st.integers(1, 6),
       mode=st.sampled_from(["swap", "recompute", "auto"]), policy=st.sampled_from(["fcfs", "priority-fair"]))
def test_random_operations_leave_every_block_free(ops, num_blocks, num_cpu_blocks, block_size, budget, max_seqs, mode, policy):
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_seqs, budget, preemption_mode=mode), bm, make_policy(policy))
    live: dict[str, Request] = {}
    next_id = 0
    for op, a, b, family in ops:
        if op == "add":
            # Only requests that fit the pool alone are admitted (the engine refuses the rest).
            if bm.blocks_needed(a + b) > num_blocks:
                continue
            prompt = [family * 1000 + i for i in range(a)]  # same family -> shared prefix
            # Families double as priority classes (same tenant salt None, so prefixes are shared).
            r = Request(str(next_id), prompt, SamplingParams(max_tokens=b, ignore_eos=True), priority=family)
            next_id += 1
            live[r.request_id] = r
            sched.add_request(r)
        elif op == "abort":
            rid = str(a)
            if rid in live:
                sched.finish_request(live.pop(rid), RequestStatus.FINISHED_ABORTED)
        else:
            for _ in range(a + 1):
                _fake_step(sched, live)
        _check_invariants(bm, list(live.values()))
    # Drain: every request must finish (no hang), then both pools must be whole.
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        _fake_step(sched, live)
    assert not sched.has_unfinished_requests(), "requests left that never finish"
    assert bm.num_free_blocks == num_blocks and bm.num_free_cpu_blocks == num_cpu_blocks
    assert all(block.ref_count == 0 for block in bm.gpu.blocks + bm.cpu.blocks)
    _check_cache(bm)


def _fake_step(sched: Scheduler, live: dict[str, Request]) -> None:
    """A model step without a model: every request that reaches its end 'samples' a token."""
    out = sched.schedule()
    sampling = [p.request for p in out.scheduled if p.samples]
    sched.update_after_step(out)
    for r in sampling:
        r.append_output_token(7)
        status = r.check_stop_token()
        if status is not None:
            sched.finish_request(r, status)
            live.pop(r.request_id, None)
