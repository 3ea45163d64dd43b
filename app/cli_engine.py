"""``chatgate generate``: stream one completion from the engine to the terminal."""

from __future__ import annotations

import argparse
import sys


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """KV pool and batching options shared by commands that start an engine."""
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "device": args.device,
        "tensor_parallel_size": args.tensor_parallel_size,
    }


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_options(p)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from engine import InvalidRequestError, SamplingParams
    from engine.llm import encode_chat, load_engine
    from engine.loader import ModelLoadError

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
        )
        engine = load_engine(args.model, **engine_kwargs(args))
        if args.chat:
            ids = encode_chat(engine, [{"role": "user", "content": args.prompt}])
        else:
            ids = engine.tokenizer.encode(args.prompt) if args.prompt else []
        engine.add_request("cli", ids, params)
    except (InvalidRequestError, ModelLoadError, ValueError) as exc:
        print(f"chatgate generate: {exc}", file=sys.stderr)
        return 2
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        c = final.outputs[0]
        print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0
