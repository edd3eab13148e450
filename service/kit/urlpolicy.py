"""Which reward/webhook URLs may be called (SSRF policy). Shared by registration (service) and calls (worker)."""

from __future__ import annotations

from service.kit.errors import ValidationFailed


class UrlRejected(ValidationFailed):
    code = "url_rejected"


def check_url_syntax(url: str, *, allow_private: bool) -> str:
    """Static checks at registration: scheme, credentials, literal addresses. Returns the normalised URL.

    Raises UrlRejected naming the problem. (Full DNS-resolving checks happen at call time too.)
    """
    raise NotImplementedError  # filled in by the remote-reward work (issue 4)
