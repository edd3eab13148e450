"""Write the datasets of examples/smollm2_tools: "a*b=?" questions that SmolLM2-135M-Instruct answers with the
calculator's tools (examples/environments/arithmetic.py).

Each row's prompt is a chat: a system turn saying how to answer, two worked examples as earlier turns (the
`multiply` call, its result, the `submit` call, its echo, a one-line answer), then the question. The model was not
trained on tool calls; the examples are how it learns the format in context (with one, it
almost never calls `multiply`). `answer` is what the calculator's
`get_reward` compares the submitted answer with. Questions: a in 2-29, b in 2-9 (224); a seeded third is held
out (eval.jsonl), the rest is train.jsonl. Deterministic; standard library only.

    python examples/smollm2_tools/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYSTEM = "Answer with the tools: multiply the numbers, then submit the result."
EXAMPLES = ((34, 3), (31, 6))  # outside the questions' range, so no question is its own example
SPLIT_SEED = 4321


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def worked_example(a: int, b: int) -> list[dict[str, str]]:
    result = str(float(a * b))
    return [
        {"role": "user", "content": f"{a}*{b}=?"},
        {"role": "assistant", "content": call("multiply", a=a, b=b)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": call("submit", answer=result)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


def row(a: int, b: int) -> dict[str, Any]:
    question = f"{a}*{b}=?"
    shots = [turn for a_b in EXAMPLES for turn in worked_example(*a_b)]
    prompt = [{"role": "system", "content": SYSTEM}, *shots, {"role": "user", "content": question}]
    return {"prompt": prompt, "question": question, "answer": str(a * b)}


def main(output_dir: Path = HERE / "data") -> None:
    questions = [(a, b) for a in range(2, 30) for b in range(2, 10)]
    random.Random(SPLIT_SEED).shuffle(questions)
    held_out = len(questions) // 3
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("eval", questions[:held_out]), ("train", questions[held_out:])):
        with open(output_dir / f"{name}.jsonl", "w") as out:
            out.writelines(json.dumps(row(a, b)) + "\n" for a, b in part)
        print(f"{name}: {len(part)} rows")


if __name__ == "__main__":
    main()
