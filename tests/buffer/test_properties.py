"""Property test: random interleavings of lease, submit, release, expiry, restart, batch and commit.

Within an epoch every prompt group is trained at most once and, unless a filter dropped it (and counted it), at
least once; no completed sample is lost or changed on the way to the trainer.
"""

import asyncio
import contextlib
import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from services.buffer.config import BufferConfig
from services.buffer.core import Buffer
from services.buffer.filters import check_reward_nonzero_std
from services.buffer.server import build_streams
from services.buffer.store import BufferStore
from services.common.errors import DeadlineExceeded, NotFound
from tests.buffer.conftest import finish, write_jsonl
from tests.redis_servers import async_client

NUM_PROMPTS, BATCH = 10, 2


class BufferMachine(RuleBasedStateMachine):
    redis_url = ""
    config: BufferConfig

    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.client = async_client(self.redis_url)
        self.config = self.config.model_copy(
            update={"run": self.config.run.model_copy(update={"run_id": uuid.uuid4().hex[:10]})}
        )
        self.buffer = self._new_buffer()
        self.held: dict[str, object] = {}  # lease id -> group, as a worker holds it
        self.issued: list[tuple[str, object]] = []  # every lease ever handed out (late submits use old ones)
        self.accepted: dict[str, object] = {}  # group id -> the submitted group that was accepted
        self.filtered: set[str] = set()
        self.trained: list[str] = []
        self.recorded: dict[int, list[str]] = {}
        self.next_step = 0

    def _new_buffer(self) -> Buffer:
        store = BufferStore(self.client, "prop", self.config.run_id)
        buffer = Buffer(self.config, store, build_streams(self.config, None), check_reward_nonzero_std)
        self.run(buffer.start())
        return buffer

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    @rule(n=st.integers(0, 4))
    def lease(self, n):
        for leased in self.run(self.buffer.lease(n, 0, "")).leases:
            self.held[leased.lease_id] = leased.group
            self.issued.append((leased.lease_id, leased.group))

    @precondition(lambda self: self.issued)
    @rule(data=st.data(), same_rewards=st.booleans(), late=st.booleans())
    def submit(self, data, same_rewards, late):
        pool = self.issued if late else list(self.held.items()) or self.issued
        lease_id, group = data.draw(st.sampled_from(pool))
        rewards = [1.0, 1.0] if same_rewards else [0.0, 1.0]
        done = finish(group, rewards, response_len=data.draw(st.integers(1, 5)))
        accepted, duplicate, reason = self.run(self.buffer.submit(lease_id, done))
        self.held.pop(lease_id, None)
        gid = group.group_id
        known = gid in self.accepted or gid in self.filtered
        assert duplicate == known, f"{gid}: duplicate={duplicate} but known={known}"
        if accepted:
            self.accepted[gid] = done
        elif reason:
            self.filtered.add(gid)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), with_partial=st.booleans())
    def release(self, data, with_partial):
        lease_id = data.draw(st.sampled_from(sorted(self.held)))
        group = self.held.pop(lease_id)
        partial = list(finish(group, [0.5]).samples) if with_partial else []
        with contextlib.suppress(NotFound):  # it had expired: the group is back in the pool already
            self.run(self.buffer.release(lease_id, partial))

    @rule()
    def time_passes_and_leases_expire(self):
        leases_key = self.buffer.store.key("leases")
        members = self.run(self.client.zrange(leases_key, 0, -1))
        if members:
            self.run(self.client.zadd(leases_key, {m: 0 for m in members}))
        self.run(self.buffer.store.expire())
        self.held.clear()  # the workers are presumed dead (their late submits are still allowed above)

    @rule()
    def buffer_process_restarts(self):
        self.buffer = self._new_buffer()

    @rule(again=st.booleans())
    def get_batch(self, again):
        step = (
            self.next_step - 1
            if again and self.next_step > 0 and (self.next_step - 1) in self.recorded
            else self.next_step
        )
        try:
            part = self.run(self.buffer.get_batch(step, 0, 1, 0.01))
        except DeadlineExceeded:
            return
        ids = [g.group_id for g in part.groups]
        if step in self.recorded:
            assert ids == self.recorded[step], "asking again for a step must return the same batch"
        self.recorded[step] = ids
        for group in part.groups:
            assert group.samples == self.accepted[group.group_id].samples, "a trained group differs from its submit"
        self.next_step = max(self.next_step, step + 1)

    @precondition(lambda self: self.recorded)
    @rule()
    def commit(self):
        step = min(self.recorded)
        self.run(self.buffer.commit(step))
        self.trained += self.recorded.pop(step)

    @invariant()
    def trained_at_most_once(self):
        assert len(self.trained) == len(set(self.trained))
        assert not set(self.trained) & self.filtered

    def teardown(self):
        try:
            self._drain()
        finally:
            self.run(self.client.aclose())
            self.loop.close()

    def _drain(self):
        """Finish the epoch: every worker completes, the trainer takes every full batch."""
        self.time_passes_and_leases_expire()
        while leases := self.run(self.buffer.lease(100, 0, "")).leases:
            for leased in leases:
                self.run(self.buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0])))
                self.accepted.setdefault(leased.group.group_id, None)
        while self.recorded:
            self.commit()
        while True:
            try:
                part = self.run(self.buffer.get_batch(self.next_step, 0, 1, 0.01))
            except DeadlineExceeded:
                break
            self.recorded[self.next_step] = [g.group_id for g in part.groups]
            self.next_step += 1
            self.commit()
        state = self.run(self.buffer.state())
        trained, filtered = set(self.trained), self.filtered
        left = state["num_completed_groups"]
        assert len(self.trained) == len(trained), "a group was trained twice"
        assert left < BATCH, "full batches were left untrained"
        assert len(trained) + len(filtered) + left == NUM_PROMPTS, "a prompt group was lost"
        counted = sum(v for k, v in state["counters"].items() if k.startswith("dropped:"))
        assert counted == len(filtered), "every dropped group is counted with its reason"


def test_random_interleavings_lose_and_duplicate_nothing(redis_url, tokenizer_dir, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i} + 1?"} for i in range(NUM_PROMPTS)])
    BufferMachine.redis_url = redis_url
    BufferMachine.config = BufferConfig(
        prompt_data=str(data),
        hf_checkpoint=str(tokenizer_dir),
        num_data_workers=0,
        num_epoch=1,
        rollout_batch_size=BATCH,
        n_samples_per_prompt=2,
        max_staleness=NUM_PROMPTS,
        rollout_shuffle=True,
    )
    run_state_machine_as_test(
        BufferMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
