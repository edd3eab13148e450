"""FastAPI dependency aliases shared by the routers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from service.kit.db import session_scope


def get_session() -> Iterator[Session]:
    # The request is the transaction boundary: commit on success, roll back on error.
    with session_scope() as session:
        yield session


# scope="function": commit before the response is sent (FastAPI's default for yield dependencies ends
# them after the response), so a client never sees a 201 for a row that then fails to commit, reads
# its own writes at once, and streaming responses (SSE, downloads) do not hold a pooled connection.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
