"""What ``AUK_REDIS_URL`` says, parsed without connecting: one server (``redis://``, ``rediss://``, ``unix://``) or
Redis Sentinel (every sentinel, ``;``-separated, the database number at the end). The settings validate the URL with
this; ``redis.py`` builds the clients from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from auk_worker.errors import ConfigError

SENTINEL_SCHEME = "sentinel"


@dataclass(frozen=True)
class SentinelAddress:
    """A parsed Sentinel ``AUK_REDIS_URL``."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    password: str | None = None
    username: str | None = None


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str, name: str = "AUK_REDIS_URL") -> SentinelAddress:
    """``sentinel://[[user]:password@]host:port[/db];sentinel://host:port[/db]...``; ConfigError naming ``name``."""
    hosts: list[tuple[str, int]] = []
    dbs: set[int] = set()
    password = username = None
    for part in (p.strip() for p in url.split(";")):
        parsed = urlparse(part)
        try:
            port = parsed.port
        except ValueError:
            port = None
        if parsed.scheme != SENTINEL_SCHEME or not parsed.hostname or port is None:
            raise ConfigError(f"{name}: {part!r} is not sentinel://host:port (every ';'-separated part must be)")
        path = parsed.path.strip("/")
        if path:
            if not path.isdigit():
                raise ConfigError(f"{name}: the database in {part!r} must be a number")
            dbs.add(int(path))
        if parsed.password is not None:
            password, username = unquote(parsed.password), unquote(parsed.username) if parsed.username else None
        hosts.append((parsed.hostname, port))
    if len(dbs) > 1:
        raise ConfigError(f"{name}: the sentinels name different databases {sorted(dbs)}; give one, at the end")
    return SentinelAddress(tuple(hosts), dbs.pop() if dbs else 0, password, username)
