"""A buffer on a Redis Cluster of three nodes (the buffer's other tests run there too): each run's keys live on the
node that owns its hash slot, so runs spread over the nodes and each run's scripts run where its keys are."""

import pytest

from tests.buffer.conftest import finish


@pytest.fixture
def redis_url(cluster_redis_url):
    return cluster_redis_url


async def test_each_runs_keys_live_on_one_node_and_runs_spread_over_the_nodes(make_buffer):
    runs = {}
    for _ in range(6):
        buffer = await make_buffer(rollout_batch_size=1)
        (leased,) = (await buffer.lease(1, 0, "")).leases
        assert await buffer.submit(leased.lease_id, finish(leased.group, [0.0, 1.0])) == (True, False, "")
        assert [g.group_id for g in (await buffer.get_batch(0, 0, 1, 5)).groups] == [leased.group.group_id]
        runs[buffer.store.ns] = buffer.store.redis
    client = next(iter(runs.values()))
    holders = {}
    for node in client.get_primaries():
        for key in await client.execute_command("KEYS", "test:*", target_nodes=node):
            holders.setdefault(key.decode().split("}", 1)[0] + "}", set()).add(node.port)
    holders = {ns: ports for ns, ports in holders.items() if ns in runs}  # not other tests' runs on the same cluster
    assert set(holders) == set(runs) and all(len(ports) == 1 for ports in holders.values()), holders
    assert len({port for ports in holders.values() for port in ports}) >= 2  # six runs: not all on one of three
