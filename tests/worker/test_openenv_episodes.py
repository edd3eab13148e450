"""Episodes on OpenEnv servers (outbound.openenv_session) over real WebSockets on loopback: the example calculator
as its own process (OpenEnv's `create_app`, one session at a time) runs a whole tool episode; a second episode
waits for the server's capacity and gets it; a server that misbehaves (never answers, not JSON, too large, an
error, a wrong observation, a redirecting handshake) fails that episode with the reason named; the handshake is
signed; the URL policy refuses loopback before any connection in production."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from standardwebhooks import Webhook
from starlette.applications import Starlette
from starlette.responses import RedirectResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from outbound.openenv_session import (
    EnvironmentBusy,
    EnvironmentConfig,
    EnvironmentDown,
    Episode,
    EpisodeFailed,
    open_episode,
)
from outbound.urlpolicy import UrlRejected
from tests.openenv_servers import calculator as one_calculator
from tests.worker.procs import free_port
from tests.worker.reward_servers import serving

SECRET = "whsec_" + "A" * 32
ROW = {"question": "What is 6 times 7?", "answer": "42"}


def config(url: str, **fields: Any) -> EnvironmentConfig:
    values: dict[str, Any] = {"environment_id": "env_test", "url": url, "secret": SECRET, "allow_private": True,
                              "step_timeout_s": 5.0, "backoff_s": 0.05, "backoff_max_s": 0.2}
    return EnvironmentConfig(**(values | fields))


@pytest.fixture(scope="module")
def calculator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/environments/calculator.py in its own process, one session at a time."""
    with one_calculator(tmp_path_factory.mktemp("calculator"), sessions=1) as url:
        yield url


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def _tool_episode(url: str) -> list[Any]:
    episode, first = await open_episode(config(url), ROW)
    try:
        tools = await episode.step({"type": "list_tools"})
        product = await episode.step({"type": "call_tool", "tool_name": "multiply", "arguments": {"a": 6, "b": 7}})
        wrong = await episode.step({"type": "call_tool", "tool_name": "submit", "arguments": {"answer": "41"}})
        return [first, tools, product, wrong]
    finally:
        await episode.close()


class TestEpisodes:
    def test_a_tool_episode_from_reset_to_the_rewarded_submit(self, calculator: str) -> None:
        first, tools, product, submitted = run(_tool_episode(calculator))
        assert first.observation["metadata"] == {"question": ROW["question"]} and first.done is False
        assert {t["name"] for t in tools.observation["tools"]} == {"add", "multiply", "submit"}
        assert product.observation["result"]["data"] == 42.0 and product.reward is None and not product.done
        assert submitted.done is True and submitted.reward == 0.0

        async def right() -> float | None:
            episode, _ = await open_episode(config(calculator), ROW)
            try:
                return (await episode.step({"type": "call_tool", "tool_name": "submit",
                                            "arguments": {"answer": "42"}})).reward
            finally:
                await episode.close()
        assert run(right()) == 1.0

    def test_a_second_episode_waits_for_capacity_and_gets_it(self, calculator: str) -> None:
        async def scenario() -> tuple[Episode, float]:
            holder, _ = await open_episode(config(calculator), ROW)
            # Twenty attempts wait about 3.5 s in all (full jitter), so a loaded machine that wakes this coroutine
            # late still finds the second one retrying.
            patient = config(calculator, max_attempts=20, backoff_s=0.1, backoff_max_s=0.4)
            waiting = asyncio.create_task(open_episode(patient, ROW))
            try:
                await asyncio.sleep(0.4)
                assert not waiting.done()  # still retrying: the one session is taken
            finally:  # a failure here must not leave the one session taken for the tests after it
                released = asyncio.get_running_loop().time()
                await holder.close()
            second, first = await waiting
            await second.close()
            assert first.observation["metadata"]["question"] == ROW["question"]
            return second, asyncio.get_running_loop().time() - released

        second, after = run(scenario())
        assert second.attempts > 1 and after < 3

    def test_capacity_that_never_frees_is_busy_after_the_attempts(self, calculator: str) -> None:
        async def scenario() -> None:
            holder, _ = await open_episode(config(calculator), ROW)
            try:
                with pytest.raises(EnvironmentBusy, match="capacity"):
                    await open_episode(config(calculator, max_attempts=2), ROW)
            finally:
                await holder.close()
        run(scenario())

    def test_nothing_listening_is_down_after_the_attempts(self) -> None:
        with pytest.raises(EnvironmentDown, match="cannot connect"):
            run(open_episode(config(f"http://127.0.0.1:{free_port()}", max_attempts=2), ROW))

    def test_production_refuses_loopback_before_connecting(self, calculator: str) -> None:
        with pytest.raises(UrlRejected):
            run(open_episode(config(calculator, allow_private=False), ROW))


# --- a server that misbehaves, one way per path ------------------------------------------------------------

HANDSHAKES: list[dict[str, str]] = []


async def _misbehaving(websocket: WebSocket) -> None:
    HANDSHAKES.append(dict(websocket.headers))
    await websocket.accept()
    kind = websocket.path_params["kind"]
    await websocket.receive_text()  # the reset
    answers = {
        "silent": None,
        "text": "hello",
        "big": '{"type": "observation", "data": {"observation": {"x": "' + "y" * 4096 + '"}}}',
        "error": '{"type": "error", "data": {"message": "reset failed: no such task", "code": "EXECUTION_ERROR"}}',
        "bad-reward": '{"type": "observation", "data": {"observation": {}, "reward": "lots", "done": false}}',
        "no-observation": '{"type": "observation", "data": {"reward": 1.0}}',
    }
    if kind == "hangup":  # the environment process dies mid-episode: the connection drops without an answer
        await websocket.close(code=1011)
        return
    answer = answers[kind]
    if answer is None:
        await asyncio.sleep(30)
        return
    await websocket.send_text(answer)
    await websocket.receive_text()


async def _redirect(websocket: WebSocket) -> None:
    """The handshake answered with a redirect elsewhere (ASGI's WebSocket denial response): to a ws:// URL, which
    websockets would follow, or to an http:// one, which it cannot parse."""
    HANDSHAKES.append(dict(websocket.headers))
    scheme = websocket.path_params["scheme"]
    await websocket.send_denial_response(RedirectResponse(f"{scheme}://127.0.0.1:1/ws", status_code=307))


@pytest.fixture(scope="module")
def impostor() -> Iterator[str]:
    app = Starlette(routes=[WebSocketRoute("/redirect-{scheme}/ws", _redirect), WebSocketRoute("/{kind}/ws", _misbehaving)])
    with serving(app) as url:
        yield url


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("silent", "no answer within"),
        ("hangup", "the server closed the episode"),
        ("text", "not JSON"),
        ("big", "larger than 2048 bytes"),
        ("error", "EXECUTION_ERROR: reset failed: no such task"),
        ("bad-reward", "observation reward"),
        ("no-observation", "observation observation"),
        ("redirect-ws", "HTTP 307 (to 'ws://127.0.0.1:1/ws', not followed)"),
        ("redirect-http", "HTTP 307"),
    ],
)
def test_a_misbehaving_server_fails_the_episode_naming_why(impostor: str, kind: str, says: str) -> None:
    settings = config(f"{impostor}/{kind}", step_timeout_s=0.5, max_message_bytes=2048)
    with pytest.raises(EpisodeFailed) as failed:
        run(open_episode(settings, ROW))
    assert says in str(failed.value) and "env_test" in str(failed.value)


def test_the_handshake_is_signed_and_carries_the_users_headers(impostor: str) -> None:
    HANDSHAKES.clear()
    with pytest.raises(EpisodeFailed):
        run(open_episode(config(f"{impostor}/text", headers={"Authorization": "Bearer e"}), ROW))
    (headers,) = HANDSHAKES
    assert headers["authorization"] == "Bearer e"
    moment = datetime.fromtimestamp(int(headers["webhook-timestamp"]), UTC)
    assert Webhook(SECRET).sign(headers["webhook-id"], moment, "") == headers["webhook-signature"]


def test_the_episode_timeout_bounds_the_whole_episode(calculator: str) -> None:
    async def scenario() -> None:
        episode, _ = await open_episode(config(calculator, episode_timeout_s=0.5), ROW)
        try:
            await asyncio.sleep(0.6)
            with pytest.raises(EpisodeFailed, match="episode_timeout_s"):
                await episode.step({"type": "list_tools"})
        finally:
            await episode.close()
    run(scenario())

