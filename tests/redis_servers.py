"""`redis_url` on both servers, for the tests whose subject is Redis's state: each runs on the embedded server and on
a real redis:7 container (testcontainers). A test module or conftest opts in with
`from tests.redis_servers import redis_url_on_both  # noqa: F401`."""

import time

import pytest


@pytest.fixture(scope="session", params=["embedded", "redis:7"], name="redis_url")
def redis_url_on_both(request) -> str:
    return request.getfixturevalue("embedded_redis_url" if request.param == "embedded" else "container_redis_url")


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
