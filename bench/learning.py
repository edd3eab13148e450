"""Learning benchmark: held-out accuracy before/after GRPO, our engine against TRL's GRPOTrainer.

Same warm model (`builtin:tiny-instruct`), same training and held-out questions (worker.grpo.synthetic),
same exact-match reward, same hyperparameters (the demo's: G 8, 16 prompts/step, lr 1e-3 with 10 warm-up
steps and linear decay, beta 0, DAPO loss, max 4 new tokens), same seeds and step budget. Accuracy is
measured by one evaluator for both (greedy, chat template, exact match after strip) on the task's held-out
questions, which neither the warm model nor RL ever trained on.

Each (task, seed, framework) runs in its own child process, alternating frameworks, one torch thread.

    PYTHONPATH=. python bench/learning.py                      # 3 tasks x 3 seeds x 2 frameworks
    PYTHONPATH=. python bench/learning.py --tasks larger --seeds 0 --steps 20   # a quick check

Needs the `bench` extra (trl). Prints a table: accuracy before, after (mean ± std over seeds) per framework.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TASKS = ("larger", "smaller", "add")
SEEDS = (0, 1, 2)
STEPS = 120
NUM_GENERATIONS = 8
PROMPTS_PER_STEP = 16
MAX_COMPLETION_LENGTH = 4
LEARNING_RATE = 1e-3
WARMUP_STEPS = 10
TORCH_THREADS = 1


def exact_match_accuracy(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], answers: list[str], max_new_tokens: int
) -> float:
    """Share of chat prompts whose greedy completion, stripped, is exactly the answer (the evaluator of both
    frameworks here, and of bench/learning_smollm2.py)."""
    import torch

    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(t.strip() == a for t, a in zip(texts, answers, strict=True)) / len(answers)


def held_out_accuracy(model: Any, tokenizer: Any, task: str) -> float:
    """Greedy exact-match accuracy on the task's held-out questions (one evaluator for both frameworks)."""
    from worker.grpo.synthetic import held_out_items

    items = held_out_items(task)  # type: ignore[arg-type]
    conversations = [[{"role": "user", "content": i.question}] for i in items]
    return exact_match_accuracy(model, tokenizer, conversations, [i.answer for i in items], MAX_COMPLETION_LENGTH)


def _train_rows(task: str) -> list[dict[str, Any]]:
    from worker.grpo.synthetic import split

    return [item.row() for item in split(task)[0]]  # type: ignore[arg-type]


def run_ours(model_dir: Path, task: str, seed: int, steps: int, work: Path) -> float:
    from contract.config import GRPOConfig
    from contract.spec import BuiltinRewardSpec
    from worker.grpo.data import PromptRow
    from worker.grpo.rewards import build_reward_sources
    from worker.grpo.trainer import GRPOTrainer

    config = GRPOConfig(
        max_steps=steps, num_generations=NUM_GENERATIONS, prompts_per_step=PROMPTS_PER_STEP,
        max_completion_length=MAX_COMPLETION_LENGTH, learning_rate=LEARNING_RATE, warmup_steps=min(WARMUP_STEPS, steps - 1),
        lr_scheduler="linear", beta=0.0, loss_type="dapo", temperature=1.0, checkpoint_every=10_000, seed=seed,
    )
    rows = [PromptRow(prompt=r["prompt"], extras={"answer": r["answer"]}) for r in _train_rows(task)]
    trainer = GRPOTrainer(
        config, base_model=str(model_dir), train_rows=rows,
        reward=build_reward_sources([BuiltinRewardSpec(name="exact_match")]), output_dir=work / "ours-out",
    )
    trainer.train()
    return held_out_accuracy(trainer.models.policy, trainer.models.tokenizer, task)


def run_trl(model_dir: Path, task: str, seed: int, steps: int, work: Path) -> float:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [
        {"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
         "answer": r["answer"]}
        for r in _train_rows(task)
    ]  # rendered with the same template our engine applies

    def exact(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS,  # counts completions
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        warmup_steps=min(WARMUP_STEPS, steps - 1),
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        max_steps=steps,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=exact, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    return held_out_accuracy(trainer.model, tokenizer, task)


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(TORCH_THREADS)
    model_dir = Path(args.model_dir)
    before = held_out_accuracy(
        AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir), args.task
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        runner = run_trl if args.child == "trl" else run_ours
        after = runner(model_dir, args.task, args.seed, args.steps, Path(work))
    print(json.dumps({"framework": args.child, "task": args.task, "seed": args.seed, "before": before,
                      "after": after, "train_s": time.perf_counter() - started}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--child", choices=("ours", "trl"))
    parser.add_argument("--task")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from worker.grpo.warm import build_instruct_model

    cache = Path(tempfile.gettempdir()) / "grpo-bench-models"
    model_dir = build_instruct_model(cache)
    results: list[dict[str, Any]] = []
    for task in args.tasks.split(","):
        for seed in map(int, args.seeds.split(",")):
            order = ("ours", "trl") if seed % 2 == 0 else ("trl", "ours")  # alternate who runs first
            for framework in order:
                done = subprocess.run(
                    [sys.executable, __file__, "--child", framework, "--task", task, "--seed", str(seed),
                     "--steps", str(args.steps), "--model-dir", str(model_dir)],
                    check=True, capture_output=True, text=True,
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results.append(result)
                print(f"{task:8s} seed {seed} {framework:4s}: {result['before']:.0%} -> {result['after']:.0%} "
                      f"({result['train_s']:.0f} s)", flush=True)
    print(f"\nheld-out exact accuracy, {args.steps} steps, seeds {args.seeds} (mean ± std over seeds)\n")
    print("| task | before | ours after | TRL after |\n| --- | --- | --- | --- |")
    for task in args.tasks.split(","):
        rows = [r for r in results if r["task"] == task]
        before = rows[0]["before"]
        cells = []
        for framework in ("ours", "trl"):
            values = [r["after"] for r in rows if r["framework"] == framework]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):.0%} ± {spread:.0%}")
        print(f"| {task} | {before:.0%} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
