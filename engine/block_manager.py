"""The KV block pool: fixed-size blocks, ref counts and per-request block tables.

Follows the paged KV cache of Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention" (SOSP 2023): a request's tokens live in
blocks of ``block_size`` tokens that need not be contiguous; its *block table*
maps logical block ``i`` (tokens ``[i*block_size, (i+1)*block_size)``) to a
physical block id. The manager only does bookkeeping; the tensors belong to the
model runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.request import Request


@dataclass(eq=False)
class KVBlock:
    """One physical block. ``ref_count`` is the number of requests using it."""

    block_id: int
    ref_count: int = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates and frees KV blocks for requests.

    Args:
        num_blocks: size of the pool, in blocks (>= 1).
        block_size: tokens per block (>= 1).

    Invariant: a block is in the free queue exactly when its ref count is zero.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``request`` must add to hold ``num_new_tokens`` more computed tokens."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_table`` so ``num_new_tokens`` more tokens fit.

        Returns:
            False (and changes nothing) when the pool has too few free blocks.
        """
        n = self.num_new_blocks(request, num_new_tokens)
        if n > self.num_free_blocks:
            return False
        for _ in range(n):
            block = self.blocks[self.free_block_ids.popleft()]
            assert block.ref_count == 0, "free block with a live reference"
            block.ref_count = 1
            request.block_table.append(block.block_id)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks whose count reaches zero return to the pool.

        Freed in reverse order so a request's tail blocks are reused first.
        """
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        request.block_table = []

    def slot(self, request: Request, position: int) -> int:
        """Cache slot (``block_id * block_size + offset``) of token ``position``."""
        return request.block_table[position // self.block_size] * self.block_size + position % self.block_size
