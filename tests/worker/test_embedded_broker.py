"""The embedded broker (kombu's SQLAlchemy transport on SQLite): two processes creating a queue's row at once (the
API publishing a queue's first job while the worker declares that queue at start-up), and forks during a poll."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from kombu import Connection, Queue
from sqlalchemy import create_engine, event, text

from worker.embedded_broker import TRANSPORT_PATH


def test_a_queue_created_meanwhile_by_another_process_is_used(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    other = create_engine(url)  # the other process's connection
    with Connection(hostname=url, transport=TRANSPORT_PATH) as connection:
        channel: Any = connection.default_channel
        Queue("gpu", channel=channel).declare()  # creates the tables

        @event.listens_for(channel.session.get_bind(), "before_cursor_execute")
        def _race(conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
            # Between this channel's look-up (no row) and its insert, the other process inserts the row.
            if statement.startswith("INSERT INTO kombu_queue"):
                with other.begin() as race:
                    race.execute(text("INSERT INTO kombu_queue (name) VALUES ('cpu')"))

        Queue("cpu", channel=channel).declare()
        event.remove(channel.session.get_bind(), "before_cursor_execute", _race)
        producer = connection.Producer(channel)
        producer.publish({"job": 1}, routing_key="cpu", exchange="", declare=[])
        message = Queue("cpu", channel=channel).get(no_ack=True)
        assert message is not None and message.payload == {"job": 1}
    with other.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM kombu_queue WHERE name = 'cpu'")).scalar_one() == 1


def test_a_fork_waits_for_the_poll_under_way(tmp_path: Path) -> None:
    # The worker's pool forks a job's child from a thread of its own while the main thread polls: a fork in the
    # middle of a SQLite call leaves the child with libsqlite's allocator mutex held, and the child hangs.
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    inside, finished = threading.Event(), threading.Event()
    forked_at: list[float] = []
    with Connection(hostname=url, transport=TRANSPORT_PATH) as connection:
        channel: Any = connection.default_channel
        Queue("gpu", channel=channel).declare()

        @event.listens_for(channel.session.get_bind(), "before_cursor_execute")
        def _slow_poll(*_args: Any) -> None:
            inside.set()
            time.sleep(0.5)  # the fork below is asked for meanwhile
            finished.set()

        def fork() -> None:
            inside.wait(10)
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forked_at.append(time.monotonic())
            os.waitpid(pid, 0)

        forking = threading.Thread(target=fork)
        forking.start()
        assert Queue("gpu", channel=channel).get(no_ack=True) is None
        poll_done = time.monotonic()
        forking.join(10)
        event.remove(channel.session.get_bind(), "before_cursor_execute", _slow_poll)
    assert finished.is_set() and forked_at and forked_at[0] >= poll_done - 0.05
