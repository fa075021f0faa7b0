"""Property test of the KV cache's blocks (services/engine/blocks.py): random interleavings of sequences that join
(sharing what the prefix cache holds), compute their positions, grow, leave, and of the cache forgetting its
registrations. No block is ever held by a sequence and free at once, reference counts are the number of sequences
holding a block, and a shared block holds exactly the tokens of the prefix it was shared for."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from services.engine.blocks import SCRATCH, Blocks, Chain

BLOCK = 4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12], [1, 2, 3, 4, 9, 9], [7] * 14, [2, 3]]


class BlocksMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.blocks = Blocks(BLOCK, 12)
        self.running: list[tuple[Chain, list[int], list[int]]] = []  # chain, its tokens, what each block holds
        self.contents: dict[int, tuple[int, ...]] = {}  # block -> the tokens written into it (by whoever)

    @rule(prompt=st.sampled_from(PROMPTS), extra=st.lists(st.integers(20, 30), max_size=6))
    def join(self, prompt, extra):
        tokens = prompt + extra
        shared, hashes, computing = self.blocks.match(tokens)
        if computing:
            return  # the engine waits for those blocks
        chain = Chain()
        if self.blocks.needed(len(tokens) + 1, Chain(blocks=shared)) > self.blocks.num_free:
            self.blocks.grow(self.blocks.num_blocks * 2)
        self.blocks.share(chain, shared, hashes)
        for index, block in enumerate(shared):  # what it shares is its own prefix, computed
            assert self.contents[block] == tuple(tokens[index * BLOCK : (index + 1) * BLOCK])
        self.blocks.plan(chain, tokens, len(tokens))
        self.running.append((chain, tokens, len(shared) * BLOCK))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), count=st.integers(1, 9))
    def compute(self, pick, count):
        """A step computes the next `count` positions of one sequence (its prompt, then new tokens)."""
        index = pick % len(self.running)
        chain, tokens, computed = self.running[index]
        upto = min(len(tokens), computed + count)
        need = self.blocks.needed(upto, chain)
        if need > self.blocks.num_free:
            self.blocks.grow(self.blocks.num_blocks + need)
        self.blocks.extend(chain, need)
        for position in range(computed, upto):
            block = chain.blocks[position // BLOCK]
            assert self.blocks.refs[block] == 1  # only a private block is ever written
            written = self.contents.get(block, ())[: position % BLOCK]
            self.contents[block] = (*written, tokens[position])
        self.blocks.register(chain, tokens, upto)
        self.running[index] = (chain, tokens, upto)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def leave(self, pick):
        chain, _, _ = self.running.pop(pick % len(self.running))
        self.blocks.release(chain)

    @rule()
    def forget(self):
        self.blocks.forget()

    @invariant()
    def counts_hold(self):
        holders = [0] * self.blocks.num_blocks
        for chain, _, _ in self.running:
            for block in chain.blocks:
                holders[block] += 1
        assert holders == self.blocks.refs and holders[SCRATCH] == 0
        assert self.blocks.num_free == self.blocks.num_blocks - 1 - sum(1 for h in holders if h)
        for block, key in self.blocks.hash_of.items():  # a registered block holds the tokens it is registered with
            if self.blocks.cached.get(key) == block:
                assert self.contents[block] == self.blocks.tokens[block]


def test_blocks_keep_their_counts_and_contents():
    run_state_machine_as_test(
        BlocksMachine,
        settings=settings(max_examples=150, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )  # fmt: skip
