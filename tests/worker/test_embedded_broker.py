"""The embedded broker (kombu's SQLAlchemy transport on SQLite) when two processes create a queue's row at once:
the API publishing a queue's first job while the worker declares that queue at start-up."""

from __future__ import annotations

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
