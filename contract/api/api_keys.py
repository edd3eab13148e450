"""Response shapes of the API-key routes, and the scopes a key may have."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

Scope = Literal["read", "write", "admin"]


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


class ApiKeyWithSecret(ApiKeyOut):
    key: str = Field(description="The key itself (grpo_sk_...). Shown only in this response: store it now.")


class ApiKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ApiKeyOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")
