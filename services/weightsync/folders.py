"""--update-weight-transport disk: where a sync's checkpoint lies under --update-weight-disk-dir. The trainer writes
it under the staging name and renames it to the version's name once complete, so an engine (told the version's name
by the gateway) never loads a half-written folder. slime's names: `weight_v000042/`."""

import re

PUBLISHED = re.compile(r"^weight_v\d{6,}$")
STAGING = re.compile(r"^\.weight_v\d{6,}\.partial$")


def published(version: int) -> str:
    return f"weight_v{version:06d}"


def staging(version: int) -> str:
    return f".{published(version)}.partial"


def is_published(name: str) -> bool:
    return bool(PUBLISHED.match(name))


def version_of(name: str) -> int | None:
    """The version of a folder named by `published` or `staging`; None for any other name."""
    if not (PUBLISHED.match(name) or STAGING.match(name)):
        return None
    return int(name.strip(".").removesuffix(".partial").removeprefix("weight_v"))
