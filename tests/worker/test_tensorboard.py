"""TensorBoard event files: every finite metric becomes a scalar at its step, readable as TFRecord events."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2

from worker.tensorboard import TensorBoardLog


def _scalars(path: Path) -> dict[tuple[str, int], float]:
    found: dict[tuple[str, int], float] = {}
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        record = data[offset + 12 : offset + 12 + length]  # 8-byte length + 4-byte CRC, then the event
        offset += 12 + length + 4
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            found[(value.tag, event.step)] = value.simple_value
    return found


def test_metrics_are_written_as_scalars_per_step(tmp_path: Path) -> None:
    log = TensorBoardLog(tmp_path / "tb", "attempt-1")
    log.write(1, {"reward/mean": 0.25, "kl": 0.01, "loss": float("nan")})
    log.write(2, {"reward/mean": 0.5, "kl": 0.02})
    log.close()

    files = log.files()
    assert len(files) == 1 and files[0].parts[0] == "attempt-1"
    scalars = _scalars(tmp_path / "tb" / files[0])
    assert scalars[("reward/mean", 1)] == 0.25
    assert scalars[("reward/mean", 2)] == 0.5
    assert abs(scalars[("kl", 2)] - 0.02) < 1e-7
    assert ("loss", 1) not in scalars  # NaN is skipped, not written as garbage
