"""A complete remote reward server built with the helper in `worker.reward_server`.

Scores a completion 1.0 when it contains the dataset row's ``answer`` inside ``\\boxed{...}``, 0.1 when it
has a ``\\boxed{}`` with something else, 0.0 otherwise, and abstains (null) on rows without an answer.

Run it (the secret is the one shown when you registered the reward function)::

    GRPO_REWARD_SECRET=whsec_... python examples/reward_server.py --port 9000

then register ``http://127.0.0.1:9000/score`` (development mode allows loopback; production requires a
public https URL, e.g. behind a TLS-terminating proxy). Any framework works: call
``verify_and_parse(secret, headers, raw_body)`` and answer ``encode_response(rewards)``.
"""

from __future__ import annotations

import argparse
import os
import re

import uvicorn

from worker.reward_server import RewardRequest, make_reward_app

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def score(request: RewardRequest) -> list[float | None]:
    """One reward per item, in order; None abstains."""
    rewards: list[float | None] = []
    for item in request.items:
        answer = item.metadata.get("answer")
        if answer is None:
            rewards.append(None)
            continue
        found = BOXED.findall(item.completion)
        if not found:
            rewards.append(0.0)
        else:
            rewards.append(1.0 if found[-1].strip() == str(answer).strip() else 0.1)
    return rewards


VOWELS = frozenset("aeiou")


def score_repeat_letter(request: RewardRequest) -> list[float | None]:
    """The demo's dense task: per completion character, 1.0 for the row's ``answer`` vowel, 0.2 for another
    vowel, 0 otherwise, averaged. Partial credit gives a tiny random model a gradient from the first step."""
    rewards: list[float | None] = []
    for item in request.items:
        letter = str(item.metadata.get("answer", ""))
        text = item.completion
        if not letter:
            rewards.append(None)
            continue
        credit = [1.0 if ch == letter else 0.2 if ch in VOWELS else 0.0 for ch in text]
        rewards.append(sum(credit) / len(credit) if credit else 0.0)
    return rewards


def score_exact(request: RewardRequest) -> list[float | None]:
    """The demo's task: 1.0 when the stripped completion is exactly the row's ``answer``, else 0.0."""
    rewards: list[float | None] = []
    for item in request.items:
        answer = item.metadata.get("answer")
        rewards.append(None if answer is None else float(item.completion.strip() == str(answer).strip()))
    return rewards


SCORERS = {"boxed": score, "exact": score_exact, "repeat_letter": score_repeat_letter}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--task", choices=sorted(SCORERS), default="boxed", help="Which scoring rule to serve.")
    args = parser.parse_args()
    secret = os.environ.get("GRPO_REWARD_SECRET")
    if not secret:
        parser.error("set GRPO_REWARD_SECRET to the reward function's whsec_ secret")
    uvicorn.run(make_reward_app(secret, SCORERS[args.task]), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
