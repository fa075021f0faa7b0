"""The hosts the gateway may be pointed at by a request: engines registered at run time (RegisterEngine) and the
weight group's master named by PrepareWeightSync. Each is checked against the operator's list of CIDRs and host
patterns, so that a caller cannot make the gateway hand the weights to, or make the engines load weights from, an
address of its choosing. Engines in --engine-urls and those the gateway launches are the operator's own."""

import asyncio
import fnmatch
import ipaddress
from urllib.parse import urlsplit

from services.common.errors import InvalidArgument, PermissionDenied

LOOPBACK = ["127.0.0.0/8", "::1", "localhost"]


class HostList:
    def __init__(self, entries: list[str], setting: str):
        self.entries, self.setting = entries, setting
        self.networks, self.patterns = [], []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.patterns.append(entry.lower())

    async def check(self, host: str, what: str) -> None:
        """Raises PermissionDenied, naming the setting, unless `host` matches a pattern or is (or resolves only to)
        addresses of a listed network."""
        host = host.strip("[]").lower()
        if not host:
            raise InvalidArgument(what, "no host given")
        if any(fnmatch.fnmatchcase(host, pattern) for pattern in self.patterns):
            return
        try:
            addresses = {ipaddress.ip_address(host)}
        except ValueError:
            try:
                found = await asyncio.get_running_loop().getaddrinfo(host, None)
            except (OSError, UnicodeError):
                found = []
            addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in found}
        if addresses and all(any(a in net for net in self.networks) for a in addresses):
            return
        listed = ", ".join(self.entries) or "nothing"
        raise PermissionDenied(
            f"{what}: the host {host} is not allowed by the gateway's --{self.setting} "
            f"({listed}); add a CIDR such as 10.0.0.0/8 or a host pattern such as engine-*.svc "
            "to it"
        )


def url_host(url: str, field: str) -> str:
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as e:
        raise InvalidArgument(field, f"{url[:200]!r} is not a URL ({e}); pass http://host:port") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument(field, f"{url[:200]!r}: engines are reached over http:// or https://")
    return host
