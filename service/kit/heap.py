"""Keeping the cyclic garbage collector's pauses short in the API processes.

Why: a full (oldest-generation) collection walks every object the collector tracks, and an API process holds
~130k of them from start-up alone (modules, classes, the app's routes, schemas and OpenAPI models), all alive
until the process exits. Under load a full collection runs about every second and pauses the event loop for
tens of milliseconds, which every in-flight request waits out: it sets the p99. Moving the start-up objects
into the permanent generation (`gc.freeze()`, CPython's documented remedy) leaves collections only the
objects created since, so the pauses become several times shorter (bench/README.md, API figures).

Objects that are frozen and later become cyclic garbage are not reclaimed while frozen; start-up objects are
meant to live as long as the process, and leaving `startup_objects_frozen` (the server stopping) puts them back
under the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_objects_frozen(enabled: bool = True) -> Iterator[None]:
    """While serving: everything allocated so far is out of the cyclic collector's reach."""
    if not enabled:
        yield
        return
    gc.collect()  # frozen garbage would never be freed: collect what is garbage already
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
