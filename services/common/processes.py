"""Child processes that must not outlive the service that started them (embedded Redis, data workers), and the
ports they are given."""

import ctypes
import signal
import socket
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Call in a child (preexec_fn or a pool initializer): it gets `sig` when its parent dies, even by SIGKILL.

    Linux ties this to the parent thread that started the child, so start such children from the main thread."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" for every interface)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
