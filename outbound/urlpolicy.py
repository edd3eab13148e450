"""Which reward/webhook URLs may be called (SSRF policy). Shared by registration (service) and calls (worker).

Two layers, both needed:

- `check_url_syntax` (registration, no network): scheme, no credentials, and literal addresses in every
  form a resolver would accept (``127.1``, ``0x7f000001``, ``2130706433``, ``[::ffff:127.0.0.1]``...).
- `resolve_and_check` (registration and *every* call): resolve all A/AAAA records and refuse the URL if any
  of them is not globally routable. The worker then connects to the address it validated, never to a
  second lookup of the name (DNS rebinding), see `outbound.transport`.

``allow_private=True`` (the development default) permits loopback, private, link-local and CGNAT targets so
a reward server on the laptop works; multicast, the unspecified address and cloud metadata addresses (AWS,
GCP, Azure IMDS and WireServer, Alibaba, AWS IPv6) stay refused in every mode because no reward server lives
there. A refusal names the host as given and the class of address, never what a name resolved to. In production (``allow_private=False``) only
the TLS schemes are accepted: ``https`` (webhooks) and ``grpcs`` (the gRPC reward protocol, ``grpo.v1.RewardService``);
development also accepts ``http`` and ``grpc`` (plaintext). A gRPC URL names a server only
(``grpcs://host[:port]``, default ports 443 for grpcs and 80 for grpc): the method is fixed by the protocol, so
a path, query or fragment is refused rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# (host, port) -> every address the name resolves to, as strings. Injectable so tests can script answers.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_METADATA_ADDRESSES = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack
        ipaddress.ip_address("169.254.170.2"),  # AWS ECS task metadata
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
        ipaddress.ip_address("fd00:ec2::254"),  # AWS IPv6
        ipaddress.ip_address("168.63.129.16"),  # Azure WireServer (a public address that only Azure VMs reach)
    }
)
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64_WELL_KNOWN = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# Anything a libc inet_aton could read as an IPv4 address: decimal, octal, hex, 1 to 4 parts.
_INET_ATON_SHAPE = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$", re.IGNORECASE)
_HOST_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_DEFAULT_PORTS = {"http": 80, "https": 443, "grpc": 80, "grpcs": 443}
_TLS_SCHEMES = ("https", "grpcs")
_ALL_SCHEMES = ("http", "https", "grpc", "grpcs")
GRPC_SCHEMES = frozenset({"grpc", "grpcs"})


class UrlRejected(ValueError):
    """A URL the policy refuses. The API renders it as 422 `url_rejected` (service.kit.errors.as_domain_error)."""

    code = "url_rejected"

    def __init__(self, message: str, *, details: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


def check_url_syntax(url: str, *, allow_private: bool, require_https: bool | None = None) -> str:
    """Static checks at registration: scheme, credentials, literal addresses. Returns the normalised URL.

    Raises UrlRejected naming the problem. (Full DNS-resolving checks happen at call time too.)
    `require_https` (TLS required) defaults to ``not allow_private``: production accepts https and grpcs only.
    """
    if require_https is None:
        require_https = not allow_private
    # Backslashes and control characters are parsed differently by different URL parsers: refuse them.
    if not url or any(ch.isspace() or ch == "\\" or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        raise UrlRejected(
            "url is empty or contains whitespace, backslashes or control characters", details={"url": url}
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    allowed = _TLS_SCHEMES if require_https else _ALL_SCHEMES
    if scheme not in allowed:
        raise UrlRejected(
            f"url scheme {parts.scheme!r} is not allowed (allowed: {', '.join(allowed)})",
            details={"url": url},
        )
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise UrlRejected("url must not contain credentials (user:password@)", details={"url": url})
    try:
        port = parts.port
    except ValueError as exc:
        raise UrlRejected(f"url port is invalid: {exc}", details={"url": url}) from exc
    raw_host = _raw_host(parts.netloc)
    if not raw_host:
        raise UrlRejected("url has no host", details={"url": url})
    host = _normalise_host(raw_host, allow_private=allow_private)
    netloc = host if port is None or port == _DEFAULT_PORTS[scheme] else f"{host}:{port}"
    if scheme in GRPC_SCHEMES:
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise UrlRejected(
                "a grpc(s) url names a server only (grpcs://host:port): the method is always "
                "/grpo.v1.RewardService/Score, so a path, query or fragment is not allowed",
                details={"url": url},
            )
        return urlunsplit((scheme, netloc, "", "", ""))
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


def is_grpc_url(url: str) -> bool:
    """Whether `url` names a gRPC reward endpoint (grpc:// or grpcs://)."""
    return urlsplit(url).scheme.lower() in GRPC_SCHEMES


def host_and_port(url: str) -> tuple[str, int]:
    """The host (brackets removed) and effective port of a URL that passed `check_url_syntax`."""
    parts = urlsplit(url)
    return (parts.hostname or ""), (parts.port or _DEFAULT_PORTS.get(parts.scheme, 443))


def parse_ip_literal(host: str) -> IPAddress | None:
    """`host` as an address if any resolver would take it as one (inet_aton forms included), else None."""
    candidate = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(candidate)
    except ValueError:
        pass
    if _INET_ATON_SHAPE.match(candidate):
        try:
            # Same semantics as the C resolver: 127.1, 0177.0.0.1, 0x7f000001 and 2130706433 all mean 127.0.0.1.
            return ipaddress.IPv4Address(socket.inet_aton(candidate.rstrip(".")))
        except OSError:
            return None
    return None


def forbidden_reason(ip: IPAddress, *, allow_private: bool, show_embedded: bool = True) -> str | None:
    """Why `ip` may not be called under this policy, or None when it may. `show_embedded=False` leaves out the
    IPv4 address an IPv6 one stands for (for an address the tenant did not write: a name's answer)."""
    if ip in _METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_unspecified:
        return "the unspecified address"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            inner = forbidden_reason(embedded, allow_private=allow_private)
            if inner is None:
                return None
            return f"an IPv6 form of {embedded} ({inner})" if show_embedded else f"an IPv6 form of {inner}"
        if ip in _NAT64_LOCAL and not allow_private:
            return "a local-use NAT64 address"
    if allow_private:
        return None
    for flag, label in (
        (ip.is_loopback, "a loopback address"),
        (ip.is_link_local, "a link-local address"),
        (ip in _CGNAT, "a carrier-grade NAT (100.64.0.0/10) address"),
        (ip.is_private, "a private address"),
        (ip.is_reserved, "a reserved address"),
        (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local, "a site-local address"),
        (not ip.is_global, "not a globally routable address"),
    ):
        if flag:
            return label
    return None


def check_ip(ip: IPAddress, *, allow_private: bool, host: str, resolved: bool = False) -> None:
    """Raise UrlRejected if `ip` (`host` itself, or with `resolved` one of the addresses `host` resolved to)
    may not be called.

    The refusal names the host as the tenant gave it and the class of the address, never the address a name
    resolved to: that would map the service's internal network for whoever registers names pointing into it.
    """
    reason = forbidden_reason(ip, allow_private=allow_private, show_embedded=not resolved)
    if reason is not None:
        verb = "resolves to" if resolved else "is"
        raise UrlRejected(f"url host {host} {verb} {reason}", details={"host": host})


async def system_resolver(host: str, port: int) -> list[str]:
    """Every A/AAAA address of `host` via the system resolver (getaddrinfo in a thread)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def resolve_and_check(
    host: str, port: int, *, allow_private: bool, resolver: Resolver | None = None
) -> list[IPAddress]:
    """Resolve `host` and return its addresses, all of which passed the policy; raise UrlRejected otherwise.

    Every record must pass, not just the first: a name answering one public and one private address could
    otherwise be steered to the private one by the connection logic.
    """
    literal = parse_ip_literal(host)
    if literal is not None:
        check_ip(literal, allow_private=allow_private, host=host)
        return [literal]
    try:
        answers = await (resolver or system_resolver)(host, port)
    except (OSError, UnicodeError) as exc:
        raise UrlRejected(f"url host {host!r} does not resolve: {exc}", details={"host": host}) from exc
    if not answers:
        raise UrlRejected(f"url host {host!r} does not resolve to any address", details={"host": host})
    addresses: list[IPAddress] = []
    for answer in answers:
        ip = ipaddress.ip_address(answer.split("%", 1)[0])  # drop an IPv6 zone id ("fe80::1%eth0")
        check_ip(ip, allow_private=allow_private, host=host, resolved=True)
        addresses.append(ip)
    return addresses


async def check_url(
    url: str, *, allow_private: bool, resolver: Resolver | None = None, require_https: bool | None = None
) -> str:
    """Registration check: syntax, then resolve the host and check every address. Returns the normalised URL."""
    normalised = check_url_syntax(url, allow_private=allow_private, require_https=require_https)
    host, port = host_and_port(normalised)
    await resolve_and_check(host, port, allow_private=allow_private, resolver=resolver)
    return normalised


def _raw_host(netloc: str) -> str:
    """The host part of a netloc, brackets kept for IPv6 (urlsplit's .hostname would drop them)."""
    if netloc.startswith("["):
        end = netloc.find("]")
        return netloc[: end + 1] if end != -1 else netloc
    return netloc.rsplit(":", 1)[0] if ":" in netloc else netloc


def _normalise_host(raw_host: str, *, allow_private: bool) -> str:
    """Lower-case and IDNA-encode the host, then canonicalise and check literal addresses.

    The policy looks at the host only once it is in the ASCII form a resolver receives: IDNA's nameprep
    (NFKC) turns ``①②⑦.0.0.1`` or ``１２７。０。０。１`` into ``127.0.0.1`` and ``ｌｏｃａｌｈｏｓｔ`` into
    ``localhost``, so checking the text as typed would let those through.
    """
    if raw_host.startswith("["):
        inner = raw_host[1:-1]
        if "%" in inner:
            raise UrlRejected("url host must not carry an IPv6 zone id", details={"host": raw_host})
        try:
            ip6 = ipaddress.IPv6Address(inner)
        except ValueError as exc:
            raise UrlRejected(
                f"url host {raw_host!r} is not a valid IPv6 address", details={"host": raw_host}
            ) from exc
        check_ip(ip6, allow_private=allow_private, host=str(ip6))
        return f"[{ip6.compressed}]"
    try:
        host = raw_host.rstrip(".").encode("idna").decode("ascii").lower()
    except UnicodeError as exc:
        raise UrlRejected(
            f"url host {raw_host!r} is not a valid host name: {exc}", details={"host": raw_host}
        ) from exc
    literal = parse_ip_literal(host)
    if literal is not None:
        check_ip(literal, allow_private=allow_private, host=raw_host)
        return f"[{literal.compressed}]" if literal.version == 6 else str(literal)
    labels = host.split(".")
    if not host or not all(_HOST_LABEL.match(label) for label in labels):
        raise UrlRejected(f"url host {raw_host!r} is not a valid host name", details={"host": raw_host})
    if not allow_private and (host == "localhost" or host.endswith(".localhost")):
        raise UrlRejected(f"url host {raw_host!r} is a loopback name", details={"host": raw_host})
    return host


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64, IPv4-compatible), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64_WELL_KNOWN:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.teredo is not None:
        return ip.teredo[1]
    if int(ip) >> 32 == 0 and int(ip) > 1:  # deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(int(ip))
    return None
