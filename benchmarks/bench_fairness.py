"""Tenant fairness and priority scenarios after Sheng et al., "Fairness in Serving LLMs" (OSDI 2024).

Each scenario runs the same arrivals under ``fcfs`` and under the fair policy
(``priority-fair``) and reports service shares while tenants are backlogged, the
largest accumulated service difference between two backlogged tenants, total
throughput (work conservation), and priority latencies.

Modes:
- ``sim`` (default): the real scheduler, block manager and policies, with a
  model-less step (each step computes what the scheduler planned) and a virtual
  clock (one step is one second; aging after 200 steps of class starvation).
  Deterministic; measures the policy, not the hardware.
- ``engine``: the real engine on the real stories260K model on this CPU; time is
  wall-clock seconds and service is counted from the tokens actually computed.

Service of a tenant = w_in * input tokens + w_out * output tokens computed (the
paper's cost with w_in = 1, w_out = 2), not divided by weight; shares are
compared with weight / sum of weights.

Usage: python benchmarks/bench_fairness.py [--mode sim|engine] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.block_manager import BlockManager
from engine.policy import make_policy
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

W_IN, W_OUT = 1.0, 2.0


@dataclass
class Arrival:
    step: float
    tenant: str
    prompt_len: int
    max_tokens: int
    priority: int = 1
    weight: float = 1.0


@dataclass
class Trace:
    service: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # cumulative per step
    backlogged: list[set[str]] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    ttft: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # per priority class name
    waits: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


def poisson_arrivals(rng, tenant, rate, horizon, prompt=(24, 48), output=(16, 48), priority=1, weight=1.0, start=0.0):
    t, out = start, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= horizon:
            return out
        out.append(Arrival(t, tenant, int(rng.integers(*prompt)), int(rng.integers(*output)), priority, weight))


def simulate(arrivals: list[Arrival], policy_name: str, steps: int, max_seqs=16, budget=128, blocks=4096,
             aging_steps: float = 200.0) -> Trace:
    bm = BlockManager(blocks, 16, 0, enable_prefix_caching=False)
    policy = make_policy(policy_name) if policy_name == "fcfs" else make_policy(policy_name, aging_s=aging_steps)
    clock = [0.0]  # virtual time: one step is one second
    sched = Scheduler(SchedulerConfig(max_seqs, budget, preemption_mode="recompute"), bm, policy, clock=lambda: clock[0])
    pending = sorted(arrivals, key=lambda a: a.step)
    trace = Trace()
    tenants = sorted({a.tenant for a in arrivals})
    cumulative = {t: 0.0 for t in tenants}
    arrival_step: dict[str, float] = {}
    i = 0
    for step in range(steps):
        clock[0] = float(step)
        while i < len(pending) and pending[i].step <= step:
            a = pending[i]
            rid = f"{a.tenant}-{i}"
            # arrival_time in "steps" keeps FCFS order and aging in the same unit
            r = Request(rid, [1] * a.prompt_len, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                        tenant_id=a.tenant, priority=a.priority, weight=a.weight, arrival_time=a.step)
            arrival_step[rid] = a.step
            sched.add_request(r)
            i += 1
        # Backlogged as in the VTC paper: the tenant has requests waiting in the queue.
        trace.backlogged.append({r.tenant_id for r in sched.waiting})
        out = sched.schedule()
        sampling = [p.request for p in out.scheduled if p.samples]
        for p in out.scheduled:
            r = p.request
            start = r.num_computed_tokens
            n_in = max(0, min(start + p.num_new_tokens, r.num_prompt_tokens) - start)
            cumulative[r.tenant_id] += W_IN * n_in + W_OUT * (p.num_new_tokens - n_in)
        sched.update_after_step(out)
        trace.tokens_per_step.append(out.num_batched_tokens)
        for r in sampling:
            if r.num_output_tokens == 0:
                cls = ["interactive", "standard", "batch"][r.priority]
                trace.ttft[cls].append(step + 1 - arrival_step[r.request_id])
            r.append_output_token(7)
            status = r.check_stop_token()
            if status is not None:
                sched.finish_request(r, status)
        for t in tenants:
            trace.service[t].append(cumulative[t])
    return trace


def shares_while_backlogged(trace: Trace, tenants: list[str]) -> dict[str, float]:
    gained = {t: 0.0 for t in tenants}
    prev = {t: 0.0 for t in tenants}
    for k, active in enumerate(trace.backlogged):
        for t in tenants:
            now = trace.service[t][k]
            if set(tenants) <= active:
                gained[t] += now - prev[t]
            prev[t] = now
    total = sum(gained.values()) or 1.0
    return {t: gained[t] / total for t in tenants}


def max_service_difference(trace: Trace, tenants: list[str], weights: dict[str, float]) -> float:
    """Largest |W_a/w_a - W_b/w_b| accumulated over an interval where both are backlogged."""
    worst = 0.0
    for a in tenants:
        for b in tenants:
            if a >= b:
                continue
            base_a = base_b = None
            for k, active in enumerate(trace.backlogged):
                if a in active and b in active:
                    if base_a is None:
                        base_a, base_b = trace.service[a][k - 1] if k else 0.0, trace.service[b][k - 1] if k else 0.0
                    diff = (trace.service[a][k] - base_a) / weights[a] - (trace.service[b][k] - base_b) / weights[b]
                    worst = max(worst, abs(diff))
                else:
                    base_a = base_b = None
    return worst


def scenario_flood(rng, steps):
    horizon = steps * 0.6
    # A sends 10x B's requests; both above their fair share of ~0.4 requests/step.
    arrivals = poisson_arrivals(rng, "A", 4.0, horizon) + poisson_arrivals(rng, "B", 0.4, horizon)
    return arrivals, {"A": 1.0, "B": 1.0}


def scenario_weights(rng, steps):
    arrivals, weights = [], {}
    for k, name in enumerate("ABCD", start=1):
        arrivals += poisson_arrivals(rng, name, 1.0, steps * 0.8, weight=float(k))
        weights[name] = float(k)
    return arrivals, weights


def scenario_on_off(rng, steps):
    # A is always busy; B is busy, goes idle for a long while, and returns.
    arrivals = poisson_arrivals(rng, "A", 1.0, steps * 0.9)
    arrivals += poisson_arrivals(rng, "B", 1.0, steps * 0.2) + poisson_arrivals(rng, "B", 1.0, steps * 0.9, start=steps * 0.5)
    return arrivals, {"A": 1.0, "B": 1.0}


def run_sim(out_dir: Path, steps: int = 1500) -> dict:
    results = {}
    traces = {}
    # U: the most service one request can add in a step window (paper's bound is 2U).
    u = W_IN * 48 + W_OUT * 128  # max prompt + token budget per step, in cost units
    for name, build in (("flood", scenario_flood), ("weights_1234", scenario_weights), ("on_off", scenario_on_off)):
        rng = np.random.default_rng(0)
        arrivals, weights = build(rng, steps)
        tenants = sorted(weights)
        row = {}
        for policy in ("fcfs", "priority-fair"):
            trace = simulate(arrivals, policy, steps)
            traces[(name, policy)] = trace
            ideal = {t: weights[t] / sum(weights.values()) for t in tenants}
            row[policy] = {
                "shares_while_backlogged": shares_while_backlogged(trace, tenants),
                "ideal_shares": ideal,
                "max_service_difference": max_service_difference(trace, tenants, weights),
                "total_tokens": sum(trace.tokens_per_step),
            }
        row["paper_bound_2U"] = 2 * u
        row["work_conservation"] = row["priority-fair"]["total_tokens"] / max(1, row["fcfs"]["total_tokens"])
        results[name] = row
    results["priority"] = run_priority_sim(steps)
    plot(traces, out_dir)
    return results


def run_priority_sim(steps: int) -> dict:
    rng = np.random.default_rng(1)
    batch = poisson_arrivals(rng, "bulk", 3.0, steps * 0.8, priority=2, prompt=(64, 128), output=(64, 128))
    inter = poisson_arrivals(rng, "chat", 0.05, steps * 0.8, priority=0)
    idle = simulate(inter, "priority-fair", steps)
    out = {}
    for policy in ("fcfs", "priority-fair"):
        loaded = simulate(batch + inter, policy, steps)
        t = loaded.ttft["interactive"]
        b = loaded.ttft["batch"]
        out[policy] = {
            "interactive_ttft_p99_steps": float(np.percentile(t, 99)) if t else None,
            "interactive_ttft_idle_p99_steps": float(np.percentile(idle.ttft["interactive"], 99)),
            "longest_batch_wait_steps": max(b) if b else None,
            "batch_requests_served": len(b),
        }
    return out


def plot(traces, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for scenario in ("flood", "weights_1234", "on_off"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, policy in zip(axes, ("fcfs", "priority-fair")):
            trace = traces[(scenario, policy)]
            for tenant, series in sorted(trace.service.items()):
                ax.plot(series, label=f"tenant {tenant}")
            ax.set_title(f"{scenario}: {policy}")
            ax.set_xlabel("step")
            ax.legend()
        axes[0].set_ylabel("cumulative service (w_in*in + w_out*out tokens)")
        fig.tight_layout()
        fig.savefig(out_dir / f"fairness_{scenario}.png", dpi=90)
        plt.close(fig)


def run_engine_mode(steps: int = 300) -> dict:
    """flood and weights 1:2:3:4 on the real engine (stories260K, this CPU), fcfs vs priority-fair.

    Arrivals are placed on engine steps; service is counted from what the engine
    schedules (a wrapper around the policy's ``on_scheduled``), and throughput is
    output tokens per wall-clock second.
    """
    from engine.llm import load_engine

    results = {}
    for name, build in (("flood", scenario_flood), ("weights_1234", scenario_weights)):
        rng = np.random.default_rng(0)
        arrivals, weights = build(rng, steps)
        tenants = sorted(weights)
        row = {}
        for policy in ("fcfs", "priority-fair"):
            engine = load_engine("stories260k", scheduling_policy=policy, num_gpu_blocks=2048, max_num_seqs=16,
                                 max_num_batched_tokens=128, max_model_len=512)
            served = {t: 0.0 for t in tenants}
            inner = engine.scheduler.policy.on_scheduled

            def counting(request, n, now, inner=inner, served=served):
                start = request.num_computed_tokens
                n_in = max(0, min(start + n, request.num_prompt_tokens) - start)
                served[request.tenant_id] += W_IN * n_in + W_OUT * (n - n_in)
                inner(request, n, now)

            engine.scheduler.policy.on_scheduled = counting
            pending = sorted(arrivals, key=lambda a: a.step)
            gained = {t: 0.0 for t in tenants}
            i, out_tokens, t0 = 0, 0, time.perf_counter()
            for step in range(steps):
                while i < len(pending) and pending[i].step <= step:
                    a = pending[i]
                    engine.add_request(f"{a.tenant}-{i}", rng.integers(3, 500, a.prompt_len).tolist(),
                                       SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                                       tenant_id=a.tenant, weight=a.weight)
                    i += 1
                backlogged = set(tenants) <= {r.tenant_id for r in engine.scheduler.waiting}
                before = dict(served)
                out_tokens += sum(1 for _ in engine.step())
                if backlogged:
                    for t in tenants:
                        gained[t] += served[t] - before[t]
            wall = time.perf_counter() - t0
            total = sum(gained.values()) or 1.0
            row[policy] = {
                "shares_while_backlogged": {t: gained[t] / total for t in tenants},
                "ideal_shares": {t: weights[t] / sum(weights.values()) for t in tenants},
                "output_tokens_per_s": out_tokens / wall,
                "max_service_difference": float("nan"),
                "total_tokens": int(sum(served.values())),
            }
        row["paper_bound_2U"] = float("nan")
        row["work_conservation"] = row["priority-fair"]["output_tokens_per_s"] / row["fcfs"]["output_tokens_per_s"]
        results[name] = row
    results["priority"] = {}
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["sim", "engine"], default="sim")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.mode == "engine":
        results = run_engine_mode()
    else:
        results = run_sim(out_dir)
    (out_dir / f"fairness_{args.mode}.json").write_text(json.dumps(results, indent=2, default=float))
    print(f"{'scenario':<14}{'policy':<15}{'shares while backlogged (ideal)':<48}{'max diff':>10}{'tokens':>9}")
    for name, row in results.items():
        if name == "priority":
            continue
        for policy in ("fcfs", "priority-fair"):
            r = row[policy]
            shares = " ".join(f"{t}:{v:.2f}({r['ideal_shares'][t]:.2f})" for t, v in r["shares_while_backlogged"].items())
            print(f"{name:<14}{policy:<15}{shares:<48}{r['max_service_difference']:>10.0f}{r['total_tokens']:>9}")
        print(f"{'':<14}bound 2U = {row['paper_bound_2U']:.0f}; work conservation fair/fcfs = {row['work_conservation']:.3f}")
    for policy, r in results.get("priority", {}).items():
        print(f"priority {policy:<14} interactive TTFT p99 {r['interactive_ttft_p99_steps']} steps "
              f"(idle {r['interactive_ttft_idle_p99_steps']}), longest batch wait {r['longest_batch_wait_steps']} steps")


if __name__ == "__main__":
    main()
