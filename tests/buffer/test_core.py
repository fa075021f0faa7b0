"""The buffer's rules against a real Redis: leases, idempotent submits, partial rollouts, batches, staleness,
backpressure, filters, and continuing after a restart."""

import pytest

from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from tests.buffer.conftest import finish, write_jsonl


async def lease_all(buffer, n):
    result = await buffer.lease(n, 0, "")
    return result.leases


async def test_lease_submit_batch_commit(make_buffer):
    buffer = await make_buffer()
    leases = await lease_all(buffer, 4)
    assert len(leases) == 4
    group = leases[0].group
    assert group.n_samples == 2 and group.label and group.prompt_tokens and group.group_id.startswith("train:e0:")
    assert group.metadata["row"] >= 0
    for leased in leases:
        assert await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0])) == (True, False, "")
    part = await buffer.get_batch(0, 0, 1, 5)
    assert {g.group_id for g in part.groups} == {le.group.group_id for le in leases}
    assert part.total_groups == 4 and part.num_tokens == sum(len(s.tokens) // 4 for g in part.groups for s in g.samples)
    assert await buffer.commit(0) == 4
    assert await buffer.commit(0) == 0  # committing again is harmless
    state = await buffer.state()
    assert state["last_committed_step"] == 0 and state["counters"]["trained"] == 4


async def test_submit_is_idempotent(make_buffer):
    buffer = await make_buffer()
    (leased,) = await lease_all(buffer, 1)
    done = finish(leased.group, [1.0, 0.0])
    assert await buffer.submit(leased.lease_id, done) == (True, False, "")
    assert await buffer.submit(leased.lease_id, done) == (False, True, "")
    assert (await buffer.state())["num_completed_groups"] == 1


async def test_expired_lease_returns_the_group_and_a_late_submit_counts_once(make_buffer):
    buffer = await make_buffer()
    first = (await buffer.lease(1, 0.05, "")).leases[0]
    import asyncio

    await asyncio.sleep(0.1)
    again = (await buffer.lease(1, 0, "")).leases[0]
    assert again.group.group_id == first.group.group_id and again.lease_id != first.lease_id
    # The first worker was only slow: its late submit is accepted, the second one's is a duplicate.
    assert (await buffer.submit(first.lease_id, finish(first.group, [1.0, 0.0])))[0]
    assert (await buffer.submit(again.lease_id, finish(again.group, [1.0, 0.0])))[1]
    state = await buffer.state()
    assert state["num_completed_groups"] == 1 and state["counters"]["expired"] == 1


async def test_release_with_partial_samples_comes_back_first(make_buffer):
    buffer = await make_buffer()
    leases = await lease_all(buffer, 2)
    partial = finish(leases[1].group, [0.0])
    await buffer.release(leases[1].lease_id, list(partial.samples))
    (back,) = await lease_all(buffer, 1)
    assert back.group.group_id == leases[1].group.group_id
    assert [s.sample_id for s in back.group.samples] == [partial.samples[0].sample_id]
    with pytest.raises(NotFound, match="is not held"):
        await buffer.release(leases[1].lease_id, [])


async def test_extend(make_buffer):
    buffer = await make_buffer()
    (leased,) = await lease_all(buffer, 1)
    deadline, extended, expired = await buffer.extend([leased.lease_id, "train:e9:b0:r0#1"], 1000)
    assert extended == [leased.lease_id] and expired == ["train:e9:b0:r0#1"] and deadline > leased.deadline_ms


async def test_bad_requests_name_the_field(make_buffer):
    buffer = await make_buffer()
    with pytest.raises(InvalidArgument, match="max_groups: must be >= 0"):
        await buffer.lease(-1, 0, "")
    with pytest.raises(InvalidArgument, match="dataset: unknown dataset 'nope'; known: train"):
        await buffer.lease(1, 0, "nope")
    with pytest.raises(NotFound, match="unknown to this run"):
        await buffer.submit("train:e0:b0:r99#1", finish((await lease_all(buffer, 1))[0].group, [1, 0]))
    with pytest.raises(InvalidArgument, match="lease_id"):
        await buffer.submit("garbage", finish((await lease_all(buffer, 1))[0].group, [1, 0]))
    (leased,) = await lease_all(buffer, 1)
    with pytest.raises(InvalidArgument, match=r"group.samples: expected 2 samples \(--n-samples-per-prompt\), got 1"):
        await buffer.submit(leased.lease_id, finish(leased.group, [1.0]))
    bad = finish(leased.group, [1.0, 0.0])
    bad.samples[1].loss_mask += b"\x01"
    with pytest.raises(InvalidArgument, match=r"group.samples\[1\].loss_mask: has 4 entries"):
        await buffer.submit(leased.lease_id, bad)
    with pytest.raises(InvalidArgument, match="dp_size: --rollout-batch-size 4 is not divisible by dp_size 3"):
        await buffer.get_batch(0, 0, 3, 1)
    with pytest.raises(InvalidArgument, match="step: must be >= 0"):
        await buffer.get_batch(-1, 0, 1, 1)


async def test_get_batch_returns_the_same_batch_and_balances_ranks(make_buffer):
    buffer = await make_buffer(rollout_batch_size=4, max_staleness=1)
    leases = await lease_all(buffer, 8)
    for i, leased in enumerate(leases):
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], response_len=1 + 10 * i))
    parts = [await buffer.get_batch(0, rank, 2, 5) for rank in range(2)]
    again = [await buffer.get_batch(0, rank, 2, 5) for rank in range(2)]
    ids = [[g.group_id for g in p.groups] for p in parts]
    assert ids == [[g.group_id for g in p.groups] for p in again]
    assert len(ids[0]) == len(ids[1]) == 2 and not set(ids[0]) & set(ids[1])
    assert [g.group_id for g in (await buffer.get_batch(0, 0, 1, 5)).groups] == sorted(
        ids[0] + ids[1], key=lambda x: [le.group.group_id for le in leases].index(x)
    )
    assert abs(parts[0].num_tokens - parts[1].num_tokens) <= 20  # greedy balance of 4 groups of 1, 11, 21, 31 tokens


async def test_steps_in_order_and_commit_in_order(make_buffer):
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=2)
    for leased in await lease_all(buffer, 4):
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0]))
    with pytest.raises(FailedPrecondition, match="ask for step 0 before step 1"):
        await buffer.get_batch(1, 0, 1, 1)
    await buffer.get_batch(0, 0, 1, 1)
    await buffer.get_batch(1, 0, 1, 1)
    with pytest.raises(FailedPrecondition, match="commit step 0 first"):
        await buffer.commit(1)
    await buffer.commit(0)
    await buffer.commit(1)
    with pytest.raises(FailedPrecondition, match="step 0 was already committed"):
        await buffer.get_batch(0, 0, 1, 1)


async def test_get_batch_times_out_with_a_reason(make_buffer):
    buffer = await make_buffer()
    with pytest.raises(DeadlineExceeded, match=r"step 0: only 0 of 4 groups were ready .* are rollout workers running"):
        await buffer.get_batch(0, 0, 1, 0.2)


async def test_staleness_bound_stops_leasing_until_the_policy_moves(make_buffer):
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=0)
    assert len(await lease_all(buffer, 10)) == 2
    blocked = await buffer.lease(1, 0, "")
    assert blocked.leases == [] and blocked.blocked == "staleness"
    await buffer.set_policy_version(1)
    assert len(await lease_all(buffer, 10)) == 2
    with pytest.raises(FailedPrecondition, match="only grows"):
        await buffer.set_policy_version(0)


async def test_groups_that_go_back_start_within_the_staleness_bound(make_buffer):
    # Synchronous: step 1 was handed out and a group of step 2 leased when the trainer resumed at step 1 (policy 1).
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=0)
    for version in (0, 1):
        for leased in await lease_all(buffer, 10):
            await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=version))
        await buffer.get_batch(version, 0, 1, 1)
        await buffer.set_policy_version(version + 1)
        if version == 0:
            await buffer.commit(0)
    assert len(await lease_all(buffer, 10)) == 2
    assert await buffer.rewind(1, 1) == 4

    # The four go back, but only step 1's worth starts under policy 1: the others would be stale at step 2.
    for version in (1, 2):
        leases = await lease_all(buffer, 10)
        assert len(leases) == 2 and (await buffer.lease(1, 0, "")).blocked == "staleness"
        for leased in leases:
            await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=version))
        await buffer.get_batch(version, 0, 1, 1)
        await buffer.commit(version)
        await buffer.set_policy_version(version + 1)
    assert "dropped:stale" not in (await buffer.state())["counters"]


async def test_one_step_of_overlap(make_buffer):
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=1)
    assert len(await lease_all(buffer, 10)) == 4


async def test_old_groups_are_dropped_and_counted(make_buffer):
    # Over-sampling lets three groups start at version 0, but step 1 may only train version >= 1.
    buffer = await make_buffer(rollout_batch_size=1, max_staleness=0, over_sampling_batch_size=3)
    leases = await lease_all(buffer, 3)
    for leased in leases:
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=0))
    part = await buffer.get_batch(0, 0, 1, 1)
    assert [g.group_id for g in part.groups] == [leases[0].group.group_id]
    await buffer.commit(0)
    await buffer.set_policy_version(1)
    with pytest.raises(DeadlineExceeded):
        await buffer.get_batch(1, 0, 1, 0.2)
    assert (await buffer.state())["counters"]["dropped:stale"] == 2


async def test_stale_groups_can_be_kept_and_marked(make_buffer):
    buffer = await make_buffer(rollout_batch_size=1, max_staleness=0, over_sampling_batch_size=2, stale_policy="mark")
    leases = await lease_all(buffer, 2)
    for leased in leases:
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=0))
    await buffer.get_batch(0, 0, 1, 1)
    await buffer.commit(0)
    part = await buffer.get_batch(1, 0, 1, 1)
    assert part.groups[0].min_weight_version == 0  # the trainer sees it is one version behind


async def test_backpressure_stops_leases(make_buffer):
    buffer = await make_buffer(max_buffered_groups=3, max_staleness=5)
    assert len(await lease_all(buffer, 10)) == 3
    result = await buffer.lease(1, 0, "")
    assert result.leases == [] and result.blocked == "backpressure"


async def test_dynamic_sampling_filter_drops_and_counts(make_buffer):
    buffer = await make_buffer(dynamic_sampling_filter_path="services.buffer.filters:check_reward_nonzero_std")
    leases = await lease_all(buffer, 2)
    assert await buffer.submit(leases[0].lease_id, finish(leases[0].group, [1.0, 1.0])) == (
        False,
        False,
        "zero_std_1.0",
    )
    assert await buffer.submit(leases[1].lease_id, finish(leases[1].group, [1.0, 0.0])) == (True, False, "")
    state = await buffer.state()
    assert state["counters"]["dropped:zero_std_1.0"] == 1 and state["num_completed_groups"] == 1
    # A dropped group frees its place under the staleness bound: a replacement can be leased.
    assert len(await lease_all(buffer, 10)) == 3


async def test_custom_buffer_filter_selects_the_batch(make_buffer, tmp_path):
    plugin = tmp_path / "pick.py"
    plugin.write_text("def newest(args, rollout_id, buffer, num_samples):\n    return buffer[-num_samples:]\n")
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=1, buffer_filter_path=f"{plugin}:newest")
    leases = await lease_all(buffer, 4)
    for leased in leases:
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0]))
    part = await buffer.get_batch(0, 0, 1, 1)
    assert [g.group_id for g in part.groups] == [le.group.group_id for le in leases[2:]]


async def test_epochs_end_and_every_prompt_is_handed_out_once(make_buffer):
    buffer = await make_buffer(num_epoch=2, max_staleness=100, rollout_shuffle=True)
    seen = [le.group.group_id for le in await lease_all(buffer, 100)]
    assert len(seen) == 40 and len(set(seen)) == 40
    epoch0 = [gid.split(":", 2)[2] for gid in seen[:20]]
    epoch1 = [gid.split(":", 2)[2] for gid in seen[20:]]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1  # reshuffled
    assert (await buffer.lease(1, 0, "")).blocked == "exhausted"


async def test_a_new_buffer_process_continues_where_the_last_stopped(make_buffer):
    buffer = await make_buffer(max_staleness=100)
    first = [le.group.group_id for le in await lease_all(buffer, 5)]
    restarted = await make_buffer(max_staleness=100, run_id=buffer.config.run_id)
    second = [le.group.group_id for le in await lease_all(restarted, 5)]
    assert not set(first) & set(second)


async def test_eval_sets_are_leased_separately(make_buffer, prompts_file):
    buffer = await make_buffer(eval_prompt_data=["aime", f"{prompts_file}@[0:3]"], n_samples_per_eval_prompt=3)
    leases = (await buffer.lease(5, 0, "aime")).leases
    assert len(leases) == 5 and leases[0].group.dataset == "aime" and leases[0].group.n_samples == 3
    assert await buffer.submit(leases[0].lease_id, finish(leases[0].group, [1.0, 0.0, 1.0])) == (True, False, "")
    state = await buffer.state()
    assert state["num_completed_groups"] == 0 and state["counters"]["eval_completed"] == 1


async def test_an_eval_config_set_has_its_own_keys_reward_type_and_samples(make_buffer, prompts_file, tmp_path):
    """Training reads `prompt`/`label`; the set "qa" of slime's --eval-config reads `question`/`answer`."""
    rows = [{"question": f"Q{i}?", "answer": f"A{i}", "metadata": {"row": i, "rm_type": "math"}} for i in range(3)]
    qa = write_jsonl(tmp_path / "qa.jsonl", rows)
    config = tmp_path / "eval.yaml"
    config.write_text(
        "eval:\n  defaults: {n_samples_per_eval_prompt: 2}\n  datasets:\n"
        f"    - {{name: qa, path: '{qa}', input_key: question, label_key: answer, rm_type: f1, "
        "n_samples_per_eval_prompt: 5, metadata_overrides: {lang: en}}\n"
        f"    - {{name: same, path: '{prompts_file}@[0:2]'}}\n"
    )
    buffer = await make_buffer(eval_config=str(config))
    qa_groups = [le.group for le in (await buffer.lease(3, 0, "qa")).leases]
    assert [(g.prompt_text, g.label, g.n_samples) for g in qa_groups] == [(f"Q{i}?", f"A{i}", 5) for i in range(3)]
    assert dict(qa_groups[0].metadata) == {"row": 0, "rm_type": "f1", "lang": "en"}  # the set's reward type wins
    same = (await buffer.lease(1, 0, "same")).leases[0].group
    assert (same.prompt_text, same.label, same.n_samples) == ("What is 0 + 0?", "0", 2)
    train = (await lease_all(buffer, 1))[0].group
    assert train.dataset == "train" and train.prompt_text.startswith("What is") and train.n_samples == 2
    assert (await buffer.state())["eval_datasets"] == ["qa", "same"]


async def test_num_rollout_bounds_the_run(make_buffer):
    buffer = await make_buffer(rollout_batch_size=2, num_rollout=2, max_staleness=10)
    assert len(await lease_all(buffer, 100)) == 4
    assert (await buffer.lease(1, 0, "")).blocked == "exhausted"
    with pytest.raises(FailedPrecondition, match="the run has --num-rollout 2 steps"):
        await buffer.get_batch(2, 0, 1, 0.1)


async def test_custom_prompt_source(make_buffer, tmp_path):
    plugin = tmp_path / "source.py"
    plugin.write_text(
        "class Source:\n"
        "    def __init__(self, args):\n"
        "        self.n = 0\n"
        "    def get_samples(self, num_samples):\n"
        "        out = []\n"
        "        for _ in range(num_samples):\n"
        "            out.append([{'prompt': f'Generated {self.n}', 'label': str(self.n), 'metadata': {'k': self.n}}])\n"
        "            self.n += 1\n"
        "        return out\n"
    )
    buffer = await make_buffer(prompt_data=None, data_source_path=f"{plugin}:Source", max_staleness=10)
    leases = await lease_all(buffer, 3)
    assert [le.group.prompt_text for le in leases] == ["Generated 0", "Generated 1", "Generated 2"]
    assert [le.group.label for le in leases] == ["0", "1", "2"]
    assert leases[2].group.group_id == "train:custom:r2" and leases[2].group.metadata["k"] == 2


async def test_rewind_to_a_checkpoint_generates_the_lost_steps_again(make_buffer):
    # Steps 0 and 1 were handed out and step 0 committed; the trainer resumes from its checkpoint of step 1 (policy 1).
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=2)
    leases = await lease_all(buffer, 6)
    for leased in leases[:4]:
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=1))
    await buffer.submit(leases[4].lease_id, finish(leases[4].group, [0.0, 1.0], version=2))  # newer than the checkpoint
    await buffer.get_batch(0, 0, 1, 1)
    step1 = {g.group_id for g in (await buffer.get_batch(1, 0, 1, 1)).groups}
    unscored = finish(leases[5].group, [0.0, 1.0], version=1)  # not batched yet: its reward failed (since fixed)
    unscored.samples[0].reward_error.kind = "exception"
    await buffer.submit(leases[5].lease_id, unscored)
    await buffer.commit(0)
    await buffer.set_policy_version(2)
    leases += await lease_all(buffer, 2)
    assert len(leases) == 8
    await buffer.submit(leases[7].lease_id, finish(leases[7].group, [0.0, 1.0], version=1))  # kept: of policy 1

    # Step 1's batch, the group of policy 2, the one whose reward failed and the leased one go back without their
    # samples.
    assert await buffer.rewind(1, 1) == 5
    state = await buffer.state()
    assert state["policy_version"] == 1 and state["num_leased_groups"] == 0 and state["num_completed_groups"] == 1
    again = await lease_all(buffer, 10)
    back = {leased.group.group_id for leased in again}
    assert back >= step1 | {leases[i].group.group_id for i in (4, 5, 6)}
    assert all(not leased.group.samples for leased in again if leased.group.group_id in back)
    for leased in again[:1]:
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=1))
    assert len((await buffer.get_batch(1, 0, 1, 1)).groups) == 2  # step 1 is built anew, with the kept group
    with pytest.raises(FailedPrecondition, match="resume from a checkpoint of step 1 or later"):
        await buffer.rewind(0, 0)


async def test_a_rewind_commits_the_steps_its_checkpoint_covers_whose_commit_was_lost(make_buffer):
    # Steps 0 and 1 were handed out; the trainer saved its checkpoint of step 2 and died before committing step 1.
    buffer = await make_buffer(rollout_batch_size=2, max_staleness=2)
    for leased in await lease_all(buffer, 4):
        await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0], version=0))
    await buffer.get_batch(0, 0, 1, 1)
    step1 = {g.group_id for g in (await buffer.get_batch(1, 0, 1, 1)).groups}
    await buffer.commit(0)

    assert await buffer.rewind(2, 2) == 0  # step 1 is in the checkpoint: committed, not generated again
    status = await buffer.store.redis.hgetall(buffer.store.key("status"))
    assert {status[gid.encode()] for gid in step1} == {b"trained:1"}
    assert await buffer.store.violations() == []
    with pytest.raises(FailedPrecondition, match="already committed"):
        await buffer.get_batch(1, 0, 1, 1)
