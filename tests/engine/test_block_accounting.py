"""Property test: random add / step / finish / abort sequences never leak KV blocks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.policy import FCFSPolicy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=60,
)


def _check_invariants(bm: BlockManager, live: list[Request]) -> None:
    refs = [0] * bm.num_blocks
    for r in live:
        for b in r.block_table:
            refs[b] += 1
        assert len(r.block_table) * bm.block_size >= r.num_computed_tokens
    assert refs == [b.ref_count for b in bm.blocks]
    assert sorted(bm.free_block_ids) == [i for i, n in enumerate(refs) if n == 0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 6))
def test_random_operations_leave_every_block_free(ops, num_blocks, block_size, budget, max_seqs):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(max_seqs, budget), bm, FCFSPolicy())
    live: dict[str, Request] = {}
    next_id = 0
    for op, a, b in ops:
        if op == "add":
            # Only requests that fit the pool alone are admitted (the engine refuses the rest).
            if bm.blocks_needed(a + b) > num_blocks:
                continue
            r = Request(str(next_id), list(range(a)), SamplingParams(max_tokens=b, ignore_eos=True))
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
    # Drain: every request must finish (no hang), then the pool must be whole.
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        _fake_step(sched, live)
    assert not sched.has_unfinished_requests(), "requests left that never finish"
    assert bm.num_free_blocks == num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)


def _fake_step(sched: Scheduler, live: dict[str, Request]) -> None:
    """A model step without a model: every request that reaches its end 'samples' token 0."""
    out = sched.schedule()
    sampling = [p.request for p in out.scheduled if p.samples]
    sched.update_after_step(out)
    for r in sampling:
        r.append_output_token(0)
        status = r.check_stop_token()
        if status is not None:
            sched.finish_request(r, status)
            live.pop(r.request_id, None)
