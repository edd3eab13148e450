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


SessionDep = Annotated[Session, Depends(get_session)]
