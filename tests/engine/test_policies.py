"""Scheduling policies on scripted arrivals (no model): order, priority, aging, fairness."""

from __future__ import annotations

import time

import pytest

from engine.block_manager import BlockManager
from engine.policy import FCFSPolicy, PriorityFairPolicy, make_policy
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def _req(rid, tenant="t", priority=STANDARD, prompt_len=8, max_tokens=8, arrival=None, weight=1.0):
    kwargs = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   tenant_id=tenant, priority=priority, weight=weight, **kwargs)


def _sched(policy, num_blocks=256, block_size=4, max_seqs=64, budget=64):
    bm = BlockManager(num_blocks, block_size, num_cpu_blocks=0, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_seqs, budget, preemption_mode="recompute"), bm, policy)


def _step(sched):
    """One model-less step; returns (plan, finished requests)."""
    out = sched.schedule()
    sampling = [p.request for p in out.scheduled if p.samples]
    sched.update_after_step(out)
    done = []
    for r in sampling:
        r.append_output_token(7)
        status = r.check_stop_token()
        if status is not None:
            sched.finish_request(r, status)
            done.append(r)
    return out, done


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    sched = _sched(FCFSPolicy(), max_seqs=1)
    t0 = time.monotonic()
    reqs = [_req(f"r{i}", tenant=f"t{i % 2}", priority=[BATCH, INTERACTIVE][i % 2], arrival=t0 + i) for i in range(4)]
    for r in reversed(reqs):
        sched.add_request(r)
    order = []
    while sched.has_unfinished_requests():
        out, _ = _step(sched)
        order += [p.request.request_id for p in out.scheduled if p.request.request_id not in order]
    assert order == ["r0", "r1", "r2", "r3"]


def test_higher_class_overtakes_and_preempts_at_the_sequence_limit():
    sched = _sched(PriorityFairPolicy(aging_s=None), max_seqs=2)
    low1, low2, low3 = (_req(f"low{i}", priority=BATCH, max_tokens=50) for i in range(3))
    for r in (low1, low2, low3):
        sched.add_request(r)
    _step(sched)
    assert {r.request_id for r in sched.running} == {"low0", "low1"}
    hi = _req("hi", tenant="u", priority=INTERACTIVE, max_tokens=5)
    sched.add_request(hi)
    out, _ = _step(sched)
    assert hi.status == RequestStatus.RUNNING, "the urgent request must get in at once"
    assert [r.request_id for r in out.preempted] == ["low1"], "the latest low-class arrival is the victim"
    assert low3.status == RequestStatus.WAITING


def test_higher_class_preempts_a_lower_one_at_the_block_limit():
    # 10 blocks of 4 tokens; one batch request fills 8 of them.
    sched = _sched(PriorityFairPolicy(aging_s=None), num_blocks=10, budget=64)
    low = _req("low", priority=BATCH, prompt_len=30, max_tokens=20)
    sched.add_request(low)
    _step(sched)
    hi = _req("hi", tenant="u", priority=INTERACTIVE, prompt_len=12, max_tokens=4)
    sched.add_request(hi)
    out, _ = _step(sched)
    assert hi.status == RequestStatus.RUNNING
    assert low in out.preempted and low.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    # FCFS would have made the urgent request wait instead.
    fcfs = _sched(FCFSPolicy(), num_blocks=10, budget=64)
    low_f = _req("low", priority=BATCH, prompt_len=30, max_tokens=20)
    fcfs.add_request(low_f)
    _step(fcfs)
    hi_f = _req("hi", tenant="u", priority=INTERACTIVE, prompt_len=12, max_tokens=4)
    fcfs.add_request(hi_f)
    _step(fcfs)
    assert hi_f.status == RequestStatus.WAITING


@pytest.mark.parametrize("aging_s", [5.0, None])
def test_aging_bounds_a_low_class_wait(aging_s):
    clock = [0.0]
    policy = PriorityFairPolicy(aging_s=aging_s)
    bm = BlockManager(256, 4, 0, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(1, 64, preemption_mode="recompute"), bm, policy, clock=lambda: clock[0])
    batch = _req("batch", tenant="bulk", priority=BATCH, max_tokens=2, arrival=0.0)
    sched.add_request(batch)
    admitted_at = None
    # Interactive requests keep arriving, one per virtual second, each taking the only slot.
    for t in range(60):
        clock[0] = float(t)
        sched.add_request(_req(f"i{t}", tenant="chat", priority=INTERACTIVE, max_tokens=1, arrival=float(t)))
        _step(sched)
        if batch.status != RequestStatus.WAITING and admitted_at is None:
            admitted_at = t
    if aging_s is None:
        assert admitted_at is None, "without aging the batch class starves under steady interactive load"
    else:
        # Two promotions (batch -> interactive) after 2 * aging_s of starvation, then FCFS by arrival.
        assert admitted_at is not None and admitted_at <= 2 * aging_s + 2, admitted_at


def test_aging_keeps_the_fair_order_inside_a_class():
    policy = PriorityFairPolicy(aging_s=1.0)
    old = [_req(f"a{i}", tenant="A", arrival=float(i)) for i in range(3)]
    new = _req("b0", tenant="B", arrival=50.0)
    for r in old + [new]:
        policy.on_arrival(r, [x for x in old + [new] if x is not r and x.arrival_time < r.arrival_time])
    policy.counters["A"] = 100.0
    policy.counters["B"] = 0.0
    order = policy.admission_order(old + [new], now=100.0)
    assert order[0] is new, "the whole class is promoted together, so B's lower counter still wins"


def _service_while_backlogged(policy_name, a_requests, b_requests, weights=(1.0, 1.0), steps=400):
    policy = make_policy(policy_name)
    sched = _sched(policy, num_blocks=4096, max_seqs=4, budget=32)
    t0 = time.monotonic()
    for i in range(a_requests):
        sched.add_request(_req(f"a{i}", tenant="A", arrival=t0 + i * 1e-6, weight=weights[0]))
    for i in range(b_requests):
        sched.add_request(_req(f"b{i}", tenant="B", arrival=t0 + 1e-3 + i * 1e-6, weight=weights[1]))
    service = {"A": 0.0, "B": 0.0}
    for _ in range(steps):
        waiting_tenants = {r.tenant_id for r in sched.waiting}
        both = {"A", "B"} <= ({r.tenant_id for r in sched.running} | waiting_tenants) and waiting_tenants
        out, _ = _step(sched)
        if not both:
            break
        for p in out.scheduled:  # VTC cost of the tokens computed (input 1, output 2 per token)
            r = p.request
            n_in = max(0, min(r.num_computed_tokens, r.num_prompt_tokens) - (r.num_computed_tokens - p.num_new_tokens))
            service[r.tenant_id] += n_in + 2 * (p.num_new_tokens - n_in)
    return service


def test_flooding_tenant_and_light_tenant_get_equal_service_while_both_backlogged():
    fair = _service_while_backlogged("priority-fair", 100, 10)
    share_b = fair["B"] / (fair["A"] + fair["B"])
    assert share_b >= 0.45, fair
    fcfs = _service_while_backlogged("fcfs", 100, 10)
    assert fcfs["B"] / (fcfs["A"] + fcfs["B"]) < 0.2, "FCFS serves the flood first"


def test_weights_set_the_shares():
    service = _service_while_backlogged("priority-fair", 60, 60, weights=(1.0, 3.0))
    share_b = service["B"] / (service["A"] + service["B"])
    assert share_b == pytest.approx(0.75, abs=0.075), service


def _admissions(sched, steps):
    admitted = []
    for _ in range(steps):
        out, _ = _step(sched)
        # after the step a freshly admitted request has computed exactly its first chunk
        admitted += [p.request.tenant_id for p in out.scheduled if p.request.num_computed_tokens == p.num_new_tokens]
    return admitted


@pytest.mark.parametrize("lift", [True, False])
def test_counter_lift_stops_banking_idle_time(lift):
    policy = PriorityFairPolicy(aging_s=None)
    sched = _sched(policy, max_seqs=2, budget=16)
    for i in range(40):  # A is served alone for a while
        sched.add_request(_req(f"a{i}", tenant="A"))
    for _ in range(40):
        _step(sched)
    assert policy.counters["A"] > 100
    if not lift:  # what a policy without the lift would do: B keeps its idle-time credit
        policy.on_arrival = lambda r, w, _orig=policy.on_arrival: (_orig(r, w), policy.counters.__setitem__("B", 0.0))
    for i in range(5):
        sched.add_request(_req(f"b{i}", tenant="B"))
    if lift:
        assert policy.counters["B"] == pytest.approx(policy.counters["A"])
    admitted = _admissions(sched, 40)
    first_five = admitted[:5]
    if lift:  # B is lifted to A's level: the two alternate from there
        assert first_five.count("A") >= 2, admitted
    else:  # banked credit: B takes every admission until it has used its idle time
        assert first_five == ["B"] * 5, admitted
