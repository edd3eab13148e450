"""A real OpenAI-compatible chat completions endpoint on loopback (uvicorn in a thread, port 0), for score_model.

The server answers ``POST /v1/chat/completions`` the way OpenAI and vLLM do (``choices[0].message.content``),
with the text a `Reply` callable chooses from the request, and records every request so tests can assert on
the rendered messages, the model name, the sampling parameters and the headers. A reply may also be a raw
`Answer` (a status and body) to play a failing endpoint.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.worker.reward_servers import start_uvicorn, stop_uvicorn

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Answer:
    """A raw answer instead of a chat completion."""

    status: int
    body: bytes = b""
    headers: dict[str, str] | None = None


Reply = Callable[[dict[str, Any]], "str | Answer"]


@dataclass(frozen=True)
class ChatRequest:
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, str]]:
        return list(self.body["messages"])


class ChatServer:
    """An OpenAI-compatible chat endpoint on 127.0.0.1:<port>."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.seen: list[ChatRequest] = []
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CHAT_PATH}"

    async def _completions(self, request: Request) -> Response:
        body = json.loads(await request.body())
        with self._lock:
            self.seen.append(ChatRequest(dict(request.headers), body))
            number = len(self.seen)
        answer = self.reply(body)
        if isinstance(answer, Answer):
            return Response(answer.body, status_code=answer.status, media_type="application/json",
                            headers=answer.headers)
        return JSONResponse({
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
        })

    def start(self) -> ChatServer:
        app = Starlette(routes=[Route(CHAT_PATH, self._completions, methods=["POST"])])
        self._server, self._thread, self.port = start_uvicorn(app)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            stop_uvicorn(self._server, self._thread)
        self._server = self._thread = None


@contextmanager
def chat_server(reply: Reply) -> Iterator[ChatServer]:
    server = ChatServer(reply).start()
    try:
        yield server
    finally:
        server.stop()


def user_text(body: dict[str, Any]) -> str:
    """The last user message of a chat request."""
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


def judge(body: dict[str, Any]) -> str:
    """A grader model that reads ``Answer: ...`` and ``Reference: ...`` lines of the rendered prompt.

    It answers OpenAI's score_model output, ``{"result": 0.9}`` when they agree, 0.2 when they do not; a
    prompt without both lines (the template was not rendered) gets no score at all.
    """
    lines = dict(line.split(": ", 1) for line in user_text(body).splitlines() if ": " in line)
    answer, reference = lines.get("Answer"), lines.get("Reference")
    if answer is None or reference is None or "{{" in answer + reference:
        return "I cannot grade this."
    return json.dumps({"result": 0.9 if answer.strip() == reference.strip() else 0.2, "steps": []})
