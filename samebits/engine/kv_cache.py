"""The KV block pool and the per-sequence block bookkeeping, with prefix caching.

Plain Python, no tensors. A block is reused from the prefix cache only when its hash matches, and
the hash chains the parent block's hash, the block's token ids and the model's numerics
fingerprint (weights digest, dtype, kernel config): a cached block is only ever read by the exact
numerics that wrote it ("KV cache versioning"). A request's ``cache_salt`` enters the chain's
root, so requests with different salts (tenants) never share a block. Freed blocks keep their
contents and hash until they are handed out again; blocks without a hash are handed out first,
then cached ones, least recently freed first (LRU over unreferenced blocks).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from samebits.engine.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash -> block id (referenced or free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, evicting the least recently freed cached ones."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None and self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop references; blocks that reach zero become free (most recently freed last)."""
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            if self.ref_cnt[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:  # holds nothing reusable: hand it out first
                    self.free.move_to_end(b, last=False)

    def register(self, block: int, h: bytes) -> None:
        if h not in self.cached:
            self.cached[h] = block
            self.block_hash[block] = h


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 fingerprint: str) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.set_fingerprint(fingerprint)

    def set_fingerprint(self, fingerprint: str) -> None:
        """Key every block hash from now on by ``fingerprint`` (new weights): blocks cached under
        the old one are forgotten, and no new hash can equal an old one (the root differs)."""
        self._root = hashlib.sha256(f"samebits-kv|{fingerprint}".encode()).digest()
        self.pool.cached.clear()
        self.pool.block_hash = [None] * self.pool.num_blocks

    def _hash(self, parent: bytes, tokens: list[int]) -> bytes:
        h = hashlib.sha256(parent)
        h.update(b",".join(str(t).encode() for t in tokens))
        return h.digest()

    def _salted_root(self, seq: Sequence) -> bytes:
        if seq.cache_salt is None:
            return self._root
        salt = seq.cache_salt.encode("utf-8", "surrogatepass")
        return hashlib.sha256(self._root + b"|salt|" + salt).digest()

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq.block_hashes`` over the full blocks among its first ``num_tokens``."""
        bs = self.block_size
        if (len(seq.block_hashes) + 1) * bs > num_tokens:  # most steps: no block filled
            return
        tokens = seq.all_token_ids
        while (len(seq.block_hashes) + 1) * bs <= num_tokens:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else self._salted_root(seq)
            seq.block_hashes.append(self._hash(parent, tokens[i * bs:(i + 1) * bs]))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest prefix of ``seq``, leaving at least one token to compute
        (its logits are needed). None for a sequence that does not use the prefix cache."""
        if not self.enable_prefix_caching or not seq.uses_prefix_cache:
            return []
        self._update_hashes(seq, seq.num_tokens - 1)
        blocks = []
        for h in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after any cached prefix)."""
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        need = -(-(num_computed + num_new_tokens) // self.block_size)
        new = need - len(seq.block_table) - len(cached)
        free_cached = sum(1 for b in cached if self.pool.ref_cnt[b] == 0)
        if new > self.pool.num_free - free_cached:
            return False
        self.pool.touch(list(cached))
        seq.block_table.extend(cached)
        seq.block_table.extend(self.pool.allocate(max(new, 0)))
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step: register the blocks that are now full as cached (not those of a
        sequence that bypasses the cache)."""
        if not self.enable_prefix_caching or seq.bypass_prefix_cache:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_committed_blocks, full):  # only the blocks filled since last time
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``; its last blocks are evicted first."""
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []  # a new list: a list seen before only ever grows (cuda_graph.py)
        seq.num_committed_blocks = 0
