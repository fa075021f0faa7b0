"""`redis_url` on every kind of server, for the tests whose subject is Redis's state: each runs on the embedded
server, on a real redis:7 container (testcontainers) and on a Redis Cluster of three redis-server nodes. A test module
or conftest opts in with `from tests.redis_servers import redis_url_on_both  # noqa: F401`, and opens its clients
with `async_client(redis_url)` (a cluster's URL takes a cluster client)."""

import time

import pytest
import redis.asyncio

from services.common.redis_connection import RedisHandle

SERVERS = {"embedded": "embedded_redis_url", "redis:7": "container_redis_url", "cluster": "cluster_redis_url"}


class ClusterURL(str):
    """The URL of a Redis Cluster's node: its clients are cluster clients."""


@pytest.fixture(scope="session", params=list(SERVERS), name="redis_url")
def redis_url_on_both(request) -> str:
    return request.getfixturevalue(SERVERS[request.param])


def handle(url: str) -> RedisHandle:
    """`url` as a service opens it: a cluster's node with cluster clients."""
    return RedisHandle(url, cluster=isinstance(url, ClusterURL))


def settings(url: str, **more) -> dict:
    """A service's Redis settings (RedisConfig) for `url`."""
    return {"url": url, "cluster": isinstance(url, ClusterURL), **more}


def async_client(url: str):
    """A client of `url` as a service opens it: a cluster client for a cluster's node."""
    return handle(url).async_client()


def skip_without_containers() -> None:
    from tests.conftest import _docker_redis_available

    if not _docker_redis_available():
        pytest.skip("needs testcontainers and a container engine (DOCKER_HOST; `make test` sets one up here)")


def check_redis_password_from_file(command: list[str], mount: str, tmp_path) -> None:
    """`command` run for real in a redis:7 container with a password file mounted at `mount`: the password works, no
    password is refused, and no process in the container has the password on its command line."""
    skip_without_containers()
    from testcontainers.core.container import DockerContainer

    (secret := tmp_path / "redis-password").write_text("deploy-secret-pw\n")
    secret.chmod(0o644)
    container = DockerContainer("redis:7").with_command(command).with_exposed_ports(6379)
    with container.with_volume_mapping(str(secret), mount, "ro"):
        check_redis_password(container, "deploy-secret-pw")


def check_redis_password(container, password: str) -> None:
    """`container`, a started Redis whose password is `password` (port 6379 exposed): the password works, no password
    is refused, and no process in the container has the password on its command line."""
    import redis

    host, port = container.get_container_host_ip(), int(container.get_exposed_port(6379))
    client, deadline = redis.Redis(host, port, password=password), time.monotonic() + 60
    while True:
        try:
            assert client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, container.get_logs()
            time.sleep(0.2)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host, port).ping()
    command_lines = container.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]).output.decode()
    assert "redis-server" in command_lines and password not in command_lines


async def subscribers(client, channel: str) -> int:
    """The clients subscribed to `channel` (on a cluster, on any of its nodes: a publish reaches them all)."""
    if isinstance(client, redis.asyncio.RedisCluster):
        return sum(n for _, n in await client.pubsub_numsub(channel, target_nodes=client.ALL_NODES))
    return (await client.pubsub_numsub(channel))[0][1]
