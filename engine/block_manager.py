"""The KV block pools: fixed-size blocks, ref counts, block tables, and the prefix cache.

Follows the paged KV cache of Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention" (SOSP 2023): a request's tokens live in
blocks of ``block_size`` tokens that need not be contiguous; its *block table*
maps logical block ``i`` (tokens ``[i*block_size, (i+1)*block_size)``) to a
physical block id. The manager only does bookkeeping; tensors belong to the
model runner.

Prefix caching (as in vLLM's automatic prefix caching): a full block whose K/V is
completely computed gets the key ``hash(parent_hash, block token ids, salt)``; a
later request whose blocks have the same chain of keys reuses the block (ref
count + 1) after the stored parent hash and token ids are compared. A cached block
whose ref count drops to zero stays in the free queue with its contents and can
still be hit until it is reused (evicted). The free queue is LRU: blocks are
appended as they are freed, a request's blocks deepest first, so the deepest
block of a chain is evicted first. The salt is the tenant by default, so tenants
never share KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class KVBlock:
    """One physical block. ``ref_count`` is the number of requests using it.

    ``block_hash``/``parent_hash``/``token_ids`` are set while the block is in the
    prefix cache (full and computed), None otherwise.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


def block_key(parent_hash: int | None, token_ids: tuple[int, ...], salt: object) -> int:
    """The prefix-cache key of a full block: ``hash(parent_hash, token_ids, salt)``."""
    return hash((parent_hash, token_ids, salt))


class BlockPool:
    """Fixed-size blocks with ref counts and an LRU free queue (used for GPU and CPU pools).

    Invariant: a block is in the free queue exactly when its ref count is zero.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block_hash -> block_id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take(self) -> KVBlock:
        """A free block with ref count 1, evicting its cached contents if any."""
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self.uncache(block)
        block.ref_count = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Add a reference to a (possibly free, cached) block."""
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def uncache(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None


class BlockManager:
    """Allocates, shares (prefix cache), swaps and frees KV blocks for requests.

    Args:
        num_blocks: GPU pool size, in blocks (>= 1).
        block_size: tokens per block (>= 1).
        num_cpu_blocks: CPU swap pool size, in blocks (>= 0).
        enable_prefix_caching: reuse computed full blocks across requests.
    """

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def blocks(self) -> list[KVBlock]:
        return self.gpu.blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that ``num_tokens`` tokens occupy."""
        return cdiv(num_tokens, self.block_size)

    # -- allocation ---------------------------------------------------------------
    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``request`` must add to hold ``num_new_tokens`` more computed tokens."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow ``request.block_table`` so ``num_new_tokens`` more tokens fit.

        Returns:
            False (and changes nothing) when the pool has too few free blocks.
        """
        n = self.num_new_blocks(request, num_new_tokens)
        if n > self.gpu.num_free:
            return False
        for _ in range(n):
            request.block_table.append(self.gpu.take().block_id)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references (GPU and CPU); blocks at zero return to their pool.

        Freed deepest first, so the LRU free queue evicts a chain from its end.
        """
        for block_id in reversed(request.block_table):
            self.gpu.release(block_id)
        for block_id in reversed(request.cpu_block_table):
            self.cpu.release(block_id)
        request.block_table = []
        request.cpu_block_table = []
        request.block_hashes = []

    # -- prefix cache -----------------------------------------------------------------
    def _salt(self, request: Request) -> object:
        return request.cache_salt

    def match_prefix(self, request: Request) -> int:
        """Attach the longest cached prefix of a request that holds no blocks yet.

        At least one token is left to compute, since its logits are needed. Sets
        ``block_table`` and ``num_computed_tokens``.

        Returns:
            the number of tokens hit (not yet counted in the stats; see
            ``record_prefix_query``).
        """
        assert not request.block_table, "prefix match on a request that holds blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        salt = self._salt(request)
        max_blocks = (request.num_tokens - 1) // bs
        parent = None
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            tokens = tuple(request.token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens, salt)
            block_id = self.gpu.cached.get(key)
            if block_id is None:
                break
            block = self.gpu.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:  # hash collision
                break
            hits.append(block)
            parent = key
        for block in hits:
            self.gpu.touch(block)
        request.block_table = [b.block_id for b in hits]
        request.block_hashes = [b.block_hash for b in hits]
        request.num_computed_tokens = len(hits) * bs
        return len(hits) * bs

    def record_prefix_query(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (failed admissions are not counted)."""
        self.prefix_cache_queried_tokens += queried_tokens
        self.prefix_cache_hit_tokens += hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Enter the request's newly full *and computed* blocks into the prefix cache.

        ``request.block_hashes`` keeps the chain of keys of its leading full blocks,
        so each block is hashed once.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(request.num_computed_tokens, request.num_tokens) // bs
        salt = self._salt(request)
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else None
            block = self.gpu.blocks[request.block_table[i]]
            tokens = tuple(request.token_ids[i * bs : (i + 1) * bs])
            key = block_key(parent, tokens, salt)
            # If another request already cached the same block, this copy stays
            # private; the chain of keys continues either way.
            if block.block_hash is None and key not in self.gpu.cached:
                block.block_hash, block.parent_hash, block.token_ids = key, parent, tokens
                self.gpu.cached[key] = block.block_id
            request.block_hashes.append(key)

    def reset_prefix_cache(self) -> None:
        for block in self.gpu.blocks:
            if block.block_hash is not None:
                self.gpu.uncache(block)

    # -- swap -----------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(request.block_table) <= self.cpu.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the CPU pool.

        Returns:
            ``(gpu_block, cpu_block)`` copies to perform before the GPU blocks are reused.
        """
        mapping = []
        for gpu_id in request.block_table:
            cpu_block = self.cpu.take()
            mapping.append((gpu_id, cpu_block.block_id))
        for gpu_id in reversed(request.block_table):
            self.gpu.release(gpu_id)
        request.cpu_block_table = [c for _, c in mapping]
        request.block_table = []
        request.block_hashes = []  # the copies that come back are private blocks
        self.num_swapped_out_blocks += len(mapping)
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        needed = max(len(request.cpu_block_table), self.blocks_needed(request.num_computed_tokens + num_new_tokens))
        return needed <= self.gpu.num_free

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back to fresh GPU blocks.

        Returns:
            ``(cpu_block, gpu_block)`` copies to perform before the step's model run.
        """
        mapping = []
        for cpu_id in request.cpu_block_table:
            gpu_block = self.gpu.take()
            mapping.append((cpu_id, gpu_block.block_id))
        for cpu_id in reversed(request.cpu_block_table):
            self.cpu.release(cpu_id)
        request.block_table = [g for _, g in mapping]
        request.cpu_block_table = []
        self.num_swapped_in_blocks += len(mapping)
        return mapping

    def slot(self, request: Request, position: int) -> int:
        """Cache slot (``block_id * block_size + offset``) of token ``position``."""
        return request.block_table[position // self.block_size] * self.block_size + position % self.block_size
