"""One episode on a user's OpenEnv server: a WebSocket session at `{url}/ws`, signed, SSRF-pinned, bounded.

OpenEnv keeps an episode's state only over its WebSocket (HTTP `/reset` and `/step` build a fresh environment per
request): the client sends `{"type": "reset", "data": {...row}}`, `{"type": "step", "data": action}` and
`{"type": "close"}`; the server answers `{"type": "observation", "data": {"observation", "reward", "done"}}` or
`{"type": "error", "data": {"message", "code"}}`. A server at capacity accepts the connection, answers
`CAPACITY_REACHED` and closes it.

Rules, as for reward endpoints (outbound.rewards):
- The host is resolved and every address checked by the URL policy; the socket is opened to the validated address
  by us and handed to the WebSocket client, which therefore follows no redirect (a 3xx is refused, not trusted).
- The handshake carries the Standard Webhooks headers over an empty body, and the user's headers.
- Opening an episode (connect + reset) is retried with full-jitter backoff while the server is busy or down;
  anything else is that episode's failure. Every answer is bounded in size and time (per message, per episode).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections.abc import Mapping
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, SecretStr, ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, PayloadTooBig, WebSocketException

from contract.fields import HeaderValue
from outbound.signing import SigningKeys, new_message_id, sign_headers
from outbound.urlpolicy import Resolver, check_url_syntax, host_and_port, resolve_and_check

CAPACITY_REACHED = "CAPACITY_REACHED"


class EnvironmentConfig(BaseModel):
    """How a job reaches one registered environment (the service builds it from the row)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    environment_id: str = Field(min_length=1, max_length=64)
    url: str = Field(min_length=1, description="Base URL; checked by the URL policy on every connection.")
    secret: SecretStr
    previous_secret: SecretStr | None = None
    previous_secret_until: AwareDatetime | None = None
    headers: dict[str, HeaderValue] = Field(default_factory=dict)
    step_timeout_s: float = Field(30.0, gt=0)
    episode_timeout_s: float = Field(300.0, gt=0)
    max_attempts: int = Field(5, ge=1, le=20)
    backoff_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(20.0, gt=0)
    max_message_bytes: int = Field(1 << 20, ge=1024, description="Larger messages end the episode.")
    allow_private: bool = False

    def keys(self) -> SigningKeys:
        previous = self.previous_secret.get_secret_value() if self.previous_secret is not None else None
        return SigningKeys.load(self.secret.get_secret_value(), previous, self.previous_secret_until)


class Observation(BaseModel):
    """One answer of the environment: what the policy is shown, the step's reward, whether the episode ended."""

    model_config = ConfigDict(extra="ignore")

    observation: dict[str, Any]
    reward: float | None = Field(None, allow_inf_nan=False)
    done: bool = False


class EpisodeError(Exception):
    """An episode that could not be opened or did not end well; `code` is what `env/errors` counts."""

    code = "environment_error"


class EnvironmentBusy(EpisodeError):
    """The server is at capacity (CAPACITY_REACHED): retried while attempts remain."""

    code = "environment_busy"


class EnvironmentDown(EpisodeError):
    """No connection, a timeout while opening, or a 5xx handshake: retried while attempts remain."""

    code = "environment_unavailable"


class EnvironmentOutage(Exception):
    """Not one episode of a batch could be opened because the server stayed busy or down: the job pauses
    (`environment_unavailable`), as it does for a reward endpoint that stays down."""

    code = "environment_unavailable"

    def __init__(self, environment_id: str, reason: str) -> None:
        super().__init__(f"environment {environment_id}: {reason}")
        self.environment_id = environment_id
        self.reason = reason


class EpisodeFailed(EpisodeError):
    """The episode itself went wrong (an error message, a bad or late answer, a refused handshake)."""

    code = "episode_failed"


def _ws_url(url: str) -> str:
    base = url.rstrip("/")
    return ("wss" + base[5:] if base.startswith("https") else "ws" + base[4:]) + "/ws"


async def _open_socket(config: EnvironmentConfig, resolver: Resolver | None) -> tuple[socket.socket, str]:
    """A connected socket to the first address the policy validated; raises UrlRejected or EnvironmentDown."""
    url = check_url_syntax(config.url, allow_private=config.allow_private)
    host, port = host_and_port(url)
    addresses = await resolve_and_check(host, port, allow_private=config.allow_private, resolver=resolver)
    address = addresses[0]
    sock = socket.socket(socket.AF_INET6 if address.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(config.step_timeout_s):
            await asyncio.get_running_loop().sock_connect(sock, (str(address), port))
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise EnvironmentDown(f"{config.environment_id}: cannot connect to {host}:{port}: {exc or 'timed out'}") from exc
    return sock, host


class Episode:
    """An open episode. Use `step` until an observation says `done`, then `close` (also on failure)."""

    def __init__(self, config: EnvironmentConfig, connection: ClientConnection, deadline: float) -> None:
        self.config = config
        self._connection = connection
        self._deadline = deadline
        self.attempts = 1

    async def send(self, message: Mapping[str, Any]) -> Observation:
        """Send one message and read its observation, within the step and episode timeouts."""
        return _observation(self.config.environment_id, await self._exchange(message))

    async def _exchange(self, message: Mapping[str, Any]) -> str | bytes:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise EpisodeFailed(f"{self.config.environment_id}: episode_timeout_s "
                                f"({self.config.episode_timeout_s:g} s) passed")
        timeout = min(self.config.step_timeout_s, left)
        too_big = f"{self.config.environment_id}: an answer larger than {self.config.max_message_bytes} bytes"
        try:
            async with asyncio.timeout(timeout):
                try:
                    await self._connection.send(json.dumps(message))
                except ConnectionClosed:
                    pass  # its answer may be queued already (CAPACITY_REACHED comes before the close): read it
                return await self._connection.recv()
        except TimeoutError as exc:
            raise EpisodeFailed(f"{self.config.environment_id}: no answer within {timeout:.3g} s") from exc
        except PayloadTooBig as exc:
            raise EpisodeFailed(too_big) from exc
        except ConnectionClosed as exc:
            if 1009 in (getattr(exc.rcvd, "code", None), getattr(exc.sent, "code", None)):  # message too big
                raise EpisodeFailed(too_big) from exc
            raise EpisodeFailed(f"{self.config.environment_id}: the server closed the episode ({exc})") from exc

    async def step(self, action: Mapping[str, Any]) -> Observation:
        return await self.send({"type": "step", "data": dict(action)})

    async def state(self) -> dict[str, Any]:
        """The environment's state (OpenEnv's `state` message): works before any reset."""
        raw = await self._exchange({"type": "state"})
        message = _json(self.config.environment_id, raw)
        if message.get("type") != "state" or not isinstance(message.get("data"), dict):
            _raise_error(self.config.environment_id, message)
            raise EpisodeFailed(f"{self.config.environment_id}: an answer of type {message.get('type')!r}, "
                                "not 'state'")
        return dict(message["data"])

    async def close(self) -> None:
        """Tell the server the episode is over (best effort) and close the connection."""
        try:
            async with asyncio.timeout(min(self.config.step_timeout_s, 5.0)):
                await self._connection.send(json.dumps({"type": "close"}))
                await self._connection.close()
        except (TimeoutError, ConnectionClosed, OSError):
            self._connection.transport.abort()


def _json(environment_id: str, raw: str | bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw)
    except ValueError as exc:
        raise EpisodeFailed(f"{environment_id}: an answer that is not JSON") from exc
    if not isinstance(message, dict):
        raise EpisodeFailed(f"{environment_id}: an answer that is not a JSON object")
    return message


def _raise_error(environment_id: str, message: dict[str, Any]) -> None:
    """Raise for an error answer (EnvironmentBusy for CAPACITY_REACHED); return for any other."""
    if message.get("type") != "error":
        return
    data = message.get("data")
    code = data.get("code") if isinstance(data, dict) else None
    text = str(data.get("message", ""))[:500] if isinstance(data, dict) else ""
    if code == CAPACITY_REACHED:
        raise EnvironmentBusy(f"{environment_id}: at capacity ({text})")
    raise EpisodeFailed(f"{environment_id}: the environment answered {code or 'an error'}: {text}")


def _observation(environment_id: str, raw: str | bytes) -> Observation:
    """The observation of one answer; an error answer raises (EnvironmentBusy for CAPACITY_REACHED)."""
    message = _json(environment_id, raw)
    _raise_error(environment_id, message)
    if message.get("type") != "observation":
        raise EpisodeFailed(f"{environment_id}: an answer of type {message.get('type')!r}, not 'observation'")
    try:
        return Observation.model_validate(message.get("data"))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "data"
        raise EpisodeFailed(f"{environment_id}: observation {where}: {error['msg']}") from exc


async def _connect(config: EnvironmentConfig, resolver: Resolver | None) -> ClientConnection:
    sock, host = await _open_socket(config, resolver)
    headers = {**config.headers, **sign_headers(config.keys(), new_message_id(), b"")}
    secure = config.url.startswith("https")
    try:
        return await connect(
            _ws_url(config.url), sock=sock, ssl=ssl.create_default_context() if secure else None,
            server_hostname=host if secure else None, additional_headers=headers, proxy=None, compression=None,
            open_timeout=config.step_timeout_s, max_size=config.max_message_bytes, user_agent_header="grpo-worker",
        )
    except OSError as exc:  # TimeoutError among them
        sock.close()
        raise EnvironmentDown(f"{config.environment_id}: handshake: {exc or 'timed out'}") from exc
    except (WebSocketException, ValueError) as exc:  # ValueError: a redirect it will not follow on our socket
        sock.close()
        raise _handshake_failure(config.environment_id, exc) from exc


def _handshake_failure(environment_id: str, exc: Exception) -> EpisodeError:
    """A refused handshake: a 5xx is the server down (retried); a redirect (which websockets may try to follow
    and then refuse, raising from the status) and every other answer fail the episode, naming the status."""
    status = exc if isinstance(exc, InvalidStatus) else (exc.__cause__ or exc.__context__)
    if not isinstance(status, InvalidStatus):
        return EpisodeFailed(f"{environment_id}: handshake refused: {exc}")
    code = status.response.status_code
    if code >= 500:
        return EnvironmentDown(f"{environment_id}: the handshake answered HTTP {code}")
    where = f" (to {status.response.headers.get('Location')!r}, not followed)" if 300 <= code < 400 else ""
    return EpisodeFailed(f"{environment_id}: the handshake answered HTTP {code}{where}")


def _retrying(config: EnvironmentConfig) -> AsyncRetrying:
    """Opening is retried while the server is busy or down: `max_attempts`, full-jitter backoff."""
    return AsyncRetrying(
        stop=stop_after_attempt(config.max_attempts),
        wait=wait_random_exponential(multiplier=config.backoff_s, max=config.backoff_max_s),
        retry=retry_if_exception_type((EnvironmentBusy, EnvironmentDown)),
        reraise=True,
    )


async def open_episode(
    config: EnvironmentConfig, row: Mapping[str, Any], *, resolver: Resolver | None = None
) -> tuple[Episode, Observation]:
    """Connect and reset with `row`'s fields; retried while the server is busy or down (`max_attempts`, backoff).
    Raises EnvironmentBusy / EnvironmentDown once attempts run out, EpisodeFailed, or UrlRejected."""
    deadline = time.monotonic() + config.episode_timeout_s
    async for attempt in _retrying(config):
        with attempt:
            episode = Episode(config, await _connect(config, resolver), deadline)
            episode.attempts = attempt.retry_state.attempt_number
            try:
                first = await episode.send({"type": "reset", "data": dict(row)})
            except BaseException:
                await episode.close()
                raise
            return episode, first
    raise AssertionError("unreachable: tenacity reraises the last failure")


async def check_session(config: EnvironmentConfig, *, resolver: Resolver | None = None) -> dict[str, Any]:
    """Open a session the way an episode is opened and ask for its state (no reset: no row is needed); returns
    the state. The same failures as `open_episode`."""
    deadline = time.monotonic() + config.episode_timeout_s
    async for attempt in _retrying(config):
        with attempt:
            session = Episode(config, await _connect(config, resolver), deadline)
            try:
                return await session.state()
            finally:
                await session.close()
    raise AssertionError("unreachable: tenacity reraises the last failure")
