"""Reward-phase time with concurrent batches vs one request at a time, same run.

A loopback reward server (the user helper's app under uvicorn) sleeps 100 ms per request. 32 completions
(4 prompts x 8) are scored with max_batch_size 8 and max_concurrency 4 (target <= 150 ms) and, as the
baseline, with max_concurrency 1. Each figure is the median of --repeats calls (cache off, one warm-up).

    .venv/bin/python bench/reward_fanout.py
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract.reward_types import RewardInput  # noqa: E402
from outbound.rewards import RemoteRewardConfig, RemoteRewardSource  # noqa: E402
from worker.reward_server import RewardRequest, make_reward_app  # noqa: E402

LATENCY_S = 0.100
TARGET_MS = 150.0


# What the endpoint scores: the completion's length (this benchmark), or its share of the letter "a" (a reward a
# small model learns to raise: bench/async_grpo.py).
SCORES: dict[str, Callable[[str], float]] = {
    "length": lambda text: float(len(text)),
    "share_of_a": lambda text: text.count("a") / max(len(text), 1),
}


def _serve(secret: str, sock: socket.socket, latency_s: float, score: str) -> None:
    async def scorer(request: RewardRequest) -> list[float | None]:
        await asyncio.sleep(latency_s)  # the endpoint's own work
        return [SCORES[score](item.completion) for item in request.items]

    config = uvicorn.Config(make_reward_app(secret, scorer), log_level="warning", lifespan="off", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def start_server(
    secret: str, *, latency_s: float = LATENCY_S, score: str = "length"
) -> tuple[multiprocessing.Process, int]:
    """The endpoint in its own process, as in production (no GIL shared with the client), sleeping `latency_s`
    per request."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    process = multiprocessing.get_context("fork").Process(
        target=_serve, args=(secret, sock, latency_s, score), daemon=True
    )
    process.start()
    deadline = time.monotonic() + 20
    while True:  # wait until it accepts connections
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("reward server did not start") from None
            time.sleep(0.05)


def completions(n_prompts: int, per_prompt: int) -> list[RewardInput]:
    return [
        RewardInput(
            prompt=f"prompt {g}",
            completion=f"completion {g}-{k}",
            completion_ids=[],
            group_id=g,
            index=g * per_prompt + k,
        )
        for g in range(n_prompts)
        for k in range(per_prompt)
    ]


async def reward_phase_ms(url: str, secret: str, *, concurrency: int, repeats: int) -> list[float]:
    config = RemoteRewardConfig(
        reward_function_id="bench",
        url=url,
        secret=secret,
        job_id="bench",
        max_batch_size=8,
        max_concurrency=concurrency,
        allow_private=True,
        cache_max_entries=0,
    )
    source = RemoteRewardSource(config)
    items = completions(4, 8)
    await source(items, step=0)  # warm-up: connections opened
    timings = []
    for step in range(1, repeats + 1):
        started = time.perf_counter()
        rewards = await source(items, step=step)
        timings.append((time.perf_counter() - started) * 1000)
        assert rewards == [float(len(i.completion)) for i in items]
    await source.aclose()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description="Reward fan-out benchmark.")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    server, port = start_server(secret)
    url = f"http://127.0.0.1:{port}/score"
    try:
        fan = asyncio.run(reward_phase_ms(url, secret, concurrency=4, repeats=args.repeats))
        seq = asyncio.run(reward_phase_ms(url, secret, concurrency=1, repeats=args.repeats))
    finally:
        server.terminate()
        server.join()
    fan_ms, seq_ms = statistics.median(fan), statistics.median(seq)
    print("reward phase, 32 completions, 100 ms endpoint latency, max_batch_size 8 (4 requests)")
    print(f"  max_concurrency 4 : median {fan_ms:7.1f} ms  (min {min(fan):.1f}, max {max(fan):.1f})")
    print(
        f"  max_concurrency 1 : median {seq_ms:7.1f} ms  (min {min(seq):.1f}, max {max(seq):.1f})  [baseline]"
    )
    print(
        f"  speed-up {seq_ms / fan_ms:.2f}x; target <= {TARGET_MS:.0f} ms: {'PASS' if fan_ms <= TARGET_MS else 'FAIL'}"
    )
    sys.exit(0 if fan_ms <= TARGET_MS else 1)


if __name__ == "__main__":
    main()
