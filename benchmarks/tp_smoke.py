"""A two-rank start-up check before bench_tp.py: a tiny model at TP=2, eager then with CUDA graphs.

Prints ``graphs False ok`` / ``graphs True ok`` with the greedy ids; ``kill -USR1``
dumps every thread's stack (driver and workers) if it hangs.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch

    from bench_tp import greedy_with_logprobs, tiny_hd128
    from engine.llm_engine import EngineConfig, LLMEngine

    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    cfg, sd = tiny_hd128()
    prompts = [[1, 2, 3], [5] * 20]
    ref = None
    for graphs in (False, True):
        t0 = time.perf_counter()
        print(f"graphs {graphs} starting", flush=True)
        engine = LLMEngine(cfg, sd, None, EngineConfig(device=device, tensor_parallel_size=2, cuda_graphs=graphs,
                                                       compile_model=False, num_gpu_blocks=256, max_num_seqs=8))
        print(f"graphs {graphs} up in {time.perf_counter() - t0:.1f} s", flush=True)
        ids = [x[0] for x in greedy_with_logprobs(engine, prompts, 8)]
        engine.shutdown()
        print(f"graphs {graphs} ok {ids} same_as_eager={ref is None or ids == ref}", flush=True)
        ref = ref or ids
