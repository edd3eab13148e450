"""SQLAlchemy models of this domain."""

from service.kit.db import Base  # noqa: F401
