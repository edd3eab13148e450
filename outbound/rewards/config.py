"""Configuration of one remote reward endpoint as used by one job."""

from __future__ import annotations

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from contract.fields import HeaderValue
from outbound.signing import SIGNING_HEADERS, SigningKeys, load_secret
from outbound.urlpolicy import UrlRejected, check_url_syntax

# Headers the client owns; a user-configured header may not override them.
RESERVED_HEADERS = frozenset(
    {*SIGNING_HEADERS, "host", "content-type", "content-length", "transfer-encoding"}
)


class RemoteRewardConfig(BaseModel):
    """Everything `RemoteRewardSource` needs. The service builds it from the reward function row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reward_function_id: str = Field(min_length=1, max_length=64, description="Names the source: remote:<id>.")
    url: str = Field(
        min_length=1, description="The endpoint; checked by outbound.urlpolicy on every call."
    )
    secret: SecretStr = Field(description="Standard Webhooks signing secret, whsec_<base64>.")
    previous_secret: SecretStr | None = Field(
        None, description="The secret a rotation replaced: requests are signed with it too until previous_secret_until."
    )
    previous_secret_until: AwareDatetime | None = Field(None, description="End of the rotation's overlap.")
    job_id: str = Field(min_length=1, description="Sent in every request body.")
    timeout_s: float = Field(30.0, gt=0, description="Read timeout of one attempt (and its overall budget).")
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP/TLS connect timeout of one attempt.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="Items per request.")
    max_concurrency: int = Field(4, ge=1, le=64, description="Requests in flight at once.")
    headers: dict[str, HeaderValue] = Field(default_factory=dict, description="Extra request headers (e.g. auth).")
    allow_private: bool = Field(False, description="Permit loopback/private addresses (development only).")
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per request, the first included.")
    step_deadline_s: float = Field(
        300.0, gt=0, description="A request that exhausted its attempts is sent again (while the circuit stays "
        "closed) until this long after the step's first request; then its items abstain.",
    )
    max_abstain_fraction: float = Field(
        0.25, ge=0, le=1, description="Most of a step's items that may abstain at the deadline; beyond it the "
        "endpoint counts as unavailable (the job pauses).",
    )
    backoff_base_s: float = Field(
        0.5, gt=0, description="Exponential backoff base; full jitter in [0, base*2^n]."
    )
    backoff_max_s: float = Field(20.0, gt=0, description="Cap of one backoff wait.")
    max_retry_after_s: float = Field(
        60.0, ge=0, description="A Retry-After longer than this is treated as 'unavailable' (the job pauses)."
    )
    max_response_bytes: int = Field(1 << 20, ge=64, description="Larger responses are refused.")
    breaker_threshold: int = Field(
        3, ge=1, description="Consecutive requests that exhausted their attempts before the endpoint counts as "
        "down (circuit open: the job pauses).",
    )
    breaker_reset_s: float = Field(30.0, ge=0, description="How long an open circuit fails fast.")
    cache_max_entries: int = Field(100_000, ge=0, description="Reward cache size (0 disables caching).")

    @field_validator("secret", "previous_secret")
    @classmethod
    def _secret_is_whsec(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            load_secret(value.get_secret_value())
        return value

    def signing_keys(self) -> SigningKeys:
        previous = self.previous_secret.get_secret_value() if self.previous_secret is not None else None
        return SigningKeys.load(self.secret.get_secret_value(), previous, self.previous_secret_until)

    @field_validator("headers")
    @classmethod
    def _no_reserved_headers(cls, value: dict[str, str]) -> dict[str, str]:
        clash = sorted(name for name in value if name.lower() in RESERVED_HEADERS)
        if clash:
            raise ValueError(f"headers may not set {', '.join(clash)} (set by the client)")
        return value

    @model_validator(mode="after")
    def _url_passes_syntax_policy(self) -> RemoteRewardConfig:
        # The resolving checks run on every call; the static ones fail fast here.
        try:
            check_url_syntax(self.url, allow_private=self.allow_private)
        except UrlRejected as exc:
            raise ValueError(exc.message) from exc
        return self

    @property
    def source_name(self) -> str:
        return f"remote:{self.reward_function_id}"
