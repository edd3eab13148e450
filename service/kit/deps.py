"""FastAPI dependency aliases shared by the routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.kit.db import session_scope
from service.kit.reads import THREADED_READS, Reads


def get_session() -> Iterator[Session]:
    # The request is the transaction boundary: commit on success, roll back on error.
    with session_scope() as session:
        yield session


# scope="function": commit before the response is sent (FastAPI's default for yield dependencies ends
# them after the response), so a client never sees a 201 for a row that then fails to commit, reads
# its own writes at once, and streaming responses (SSE, downloads) do not hold a pooled connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def reads_of(request: Request) -> Reads:
    """The app's `Reads` (opened by its lifespan); an app served without its lifespan reads through threads.

    A plain function taking the request rather than a dependency: on the polled `GET /v1/jobs/{id}`, each
    dependency level FastAPI resolves costs about a tenth of the request's CPU."""
    reads: Reads | None = getattr(request.app.state, "reads", None)
    return reads or THREADED_READS
