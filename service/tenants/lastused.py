"""`last_used_at` of API keys, written at most once a minute per key rather than on every request.

Why: authentication answers most requests from the in-process cache (keycache) without touching the database;
an UPDATE per request would cost more than the requests it records. Each process remembers when it last wrote
each key's time and writes again (in a thread, after the request has been answered) once RESOLUTION_S has
passed; the UPDATE only changes rows not written within RESOLUTION_S, so several processes serving one key
still write it about once a minute. `last_used_at` is therefore exact to within a minute.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from datetime import timedelta

from service.kit.db import session_scope, utcnow
from service.tenants import repository

RESOLUTION_S = 60.0
MAX_ENTRIES = 10_000

log = logging.getLogger(__name__)


class LastUsed:
    def __init__(self, resolution_s: float = RESOLUTION_S) -> None:
        self.resolution_s = resolution_s
        self._written: OrderedDict[str, float] = OrderedDict()  # key id -> monotonic time of our last write
        self._lock = threading.Lock()
        self._writes: set[asyncio.Task[None]] = set()  # held so the loop does not drop them mid-flight

    def touch(self, api_key_id: str) -> None:
        """Note a use of the key (on the event loop); schedules a write when this process has not written its
        time within the resolution."""
        last = self._written.get(api_key_id)  # lock-free fast path: dict reads are atomic
        now = time.monotonic()
        if last is not None and now - last < self.resolution_s:
            return
        with self._lock:
            last = self._written.get(api_key_id)
            if last is not None and now - last < self.resolution_s:
                return
            self._written.pop(api_key_id, None)
            self._written[api_key_id] = now
            while len(self._written) > MAX_ENTRIES:
                self._written.popitem(last=False)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._write, api_key_id))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _write(self, api_key_id: str) -> None:
        now = utcnow()
        try:
            with session_scope() as session:
                repository.mark_used(session, [api_key_id], now, now - timedelta(seconds=self.resolution_s))
        except Exception:  # the request it records has been answered; a lost mark is retried next minute
            log.warning("could not record the last use of API key %s", api_key_id, exc_info=True)
            with self._lock:
                self._written.pop(api_key_id, None)

    def clear(self) -> None:
        with self._lock:
            self._written.clear()
