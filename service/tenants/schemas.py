"""Request/response models of the API-key routes."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from contract.fields import Text
from service.tenants.models import ApiKey
from service.tenants.scopes import DEFAULT_SCOPES, Scope, parse_scopes
from service.tenants.service import KEY_PREFIX


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"name": "ci-read-only", "scopes": ["read"], "expires_at": "2027-01-01T00:00:00Z"}]},
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


class ApiKeyOut(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str = Field(examples=["key_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"])
    name: str
    scopes: list[Scope]
    prefix: str = Field(description="The key's first characters, to recognise it; never enough to use it.")
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None = Field(
        description="Last authenticated request, to within a minute (written at most once a minute)."
    )
    revoked_at: datetime | None

    @classmethod
    def from_row(cls, row: ApiKey) -> ApiKeyOut:
        scopes = parse_scopes(row.scopes)
        return cls(
            id=row.id,
            name=row.name,
            scopes=[s for s in ("read", "write", "admin") if s in scopes],
            prefix=KEY_PREFIX + row.prefix,
            created_at=row.created_at,
            expires_at=row.expires_at,
            last_used_at=row.last_used_at,
            revoked_at=row.revoked_at,
        )


class ApiKeyWithSecret(ApiKeyOut):
    key: str = Field(description="The key itself (grpo_sk_...). Shown only in this response: store it now.")

    @classmethod
    def from_new(cls, row: ApiKey, token: str) -> ApiKeyWithSecret:
        return cls(**ApiKeyOut.from_row(row).model_dump(), key=token)


class ApiKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ApiKeyOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")
