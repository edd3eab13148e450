"""Requests of the API-key routes, and their responses (shapes in contract.api.api_keys) built from rows."""

from __future__ import annotations

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from contract.api.api_keys import ApiKeyOut, ApiKeyWithSecret, Scope
from contract.fields import Text
from service.tenants.models import ApiKey
from service.tenants.scopes import ALL_SCOPES, DEFAULT_SCOPES, parse_scopes
from service.tenants.service import KEY_PREFIX


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"name": "ci-read-only", "scopes": ["read"], "expires_at": "2027-01-01T00:00:00Z"}]
        },
    )

    name: Text = Field(min_length=1, max_length=128, description="What the key is for (shown in listings).")
    scopes: list[Scope] = Field(
        default_factory=lambda: list(DEFAULT_SCOPES),
        min_length=1,
        max_length=3,
        description="`read` (GET routes), `write` (every other route), `admin` (manage API keys and quotas).",
    )
    expires_at: AwareDatetime | None = Field(
        None, description="When the key stops working (with a time zone, in the future); none = never."
    )


def api_key_out(row: ApiKey) -> ApiKeyOut:
    scopes = parse_scopes(row.scopes)
    return ApiKeyOut(
        id=row.id,
        name=row.name,
        scopes=[s for s in ALL_SCOPES if s in scopes],
        prefix=KEY_PREFIX + row.prefix,
        created_at=row.created_at,
        expires_at=row.expires_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


def api_key_with_secret(row: ApiKey, token: str) -> ApiKeyWithSecret:
    return ApiKeyWithSecret(**api_key_out(row).model_dump(), key=token)
