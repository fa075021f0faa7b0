"""Child processes that must not outlive the service that started them (embedded Redis, data workers), and the
ports they are given."""

import contextlib
import ctypes
import functools
import os
import random
import shutil
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Call in a child (preexec_fn or a pool initializer): it gets `sig` when its parent dies, even by SIGKILL.

    Linux ties this to the parent thread that started the child, so start such children from the main thread."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def tied_to_parent(args: list[str]) -> dict:
    """Popen arguments that start `args` as a child that gets SIGTERM when this process dies, even by SIGKILL.

    Through util-linux's setpriv where it is installed: no Python may run in the child between fork and exec
    (preexec_fn) once gRPC's threads run in this process, as its fork handlers can abort or hang the child."""
    setpriv = shutil.which("setpriv")
    if setpriv:
        return {"args": [setpriv, "--pdeathsig", "TERM", "--", *args]}
    return {"args": args, "preexec_fn": die_with_parent}


def free_port(host: str = "127.0.0.1", within: str = "") -> int:
    """A TCP port free on `host` now ("" for every interface), never one handed out before in this process.

    It is drawn from below the kernel's ephemeral range: a port from that range, once freed here, can be taken by any
    outgoing connection or port-0 listener on the machine before the child binds it; from a share of that where
    `split_port_range` gave this process one (SLIPSTREAM_PORT_RANGE), or from `within` ("low-high") where given."""
    lowest, low = _parse_range(within) if within else _port_range()
    for _ in range(200):
        port = _RANDOM.randrange(lowest, low) if low > lowest else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free TCP port on {host or 'any interface'} below {low}")


def keep_port(port: int) -> None:
    """free_port never hands out `port` in this process (a service's own port, bound only once it is built)."""
    _HANDED_OUT.add(port)


def free_port_pair(offset: int = 1, host: str = "127.0.0.1") -> int:
    """A free port whose port + `offset` is free too (an engine and the weight receiver beside it), both in this
    process's range."""
    lowest, low = _port_range()
    for _ in range(100):
        port = free_port(host)
        if lowest <= port + offset < (low if low > lowest else 65536):
            with contextlib.suppress(OSError), socket.create_server((host, port + offset)):
                return port
    raise OSError(f"no free TCP port on {host} whose port + {offset} is free too")


_LOWEST_PORT = 10_000
_RANDOM = random.SystemRandom()
_HANDED_OUT: set[int] = set()
PORT_RANGE_ENV = "SLIPSTREAM_PORT_RANGE"  # "low-high": where free_port draws, in this process and those it starts


def _port_range() -> tuple[int, int]:
    if value := os.environ.get(PORT_RANGE_ENV):
        return _parse_range(value)
    return _LOWEST_PORT, _ephemeral_low()


def _parse_range(value: str) -> tuple[int, int]:
    low, high = (int(part) for part in value.split("-"))
    return low, high


def split_port_range(index: int, count: int) -> None:
    """This process (and every process it starts) draws ports from the `index`-th of `count` equal shares of the
    range, so that `count` such process trees never hand out the same port."""
    if share := _share(_LOWEST_PORT, _ephemeral_low(), index, count):
        os.environ[PORT_RANGE_ENV] = share


def port_range_share(index: int, count: int) -> str:
    """The `index`-th of `count` equal shares of the range this process draws from, as SLIPSTREAM_PORT_RANGE takes
    it, for a process tree it starts beside others that must not hand out its ports ("" where the range is unknown)."""
    return _share(*_port_range(), index, count)


def _share(lowest: int, low: int, index: int, count: int) -> str:
    if low <= lowest:
        return ""  # the ephemeral range is unknown: any free port
    share = (low - lowest) // count
    return f"{lowest + index * share}-{lowest + (index + 1) * share}"


@functools.cache
def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read: then any free port is drawn)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
