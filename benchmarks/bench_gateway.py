"""Gateway overhead: one chat and 32 concurrent chats through the WebSocket gateway,
against the same chats on the engine called directly (``AsyncLLM`` in-process).

Same model (SmolLM2-135M-Instruct, float32, this CPU), same greedy chats, same
engine options; the direct run finishes and frees the CPU before the gateway
starts. TTFT is measured by the client: from sending the chat to the first text
(gateway) or from calling ``generate`` to the first output (direct). Tokens/s per
chat = completion tokens / (last output - first output); aggregate = all
completion tokens / wall time of the batch.

Usage: python benchmarks/bench_gateway.py [--max-tokens 64] [--out benchmarks/results/gateway_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
    "What is 7 times 8?", "Give me a tip for sleeping well.", "Who wrote Hamlet?",
    "Explain what a noun is.", "Say hello in Spanish.",
]
MODEL, MAX_MODEL_LEN = "smollm2-135m-instruct", 2048


def summarize(rows: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] * 1000 for r in rows]
    tps = [r["tokens"] / r["decode_s"] for r in rows if r["decode_s"] > 0]
    return {
        "chats": len(rows), "ttft_ms_p50": statistics.median(ttft), "ttft_ms_max": max(ttft),
        "tokens_per_s_per_chat_p50": statistics.median(tps),
        "aggregate_tokens_per_s": sum(r["tokens"] for r in rows) / wall,
    }


async def direct(n: int, max_tokens: int) -> dict:
    from engine import AsyncLLM, SamplingParams

    llm = AsyncLLM(MODEL, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> dict:
        ids = llm.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        async for out in llm.generate(ids, params, f"d{n}-{i}"):
            now = time.perf_counter()
            first = first or now
            last = now
            tokens = len(out.outputs[0].token_ids)
        return {"ttft_s": first - t0, "tokens": tokens, "decode_s": last - first}

    await one(-1)  # warm-up
    results = {}
    for k in (1, n):
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(i) for i in range(k)))
        results[k] = summarize(rows, time.perf_counter() - t0)
    llm.shutdown()
    return results


async def gateway(n: int, max_tokens: int) -> dict:
    from tests.app.harness import ChatClient, GatewayServer

    with tempfile.TemporaryDirectory() as tmp:
        server = GatewayServer(Path(tmp), MODEL, MAX_MODEL_LEN)
        server.start()
        try:
            key = server.keys["local"]
            clients = [await ChatClient.connect(server, key) for _ in range(4)]

            async def one(i: int) -> dict:
                client = clients[i % len(clients)]
                chat_id = f"g-{i}-{time.monotonic_ns()}"
                t0 = time.perf_counter()
                await client.create(chat_id, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    temperature=0, max_tokens=max_tokens)
                first = last = None
                while True:
                    event = await client.next_event(chat_id, 600)
                    now = time.perf_counter()
                    if event["type"] == "chat.delta":
                        first = first or now
                        last = now
                    elif event["type"] == "chat.done":
                        return {"ttft_s": first - t0, "tokens": event["usage"]["completion_tokens"],
                                "decode_s": (last or now) - first}
                    else:
                        raise RuntimeError(event)

            await one(0)  # warm-up
            results = {}
            for k in (1, n):
                t0 = time.perf_counter()
                rows = await asyncio.gather(*(one(i) for i in range(k)))
                results[k] = summarize(rows, time.perf_counter() - t0)
            for c in clients:
                await c.close()
            return results
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/gateway_cpu.json")
    args = ap.parse_args()
    d = asyncio.run(direct(args.concurrency, args.max_tokens))
    g = asyncio.run(gateway(args.concurrency, args.max_tokens))
    result = {"date": time.strftime("%Y-%m-%d"), "model": MODEL, "max_tokens": args.max_tokens,
              "direct": {str(k): v for k, v in d.items()}, "gateway": {str(k): v for k, v in g.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'path':<10}{'chats':>6}{'TTFT p50 ms':>13}{'TTFT max ms':>13}{'tok/s/chat p50':>16}{'aggregate tok/s':>17}")
    for name, res in (("direct", d), ("gateway", g)):
        for k, r in res.items():
            print(f"{name:<10}{k:>6}{r['ttft_ms_p50']:>13.1f}{r['ttft_ms_max']:>13.1f}"
                  f"{r['tokens_per_s_per_chat_p50']:>16.1f}{r['aggregate_tokens_per_s']:>17.1f}")


if __name__ == "__main__":
    main()
