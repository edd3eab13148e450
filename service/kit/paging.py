"""Cursor pages, for REST and gRPC lists alike: the page sizes, and how a page is cut.

A list reads one row more than it returns: the extra row only tells that another page follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Query

from service.kit.errors import ValidationFailed

T = TypeVar("T")


@dataclass(frozen=True)
class PageSize:
    default: int
    maximum: int


RESOURCES = PageSize(20, 100)  # jobs, datasets, reward functions, webhooks and their deliveries
EVENTS = PageSize(100, 500)  # a job's events and samples
METRIC_POINTS = PageSize(10_000, 50_000)  # (step, name, value) points of a job's metrics

# The REST `limit` query parameters; their defaults are the PageSize defaults, given where each is used.
Limit = Annotated[int, Query(ge=1, le=RESOURCES.maximum, description="Page size.")]
EventLimit = Annotated[int, Query(ge=1, le=EVENTS.maximum, description="Page size.")]
PointLimit = Annotated[int, Query(ge=1, le=METRIC_POINTS.maximum, description="Most points per page.")]


def page(rows: Sequence[T], limit: int) -> tuple[Sequence[T], bool]:
    """`rows` read with `limit + 1` -> (the page, whether more follow)."""
    return rows[:limit], len(rows) > limit


def page_size(requested: int, size: PageSize, field: str = "page_size") -> int:
    """The `limit` for a gRPC request's page_size: 0 = the default, above the maximum = an error (as in REST)."""
    if requested == 0:
        return size.default
    if not 1 <= requested <= size.maximum:
        message = f"{field}: must be between 1 and {size.maximum} (0 = {size.default})"
        raise ValidationFailed(message, details=[{"field": field, "message": message}])
    return requested
