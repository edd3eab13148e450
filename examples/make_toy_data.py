"""Generate the toy JSONL datasets under examples/data/ (deterministic; re-run to regenerate).

- vowel_train.jsonl / vowel_eval.jsonl: "start the answer with a vowel" (examples/tiny.yaml, scored by the
  built-in regex_match reward). A random tiny model starts a completion with a vowel about 5% of the time,
  so there is signal from the first step and the reward visibly climbs within a minute on a CPU.
- copy_digit.jsonl: "copy the digit in the prompt", with the digit in an `answer` column (exact_match-style).
- chat_vowel.jsonl: the vowel task with chat-message prompts, to exercise the chat template path.

Usage: python examples/make_toy_data.py [output_dir]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = (
    "cat dog sun map hat pen cup box red sky sea car bus fox owl bee ant cow pig hen "
    "jam tea pie oak elm ivy log net web kit zip"
).split()


def _write(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {path}")


def vowel_rows(words: list[str]) -> list[dict[str, object]]:
    return [{"prompt": f"{word}: ", "word": word} for word in words]


def copy_digit_rows(count: int, rng: random.Random) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for _ in range(count):
        digit = rng.randrange(10)
        rows.append({"prompt": f"digit {digit}", "answer": str(digit)})
    return rows


def main(output_dir: Path) -> None:
    rng = random.Random(0)
    words = list(WORDS)
    rng.shuffle(words)
    output_dir.mkdir(parents=True, exist_ok=True)
    _write(output_dir / "vowel_train.jsonl", vowel_rows(words[:24]))
    _write(output_dir / "vowel_eval.jsonl", vowel_rows(words[24:]))
    _write(output_dir / "copy_digit.jsonl", copy_digit_rows(40, rng))
    chat: list[dict[str, object]] = [
        {"prompt": [{"role": "user", "content": f"Say a vowel after {w}"}], "word": w} for w in words[:8]
    ]
    _write(output_dir / "chat_vowel.jsonl", chat)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
