"""The KV cache's blocks: which block of the pool holds which positions of each sequence, and the prefix cache that
lets sequences with a common beginning (the n samples of a GRPO group, the turns of an episode) share its blocks.

A block holds `block_size` consecutive positions of one sequence. A full block whose keys and values are computed is
registered under the hash of every token up to its end, so that a later sequence starting with the same tokens takes
the same block (its reference count says how many sequences use it) instead of computing it again. A sequence never
shares the block holding its last prompt token: that one it computes itself, in a block of its own, so no shared
block is ever written (copy-on-write reduced to "the tail is private"). A block nobody uses goes back to the free
list but keeps its registration until it is handed out again, so a finished episode's blocks serve its next turn.
"""

import collections
from dataclasses import dataclass, field

SCRATCH = 0  # block 0 is never handed out: padded rows of a CUDA graph's batch write their keys and values there


@dataclass
class Chain:
    """A sequence's blocks, and how many of its leading full blocks are registered in the prefix cache."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # the chained hash of each of its registered full blocks
    pending: list[int] = field(default_factory=list)  # hashes of full blocks it is computing now


class Blocks:
    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.refs = [0] * num_blocks
        # Blocks with no user; an entry whose block was shared again since is skipped when met (`_take`).
        self.free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self.num_free = num_blocks - 1
        self.cached: dict[int, int] = {}  # chained hash -> block holding those computed positions
        self.tokens: dict[int, tuple[int, ...]] = {}  # block -> the tokens it was registered with (hash collisions)
        self.hash_of: dict[int, int] = {}  # block -> its hash, while registered
        self.pending: set[int] = set()  # hashes of full blocks a running prefill is computing now

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    def grow(self, num_blocks: int) -> None:
        self.free.extend(range(self.num_blocks, num_blocks))
        self.num_free += num_blocks - self.num_blocks
        self.refs.extend([0] * (num_blocks - self.num_blocks))

    def needed(self, positions: int, chain: Chain) -> int:
        """Blocks `chain` must still get to hold `positions` positions."""
        return max(0, -(-positions // self.block_size) - len(chain.blocks))

    def match(self, tokens: list[int]) -> tuple[list[int], list[int], bool]:
        """The registered blocks that hold a prefix of `tokens` (never the block of its last token), their hashes,
        and whether the next block is one a running prefill is computing (worth waiting for)."""
        blocks, hashes, prev = [], [], 0
        for start in range(0, len(tokens) - 1 - (len(tokens) - 1) % self.block_size, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            key = hash((prev, chunk))
            block = self.cached.get(key)
            if block is None or self.tokens.get(block) != chunk:
                return blocks, hashes, key in self.pending
            blocks.append(block)
            hashes.append(key)
            prev = key
        return blocks, hashes, False

    def share(self, chain: Chain, blocks: list[int], hashes: list[int]) -> None:
        for block in blocks:
            self.num_free -= self.refs[block] == 0  # a free block still registered: in use again
            self.refs[block] += 1
        chain.blocks.extend(blocks)
        chain.hashes.extend(hashes)

    def extend(self, chain: Chain, count: int) -> list[int]:
        """Gives `chain` `count` more blocks (the caller checked that `num_free` suffices); returns them."""
        new = [self._take() for _ in range(count)]
        chain.blocks.extend(new)
        return new

    def _take(self) -> int:
        block = self.free.popleft()
        while self.refs[block]:
            block = self.free.popleft()
        self.num_free -= 1
        key = self.hash_of.pop(block, None)
        if key is not None and self.cached.get(key) == block:
            del self.cached[key]
            self.tokens.pop(block, None)
        self.refs[block] = 1
        return block

    def plan(self, chain: Chain, tokens: list[int], upto: int) -> None:
        """Marks the full blocks of `tokens` below position `upto` that `chain` will have computed as pending."""
        chain.pending = self._hashes(chain, tokens, upto, extend=False)
        self.pending.update(chain.pending)

    def register(self, chain: Chain, tokens: list[int], computed: int) -> None:
        """Registers the full blocks of `tokens` within the first `computed` positions (their keys and values now in
        the cache) for later sequences to share."""
        done = computed // self.block_size - len(chain.hashes)
        self.pending.difference_update(chain.pending[:done])
        del chain.pending[:done]
        for index, key in zip(range(len(chain.hashes), computed // self.block_size),
                              self._hashes(chain, tokens, computed, extend=True), strict=False):  # fmt: skip
            block = chain.blocks[index]
            if key not in self.cached:
                self.cached[key] = block
                self.hash_of[block] = key
                self.tokens[block] = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])

    def _hashes(self, chain: Chain, tokens: list[int], upto: int, extend: bool) -> list[int]:
        prev = chain.hashes[-1] if chain.hashes else 0
        new = []
        for index in range(len(chain.hashes), upto // self.block_size):
            prev = hash((prev, tuple(tokens[index * self.block_size : (index + 1) * self.block_size])))
            new.append(prev)
        if extend:
            chain.hashes.extend(new)
        return new

    def release(self, chain: Chain) -> None:
        """The chain's blocks lose one user; unused ones go back to the free list, registered ones last (they stay
        shareable until handed out again)."""
        for block in reversed(chain.blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.num_free += 1
                (self.free.append if block in self.hash_of else self.free.appendleft)(block)
        self.pending.difference_update(chain.pending)
        chain.blocks.clear()
        chain.hashes.clear()
        chain.pending = []

    def forget(self) -> None:
        """Drops every registration (the weights changed: cached keys and values are stale)."""
        self.cached.clear()
        self.tokens.clear()
        self.hash_of.clear()
        self.pending.clear()
