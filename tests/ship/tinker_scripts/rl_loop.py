"""A GRPO-style loop written against the official `tinker` SDK only (run in .venv-tinker, nothing of ours
imported): sample groups, score them here, importance_sampling forward_backward, optim_step, fresh sampler
weights every step. Then save_state / load_state must restore the exact weights, and a second training client
created from the saved state must compute the same log-probs.

Environment: TINKER_BASE_URL, TINKER_API_KEY (the SDK's own), BASE_MODEL, STEPS, LEARNING_RATE.
Prints one JSON object: rewards per step, the log-probs compared, the saved path.
"""

from __future__ import annotations

import json
import os
import random

import tinker
from tinker import types

GROUP = int(os.environ.get("GROUP", "8"))
PROMPTS_PER_STEP = int(os.environ.get("PROMPTS", "8"))
LETTERS = "abcdefgh"


def task(rng: random.Random) -> tuple[str, str]:
    name = os.environ.get("TASK", "repeat")
    if name == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"user: {a}+{b}=?\nassistant: ", str(a + b)
    if name == "larger":
        a, b = rng.sample(range(10), 2)
        return f"user: Larger of {a} and {b}?\nassistant: ", str(max(a, b))
    letter, times = rng.choice(LETTERS), rng.randint(2, 4)
    return f"user: Repeat {letter} {times} times.\nassistant: ", letter * times


def reward(text: str, answer: str) -> float:
    """1 for the exact answer; otherwise the share of leading characters that match it."""
    text = text.split("</s>")[0].strip()
    if text == answer:
        return 1.0
    matched = 0
    for got, want in zip(text, answer, strict=False):
        if got != want:
            break
        matched += 1
    return 0.5 * matched / max(len(answer), len(text), 1)


def datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """Tinker's convention: model input = all tokens but the last; position i is scored on target i."""
    tokens = prompt + completion
    prompt_targets = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * prompt_targets + list(logprobs),
            "advantages": [0.0] * prompt_targets + [advantage] * len(completion),
        },
    )


def greedy_accuracy(sampler: tinker.SamplingClient, tokenizer: object) -> float:
    """Exact answers, greedy, on 40 fixed questions (drawn apart from training's stream)."""
    rng = random.Random(12345)
    tasks = [task(rng) for _ in range(40)]
    futures = [
        sampler.sample(prompt=types.ModelInput.from_ints(tokenizer.encode(text)), num_samples=1,  # type: ignore[attr-defined]
                       sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0))
        for text, _ in tasks
    ]
    right = [reward(tokenizer.decode(f.result().sequences[0].tokens), answer) == 1.0  # type: ignore[attr-defined]
             for f, (_, answer) in zip(futures, tasks, strict=True)]
    return sum(right) / len(right)


def train(tc: tinker.TrainingClient, steps: int, learning_rate: float) -> list[float]:
    tokenizer = tc.get_tokenizer()
    rng = random.Random(0)
    history = []
    for step in range(steps):
        sampler = tc.save_weights_and_get_sampling_client(name=f"step-{step}").result()
        tasks = [task(rng) for _ in range(PROMPTS_PER_STEP)]
        prompts = [tokenizer.encode(text) for text, _ in tasks]
        futures = [
            sampler.sample(prompt=types.ModelInput.from_ints(ids), num_samples=GROUP,
                           sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=step * 100 + i))
            for i, ids in enumerate(prompts)
        ]
        data, scores = [], []
        for ids, (_, answer), future in zip(prompts, tasks, futures, strict=True):
            sequences = future.result().sequences
            group = [reward(tokenizer.decode(seq.tokens), answer) for seq in sequences]
            mean = sum(group) / len(group)
            scores += group
            data += [datum(ids, list(seq.tokens), list(seq.logprobs or []), r - mean)
                     for seq, r in zip(sequences, group, strict=True)]
        fb = tc.forward_backward(data, loss_fn="importance_sampling")
        step_future = tc.optim_step(types.AdamParams(learning_rate=learning_rate))
        fb.result()
        step_future.result()
        history.append(sum(scores) / len(scores))
    return history


def probe_logprobs(tc: tinker.TrainingClient) -> list[float]:
    tokens = tc.get_tokenizer().encode("user: Repeat c 3 times.\nassistant: ccc")
    probe = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    output = tc.forward([probe], loss_fn="cross_entropy").result()
    return [float(x) for x in output.loss_fn_outputs[0]["logprobs"].tolist()]


def main() -> None:
    service = tinker.ServiceClient()
    base_model = os.environ["BASE_MODEL"]
    steps, learning_rate = int(os.environ.get("STEPS", "8")), float(os.environ.get("LEARNING_RATE", "1e-3"))
    tc = service.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
    if os.environ.get("ONLY_TRAIN"):  # the loop and where it ends, for comparing runs
        rewards = train(tc, steps, learning_rate)
        print(json.dumps({"rewards": rewards, "after": probe_logprobs(tc)}))
        service.close("success")
        return
    capabilities = [m.model_name for m in service.get_server_capabilities().supported_models]
    tokenizer = tc.get_tokenizer()
    accuracy_before = greedy_accuracy(service.create_sampling_client(base_model=base_model).result(), tokenizer)
    rewards = train(tc, steps, learning_rate)
    accuracy_after = greedy_accuracy(tc.save_weights_and_get_sampling_client(name="trained").result(), tokenizer)

    saved = tc.save_state("final").result().path
    before = probe_logprobs(tc)
    train(tc, 1, 1e-2)  # moves the weights
    moved = probe_logprobs(tc)
    tc.load_state(saved).result()
    restored = probe_logprobs(tc)
    clone = service.create_training_client_from_state(saved).result()
    cloned = probe_logprobs(clone)
    service.close("success")
    print(json.dumps({"capabilities": capabilities, "rewards": rewards, "accuracy": [accuracy_before, accuracy_after],
                      "saved": saved, "before": before, "moved": moved, "restored": restored, "cloned": cloned,
                      "model_id": tc.get_info().model_id}))


if __name__ == "__main__":
    main()
