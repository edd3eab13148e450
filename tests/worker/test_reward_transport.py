"""The pinned-resolution transport over real TLS: SNI and certificate checks use the name, the socket the IP."""

from __future__ import annotations

import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from outbound.transport import PinnedResolutionTransport
from outbound.urlpolicy import UrlRejected

from .reward_servers import start_uvicorn, stop_uvicorn

NAME = "rewards.internal.test"


def make_cert(directory: Path, name: str) -> tuple[Path, Path]:
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    key, cert = make_cert(tmp_path_factory.mktemp("tls"), NAME)

    async def echo_host(request: Request) -> PlainTextResponse:
        return PlainTextResponse(request.headers["host"])

    app = Starlette(routes=[Route("/", echo_host)])
    server, thread, port = start_uvicorn(app, ssl_keyfile=str(key), ssl_certfile=str(cert))
    yield port, cert
    stop_uvicorn(server, thread)


async def to_loopback(host: str, port: int) -> list[str]:
    return ["127.0.0.1"]


async def test_tls_uses_the_name_for_sni_and_verification(tls_server: tuple[int, Path]) -> None:
    port, cert = tls_server
    context = ssl.create_default_context(cafile=str(cert))
    transport = PinnedResolutionTransport(allow_private=True, resolver=to_loopback, verify=context)
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.get(f"https://{NAME}:{port}/")
    assert response.status_code == 200 and response.text == f"{NAME}:{port}"


async def test_certificate_for_another_name_is_refused(tls_server: tuple[int, Path]) -> None:
    # Same socket, same certificate, but the URL names another host: verification is against the name.
    port, cert = tls_server
    context = ssl.create_default_context(cafile=str(cert))
    transport = PinnedResolutionTransport(allow_private=True, resolver=to_loopback, verify=context)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
            await client.get(f"https://other.internal.test:{port}/")


async def test_refused_address_never_connects(tls_server: tuple[int, Path]) -> None:
    port, cert = tls_server
    transport = PinnedResolutionTransport(allow_private=False, resolver=to_loopback)
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(UrlRejected, match="loopback"):
            await client.get(f"https://{NAME}:{port}/")
