"""Page-size handling shared by the List RPCs: 0 = the REST default, above the REST maximum = an error."""

from __future__ import annotations

from service.kit.errors import ValidationFailed


def page_size(requested: int, default: int, maximum: int, field: str = "page_size") -> int:
    """The REST `limit` for a request's page_size (same bounds as the REST query parameter)."""
    if requested == 0:
        return default
    if not 1 <= requested <= maximum:
        message = f"{field}: must be between 1 and {maximum} (0 = {default})"
        raise ValidationFailed(message, details=[{"field": field, "message": message}])
    return requested
