"""The URL guard: every refused category, the numeric tricks, the allow-list, and requests pinned to the checked
address (a real HTTP server on loopback, and a real TLS server checking SNI and the certificate's name)."""

from __future__ import annotations

import http.server
import ipaddress
import ssl
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from auk_worker.errors import InputError
from auk_worker.urlguard import (
    UrlError,
    UrlGuard,
    UrlNotAllowed,
    UrlPolicy,
    UrlUnresolvable,
    pinned_request,
    refusal_reason,
)

PUBLIC = "93.184.215.14"


def dns(table: dict[str, list[str]]):
    """A resolver answering from ``table``; an unknown name fails like a real lookup."""

    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return table[host]

    return resolve


def refused(url: str, guard: UrlGuard | None = None) -> UrlError:
    guard = guard or UrlGuard(resolver=dns({}))
    with pytest.raises(UrlError) as info:
        guard.check(url)
    assert isinstance(info.value, InputError)
    return info.value


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1/", "loopback"),
        ("http://127.8.9.10:8080/x", "loopback"),
        ("http://[::1]/", "loopback"),
        ("http://10.1.2.3/", "private"),
        ("http://172.16.0.1/", "private"),
        ("http://172.31.255.255/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://[fd12:3456::1]/", "private"),
        ("http://[fc00::1]/", "private"),
        ("http://169.254.1.1/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
        ("http://168.63.129.16/", "cloud metadata"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://0.1.2.3/", "unspecified"),
        ("http://[::]/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://239.1.2.3/", "multicast"),
        ("http://[ff02::1]/", "multicast"),
        ("http://240.0.0.1/", "reserved"),
        ("http://255.255.255.255/", "reserved"),
        ("http://192.0.2.1/", "special-purpose"),
        ("http://198.18.0.1/", "special-purpose"),
        ("http://[2001:db8::1]/", "special-purpose"),
        ("http://100.64.0.1/", "carrier-grade NAT"),
        ("http://100.127.255.254/", "carrier-grade NAT"),
        ("http://[::ffff:127.0.0.1]/", "IPv6 form of 127.0.0.1, a loopback"),
        ("http://[::ffff:7f00:1]/", "IPv6 form of 127.0.0.1, a loopback"),
        ("http://[::ffff:169.254.169.254]/", "IPv6 form of 169.254.169.254, a cloud metadata"),
        ("http://[::ffff:10.0.0.1]/", "IPv6 form of 10.0.0.1, a private"),
        ("http://[::127.0.0.1]/", "IPv6 form of 127.0.0.1, a loopback"),
        ("http://[64:ff9b::7f00:1]/", "IPv6 form of 127.0.0.1, a loopback"),
        ("http://[2002:a9fe:a9fe::]/", "IPv6 form of 169.254.169.254, a cloud metadata"),
    ],
)
def test_refused_address_literals_name_their_category(url: str, words: str) -> None:
    error = refused(url)
    assert isinstance(error, UrlNotAllowed) and error.code == "url_not_allowed"
    assert f"{words} address" in error.message


@pytest.mark.parametrize(
    ("url", "meaning"),
    [
        ("http://2130706433/", "127.0.0.1"),
        ("http://0x7f.1/", "127.0.0.1"),
        ("http://0x7f000001/", "127.0.0.1"),
        ("http://017700000001/", "127.0.0.1"),
        ("http://0177.0.0.1/", "127.0.0.1"),
        ("http://127.1/", "127.0.0.1"),
        ("http://127.0.1/", "127.0.0.1"),
        ("http://0/", "0.0.0.0"),
        ("http://0xa9.0xfe.0xa9.0xfe/", "169.254.169.254"),
        ("http://134744072/", "8.8.8.8"),  # even a public address: what it means depends on the parser
        ("http://1.2.3.256/", None),
        ("http://example.123/", None),
    ],
)
def test_numeric_tricks_are_refused(url: str, meaning: str | None) -> None:
    error = refused(url)
    assert isinstance(error, UrlNotAllowed) and "not a canonical dotted IPv4 address" in error.message
    if meaning:
        assert f"read by some parsers as {meaning})" in error.message


def test_fullwidth_digits_normalise_to_the_address_they_spell() -> None:
    assert "loopback address" in refused("http://１２７.０.０.１/").message


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "gopher://example.com/", "javascript:x",
                                 "example.com/path", "//example.com/"])
def test_only_http_and_https(url: str) -> None:
    error = refused(url)
    assert isinstance(error, UrlNotAllowed) and "only http and https" in error.message


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("", "empty"),
        ("http://", "no host"),
        ("http:///path", "no host"),
        ("http://exa mple.com/", "spaces"),
        ("http://example.com\\@127.0.0.1/", "backslashes"),
        ("http://user:pw@example.com/", "user name or password"),
        ("http://example.com@127.0.0.1/", "user name or password"),
        ("http://example.com:0/", "port"),
        ("http://example.com:99999/", "port"),
        ("http://example.com:http/", "port"),
        ("http://[::1/", "cannot be parsed"),
        ("http://%31%32%37.0.0.1/", "not a valid host name"),
        ("http://exa_mple..com/", "not a valid host name"),
        ("http://" + "a" * 2100 + ".com/", "longer than"),
    ],
)
def test_malformed_urls(url: str, words: str) -> None:
    error = refused(url)
    assert error.code == "invalid_url" and words in error.message


def test_zone_identifiers_are_refused() -> None:
    assert "zone identifiers" in refused("http://[fe80::1%25eth0]/").message


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST.", "api.localhost", "metadata.google.internal",
                                  "Metadata.Google.Internal.", "metadata.goog", "instance-data"])
def test_local_and_metadata_names_are_refused_before_resolving(host: str) -> None:
    def resolver(name: str, port: int) -> list[str]:
        raise AssertionError("resolved a name that is refused by name")

    error = refused(f"http://{host}/", UrlGuard(resolver=resolver))
    assert isinstance(error, UrlNotAllowed) and "this machine or a metadata service" in error.message


def test_names_are_judged_by_every_address_they_resolve_to() -> None:
    guard = UrlGuard(resolver=dns({"good.example": [PUBLIC, "2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
                                   "evil.example": ["127.0.0.1"], "mixed.example": [PUBLIC, "10.0.0.5"],
                                   "meta.example": ["169.254.169.254"], "mapped.example": ["::ffff:192.168.0.1"]}))
    checked = guard.check("https://Good.Example./hook?x=1#frag")
    assert (checked.host, checked.port, checked.target, checked.address) == ("good.example", 443, "/hook?x=1", PUBLIC)
    assert checked.host_header == "good.example" and checked.pinned_url == f"https://{PUBLIC}:443/hook?x=1"
    assert "resolves to 127.0.0.1, which is a loopback address" in refused("http://evil.example/", guard).message
    assert "resolves to 10.0.0.5, which is a private address" in refused("http://mixed.example/", guard).message
    assert "cloud metadata address" in refused("http://meta.example/", guard).message
    assert "IPv6 form of 192.168.0.1, a private address" in refused("http://mapped.example/", guard).message
    error = refused("http://nowhere.example/", guard)
    assert isinstance(error, UrlUnresolvable) and error.code == "url_unresolvable"


def test_dns_rebinding_cannot_move_a_checked_url() -> None:
    """The second answer would be refused; the first check's address is what a pinned request connects to."""
    answers = iter([[PUBLIC], ["127.0.0.1"]])
    guard = UrlGuard(resolver=lambda host, port: next(answers))
    checked = guard.check("http://rebind.example:8080/hook")
    assert checked.address == PUBLIC and checked.pinned_url == f"http://{PUBLIC}:8080/hook"
    assert checked.host_header == "rebind.example:8080"
    assert "loopback" in refused("http://rebind.example:8080/hook", guard).message


def test_allow_list_of_networks_and_names() -> None:
    policy = UrlPolicy.parse("127.0.0.1, 10.0.0.0/8 hooks.internal *.svc.cluster.local [::1]")
    guard = UrlGuard(policy, resolver=dns({"hooks.internal": ["172.20.0.2"], "api.svc.cluster.local": ["172.20.0.3"],
                                            "other.internal": ["172.20.0.4"], "ten.example": ["10.9.9.9"],
                                            "localhost": ["127.0.0.1"]}))
    assert guard.check("http://127.0.0.1:9000/x").address == "127.0.0.1"
    assert guard.check("http://[::1]:9000/x").address == "::1"
    assert guard.check("http://[::ffff:127.0.0.1]/").address == "127.0.0.1"  # a mapped form of a listed address
    assert guard.check("http://10.2.3.4/").address == "10.2.3.4"
    assert guard.check("http://ten.example/").address == "10.9.9.9"
    assert guard.check("http://hooks.internal/").address == "172.20.0.2"
    assert guard.check("http://api.svc.cluster.local/").address == "172.20.0.3"
    assert "private address" in refused("http://other.internal/", guard).message
    assert "loopback" in refused("http://127.0.0.2/", guard).message
    assert "this machine" in refused("http://localhost/", guard).message  # a listed address does not list the name
    with pytest.raises(ValueError, match="neither a network"):
        UrlPolicy.parse("not a host!")


def test_public_false_allows_only_what_is_listed() -> None:
    policy = UrlPolicy.parse(["clips.example.com", "203.0.113.0/24"], public=False)
    guard = UrlGuard(policy, resolver=dns({"clips.example.com": [PUBLIC], "elsewhere.example.com": [PUBLIC],
                                           "doc.example.com": ["203.0.113.7"]}))
    assert guard.check("https://clips.example.com/a.wav").address == PUBLIC
    assert guard.check("https://doc.example.com/a.wav").address == "203.0.113.7"
    assert "not on the allow-list" in refused("https://elsewhere.example.com/a.wav", guard).message
    assert "not on the allow-list" in refused(f"https://{PUBLIC}/a.wav", guard).message


def test_public_addresses_pass() -> None:
    for address in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]:
        assert refusal_reason(ipaddress.ip_address(address)) is None
    checked = UrlGuard().check("https://[2606:4700:4700::1111]:8443/x")
    assert checked.pinned_url == "https://[2606:4700:4700::1111]:8443/x"
    assert checked.host_header == "[2606:4700:4700::1111]:8443"


# -- requests pinned to the checked address -------------------------------------------------------------------------


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str, bytes]]

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append((self.headers["Host"], self.path, body))  # type: ignore[attr-defined]
        self.send_response(302 if self.path == "/redirect" else 200)
        self.send_header("Location", "http://127.0.0.1:1/elsewhere")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    httpd.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_pinned_request_connects_to_the_checked_address_with_the_original_host(server) -> None:
    port = server.server_address[1]
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])  # the second answer never reaches the request
    guard = UrlGuard(UrlPolicy.parse("127.0.0.1"), resolver=lambda host, port: next(answers))
    checked = guard.check(f"http://hooks.test:{port}/hook?id=1")
    with httpx.Client(trust_env=False) as client:
        response = pinned_request(client, "POST", checked, content=b"hello", timeout=5)
        redirect = pinned_request(client, "POST", guard.check(f"http://127.0.0.1:{port}/redirect"), content=b"")
    assert response.status_code == 200 and response.text == "ok"
    assert redirect.status_code == 302  # returned as it is, not followed
    assert server.seen == [(f"hooks.test:{port}", "/hook?id=1", b"hello"), (f"127.0.0.1:{port}", "/redirect", b"")]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[http.server.ThreadingHTTPServer, Path]]:
    """An HTTPS server on loopback whose certificate names only ``hooks.test``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=hooks.test",
                    "-addext", "subjectAltName=DNS:hooks.test", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    httpd.seen = []  # type: ignore[attr-defined]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    httpd.sni_names = names  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, cert
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_pinned_https_request_sends_sni_and_checks_the_certificate_name(tls_server) -> None:
    httpd, cert = tls_server
    port = httpd.server_address[1]
    guard = UrlGuard(UrlPolicy.parse("127.0.0.1"), resolver=dns({"hooks.test": ["127.0.0.1"]}))
    verify = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(verify=verify, trust_env=False) as client:
        response = pinned_request(client, "POST", guard.check(f"https://hooks.test:{port}/tls"), content=b"x",
                                  timeout=5)
        assert response.status_code == 200
        with pytest.raises(httpx.ConnectError):  # by address alone the certificate's name does not match
            client.post(f"https://127.0.0.1:{port}/tls", content=b"x", timeout=5)
    assert httpd.sni_names[0] == "hooks.test"
    assert httpd.seen[0] == (f"hooks.test:{port}", "/tls", b"x")
