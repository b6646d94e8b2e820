"""Decide whether a URL a caller gave may be fetched or called, and pin the request to the address that was checked.

A caller-given URL (a webhook, a reference clip to fetch) must not make the service reach its own network: the
guard accepts ``http`` and ``https`` only, resolves the host, and refuses any address that is loopback, private
(RFC 1918, unique local ``fc00::/7``), link-local, a cloud metadata endpoint, unspecified, multicast, reserved or
special-purpose, or carrier-grade NAT (``100.64.0.0/10``) -- also when written as an IPv4-mapped, IPv4-compatible,
NAT64 or 6to4 IPv6 address. Numeric hosts must be canonical: ``http://2130706433/``, ``http://0x7f.1/`` or
``http://0177.0.0.1/`` are refused, since parsers disagree on what they mean. Names that only ever mean the local
machine or a metadata service (``localhost``, ``metadata.google.internal``) are refused before resolving.

Configuration can allow what would be refused: a ``UrlPolicy`` lists host names (``hooks.internal``,
``*.svc.cluster.local``) whose addresses are not checked, and networks (``127.0.0.1``, ``10.0.0.0/8``) whose
addresses are allowed. With ``public=False`` only listed hosts and networks are allowed at all (the reference-clip
fetch: "a remote URL is refused unless an allow-list names its host").

``UrlGuard.check`` returns a ``CheckedUrl`` holding the address to connect to, and ``pinned_request`` sends an httpx
request to that address with the original ``Host`` header and TLS server name, so that a second DNS answer (DNS
rebinding) cannot move the request after the check. Redirects are never followed.

Torch-free; every refusal is an ``InputError`` subclass with a stable code.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from auk_worker.errors import InputError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Sequence[str]]

MAX_URL_LENGTH = 2048
DEFAULT_PORTS = {"http": 80, "https": 443}


class UrlError(InputError):
    """The URL is malformed: no host, a bad port, characters parsers disagree on."""

    code = "invalid_url"


class UrlNotAllowed(UrlError):
    """The URL is well formed but may not be called: its scheme, host or address is refused."""

    code = "url_not_allowed"


class UrlUnresolvable(UrlError):
    """The host name does not resolve (now: DNS may answer later)."""

    code = "url_unresolvable"


def _nets(*cidrs: str) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(c) for c in cidrs)


# Refused address ranges, first match names the reason. Metadata comes before link-local so that its own name
# is the one a caller reads. Anything not listed that Python does not call globally routable is refused too.
BLOCKED: tuple[tuple[str, tuple[IPNetwork, ...]], ...] = (
    ("unspecified", _nets("0.0.0.0/8", "::/128")),
    ("loopback", _nets("127.0.0.0/8", "::1/128")),
    # AWS/GCP/Azure/OpenStack (169.254.169.254), AWS over IPv6, Azure's wire server, Alibaba Cloud.
    ("cloud metadata", _nets("169.254.169.254/32", "fd00:ec2::254/128", "168.63.129.16/32", "100.100.100.200/32")),
    ("link-local", _nets("169.254.0.0/16", "fe80::/10")),
    ("private", _nets("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7", "fec0::/10")),
    ("carrier-grade NAT", _nets("100.64.0.0/10")),
    ("multicast", _nets("224.0.0.0/4", "ff00::/8")),
    ("reserved", _nets("240.0.0.0/4", "100::/64", "2001::/23")),
    ("special-purpose", _nets("192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24",
                              "203.0.113.0/24", "2001:db8::/32")),
)

# Names that mean this machine or a metadata service wherever they resolve.
BLOCKED_NAMES = (
    "localhost", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPAT = ipaddress.ip_network("::/96")
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC_LABEL = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$")


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries: IPv4-mapped, IPv4-compatible, NAT64 (64:ff9b::/96) or 6to4."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _COMPAT and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def refusal_reason(address: IPAddress) -> str | None:
    """Why ``address`` may not be called, as the words before "address" (``"loopback"``, ``"IPv6 form of
    127.0.0.1, a loopback"``); None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            reason = refusal_reason(inner)
            return f"IPv6 form of {inner}, {_article(reason)} {reason}" if reason else None
    for reason, networks in BLOCKED:
        if any(address in net for net in networks if net.version == address.version):
            return reason
    if not address.is_global:
        return "reserved"
    return None


def _article(words: str) -> str:
    return "an" if words[:1].lower() in "aeiou" else "a"


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for a TCP connection, in the resolver's order, without duplicates."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        text = str(sockaddr[0]).split("%", 1)[0]
        if text not in addresses:
            addresses.append(text)
    return addresses


def _host_pattern(entry: str) -> str:
    name = entry.strip().lower().rstrip(".")
    bare = name[2:] if name.startswith("*.") else name
    if not bare or not all(_LABEL.match(label) for label in bare.split(".")):
        raise ValueError(f"{entry!r} is neither a network (CIDR or address) nor a host name")
    return name


@dataclass(frozen=True)
class UrlPolicy:
    """What configuration allows beyond public addresses.

    ``hosts``: names (exact, or ``*.example.com`` for any name under it) called whatever they resolve to.
    ``networks``: addresses allowed although refused otherwise (``127.0.0.1/32`` for tests).
    ``public``: whether other hosts with public addresses are allowed; False allows only what is listed.
    """

    hosts: frozenset[str] = frozenset()
    networks: tuple[IPNetwork, ...] = ()
    public: bool = True

    @classmethod
    def parse(cls, entries: str | Iterable[str], *, public: bool = True) -> UrlPolicy:
        """Build a policy from a list (or a comma/space separated string) of CIDRs, addresses and host names."""
        items = entries.replace(",", " ").split() if isinstance(entries, str) else [e.strip() for e in entries]
        hosts: set[str] = set()
        networks: list[IPNetwork] = []
        for item in filter(None, items):
            try:
                networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                hosts.add(_host_pattern(item))
        return cls(frozenset(hosts), tuple(networks), public)

    def host_listed(self, host: str) -> bool:
        return host in self.hosts or any(
            pattern.startswith("*.") and host.endswith(pattern[1:]) for pattern in self.hosts
        )

    def network_listed(self, address: IPAddress) -> bool:
        candidates = [address]
        if isinstance(address, ipaddress.IPv6Address) and (inner := embedded_ipv4(address)) is not None:
            candidates.append(inner)
        return any(a in net for a in candidates for net in self.networks if net.version == a.version)


@dataclass(frozen=True)
class CheckedUrl:
    """A URL that passed the guard, with the address to connect to (every address it resolved to was allowed)."""

    url: str
    scheme: str
    host: str  # lower case, ASCII (IDNA), no brackets, no trailing dot
    port: int
    target: str  # path and query, at least "/"
    address: str
    addresses: tuple[str, ...] = field(default=())

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    @property
    def pinned_url(self) -> str:
        """The URL with its host replaced by the checked address."""
        address = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.scheme}://{address}:{self.port}{self.target}"


class UrlGuard:
    """Checks URLs against a ``UrlPolicy``; ``resolver`` is injectable so that tests can play any DNS answer."""

    def __init__(self, policy: UrlPolicy | None = None, resolver: Resolver = system_resolver) -> None:
        self.policy = policy or UrlPolicy()
        self.resolver = resolver

    def check(self, url: str) -> CheckedUrl:
        """Parse, resolve and check ``url``; raise ``UrlError`` (or a subclass) naming what is refused."""
        scheme, host, port, target, literal = _parse(url)
        listed = self.policy.host_listed(host)
        if literal is None and not listed and _is_blocked_name(host):
            raise UrlNotAllowed(f"{host!r} names this machine or a metadata service and is not called")
        addresses = [literal] if literal is not None else self._resolve(host, port)
        for address in addresses:
            if listed or self.policy.network_listed(address):
                continue
            if not self.policy.public:
                raise UrlNotAllowed(f"host {host!r} is not on the allow-list of hosts this service may call")
            reason = refusal_reason(address)
            if reason is not None:
                seen = "is" if literal is not None else f"resolves to {address}, which is"
                raise UrlNotAllowed(f"{host!r} {seen} {_article(reason)} {reason} address; only public addresses are "
                                    "called unless configuration allows more")
        first = addresses[0]
        connect = (first.ipv4_mapped or first) if isinstance(first, ipaddress.IPv6Address) else first
        return CheckedUrl(url, scheme, host, port, target, str(connect), tuple(str(a) for a in addresses))

    def _resolve(self, host: str, port: int) -> list[IPAddress]:
        try:
            answers = self.resolver(host, port)
        except (OSError, UnicodeError) as exc:
            raise UrlUnresolvable(f"host {host!r} does not resolve ({exc})") from None
        if not answers:
            raise UrlUnresolvable(f"host {host!r} does not resolve (no addresses)")
        return [ipaddress.ip_address(a) for a in answers]


def _parse(url: str) -> tuple[str, str, int, str, IPAddress | None]:
    """(scheme, host, port, target, the host's address when it is an IP literal) or a ``UrlError``."""
    if not isinstance(url, str) or not url:
        raise UrlError("the URL is empty")
    if len(url) > MAX_URL_LENGTH:
        raise UrlError(f"the URL is longer than {MAX_URL_LENGTH} characters")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 or ch == "\\" for ch in url):
        raise UrlError("the URL holds spaces, control characters or backslashes")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise UrlError("the URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        given = f"not {scheme!r}" if scheme else "and this URL has no scheme"
        raise UrlNotAllowed(f"only http and https URLs are called, {given}")
    if "@" in parts.netloc:
        raise UrlError("the URL must not carry a user name or password")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise UrlError(f"the URL's port is not a number from 1 to 65535 ({parts.netloc!r})")
    port = port or DEFAULT_PORTS[scheme]
    raw_host = parts.hostname or ""
    if not raw_host:
        raise UrlError("the URL has no host")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.netloc.startswith("["):
        if "%" in raw_host:
            raise UrlNotAllowed("IPv6 zone identifiers (link-local scopes) are not called")
        try:
            address = ipaddress.IPv6Address(raw_host)
        except ValueError:
            raise UrlError(f"{raw_host!r} is not an IPv6 address") from None
        return scheme, str(address), port, target, address
    host = _ascii_host(raw_host)
    labels = host.split(".")
    if _NUMERIC_LABEL.match(labels[-1]):  # a numeric last label makes the whole host an IPv4 address to parsers
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            meaning = _loose_ipv4(labels)
            said = f" (read by some parsers as {meaning})" if meaning else ""
            raise UrlNotAllowed(f"numeric host {host!r} is not a canonical dotted IPv4 address{said}") from None
        return scheme, host, port, target, address
    return scheme, host, port, target, None


def _ascii_host(raw: str) -> str:
    host = raw.lower().rstrip(".")
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        raise UrlError(f"{raw!r} is not a valid host name") from None
    if not host or not all(_LABEL.match(label) for label in host.split(".")):
        raise UrlError(f"{raw!r} is not a valid host name")
    return host


def _loose_ipv4(labels: list[str]) -> str | None:
    """What ``inet_aton`` makes of a numeric host (decimal, 0x hex and 0-octal parts, 1 to 4 of them), or None."""
    if not 1 <= len(labels) <= 4:
        return None
    try:
        values = [int(p, 16) if p.startswith("0x") else int(p, 8) if len(p) > 1 and p[0] == "0" else int(p)
                  for p in labels]
    except ValueError:
        return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = sum(v << (8 * (3 - i)) for i, v in enumerate(head)) + last
    return str(ipaddress.IPv4Address(number))


def _is_blocked_name(host: str) -> bool:
    return any(host == name or host.endswith("." + name) for name in BLOCKED_NAMES)


def pinned_request(client: httpx.Client, method: str, checked: CheckedUrl, *, headers: dict[str, str] | None = None,
                   content: bytes | None = None, timeout: float | httpx.Timeout | None = None,
                   stream: bool = False) -> httpx.Response:
    """Send one request to ``checked.address`` (not a fresh DNS answer), with the original ``Host`` header and, over
    TLS, the original host as the server name for SNI and certificate checks. Redirects are not followed: a 3xx
    is returned as it is, since its target was never checked. With ``stream`` the body is left unread (close the
    response). For TLS, give a client that keeps no idle connections
    (``httpx.Limits(max_keepalive_connections=0)``): a pooled connection to an address was verified for the host
    that opened it, and would be reused for another host on the same address."""
    sent_headers = {**(headers or {}), "Host": checked.host_header}
    extensions = {"sni_hostname": checked.host} if checked.scheme == "https" else {}
    request = client.build_request(method, checked.pinned_url, headers=sent_headers, content=content,
                                   extensions=extensions,
                                   timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
    return client.send(request, follow_redirects=False, stream=stream)
