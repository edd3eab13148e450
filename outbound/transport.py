"""An httpx transport that connects only to addresses the SSRF policy validated (no second DNS lookup).

For every request it resolves the URL's host once with the (injectable) resolver, checks every
answer with `outbound.urlpolicy`, and sends the request to the first validated address by rewriting
the URL's host to that IP. The ``Host`` header keeps the name, and for https the ``sni_hostname``
request extension makes httpcore send the name as TLS SNI and verify the certificate against the name,
not the IP. Because the socket is opened to the validated IP itself, a DNS answer that changes between
the check and the connect (rebinding) cannot redirect it.

Proxies from the environment are ignored (trust_env=False): a proxy would do its own lookup.
"""

from __future__ import annotations

import ssl

import httpx

from outbound.urlpolicy import Resolver, resolve_and_check


class PinnedResolutionTransport(httpx.AsyncHTTPTransport):
    """`httpx.AsyncHTTPTransport` that validates and pins the destination address of each request."""

    def __init__(
        self,
        *,
        allow_private: bool,
        resolver: Resolver | None = None,
        limits: httpx.Limits | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        super().__init__(trust_env=False, limits=limits or httpx.Limits(), verify=verify)
        self._allow_private = allow_private
        self._resolver = resolver

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        # Raises UrlRejected before any socket is opened when one of the answers is not allowed.
        addresses = await resolve_and_check(
            host, port, allow_private=self._allow_private, resolver=self._resolver
        )
        pinned = str(addresses[0])
        if pinned != host:
            # httpx already set the Host header from the original URL when it built the request.
            request.url = request.url.copy_with(host=pinned)
            if request.url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": host}
        return await super().handle_async_request(request)
