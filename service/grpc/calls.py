"""Running the sync domain layer from async servicers.

Domain services are synchronous SQLAlchemy code (shared with the REST routes, which FastAPI runs in its
threadpool). A servicer hands the whole unit of work, including rendering ORM rows to messages, to a
worker thread inside `session_scope()`: one transaction per RPC, committed on success and rolled back on
any exception, exactly like a REST request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session

from service.kit.db import session_scope

T = TypeVar("T")


def _run(work: Callable[[Session], T]) -> T:
    with session_scope() as session:
        return work(session)


async def in_session(work: Callable[[Session], T]) -> T:
    """`work(session)` in a thread, inside one committed-or-rolled-back transaction."""
    return await asyncio.to_thread(_run, work)
