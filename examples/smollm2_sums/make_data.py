"""Generate the small-sums datasets of examples/smollm2_sums (deterministic by seed; re-run to regenerate).

The sums come from reasoning-gym 0.1.25's `basic_arithmetic` task (offline), two one-digit terms (0-10 in its
ranges) and `+` only: "3 + 4", answer "7", checked by the task's own `score_answer`. `--operator -` gives the
differences instead ("3 - 4", answer "-1"), bench/learning.py's second task on this model. reasoning-gym draws them at
random; we keep each distinct sum once (121 exist), leave out the worked examples, and split the rest in the order drawn:

- eval.jsonl: the first EVAL_ROWS sums, the held-out set (`grpo train` reports its exact match as
  eval/accuracy; bench/learning_smollm2.py evaluates it before and after training);
- train.jsonl: every other sum (78), none of which is held out.

Each row is a chat prompt: the instruction as the system turn, three worked examples as earlier turns, then the
sum; the `answer` column is what the built-in `exact_match` reward compares the stripped completion with.

Usage: python examples/smollm2_sums/make_data.py [output_dir] [--seed N]
Needs `pip install reasoning-gym==0.1.25` (in the dev and bench extras).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TASK = "basic_arithmetic"
TASK_PARAMS: dict[str, Any] = {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_parentheses": False,
    "allow_negation": False,
}
DISTINCT_SUMS = 121  # ordered pairs of terms 0-10 (reasoning-gym's one-digit range goes up to 10)
EVAL_ROWS = 40
SEED = 0
SYSTEM = "Answer with only the number."
# Worked examples per operator, never asked.
SHOTS = {
    "+": (("3 + 5", "8"), ("2 + 7", "9"), ("6 + 6", "12")),
    "-": (("8 - 3", "5"), ("2 - 7", "-5"), ("6 - 6", "0")),
}


def chat_prompt(expression: str, operator: str = "+") -> list[dict[str, str]]:
    """The instruction as the system turn, the worked examples as earlier turns, then the sum."""
    messages = [{"role": "system", "content": SYSTEM}]
    for example, answer in SHOTS[operator]:
        messages += [{"role": "user", "content": f"{example} ="}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": f"{expression} ="}]


def generate(seed: int = SEED, operator: str = "+") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows): every distinct sum but the worked examples, split in the order drawn."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(
        TASK, size=50 * DISTINCT_SUMS, seed=seed, operators=(operator,), **TASK_PARAMS
    )
    seen = {expression for expression, _ in SHOTS[operator]}
    rows: list[dict[str, Any]] = []
    for entry in dataset:
        expression = entry["metadata"]["expression"]
        if expression in seen:
            continue
        seen.add(expression)
        assert dataset.score_answer(entry["answer"], entry) == 1.0  # the task's own checker agrees
        rows.append({"prompt": chat_prompt(expression, operator), "answer": entry["answer"], "expression": expression})
    if len(seen) != DISTINCT_SUMS:
        raise RuntimeError(f"{TASK} {TASK_PARAMS} gave {len(seen)} distinct sums, {DISTINCT_SUMS} expected")
    return rows[EVAL_ROWS:], rows[:EVAL_ROWS]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main(output_dir: Path, seed: int = SEED, operator: str = "+") -> None:
    train, held_out = generate(seed, operator)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(output_dir / "train.jsonl", train)
    write_jsonl(output_dir / "eval.jsonl", held_out)
    print(f"wrote {len(train)} training and {len(held_out)} held-out rows to {output_dir}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", nargs="?", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--operator", choices=sorted(SHOTS), default="+")
    args = parser.parse_args()
    main(args.output_dir, args.seed, args.operator)
