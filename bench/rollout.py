"""Rollout benchmark: completion tokens per second of the native rollout against vLLM's, same model and prompts.

    .venv/bin/python bench/rollout.py                          # qwen2, 32k vocabulary, 4 x 8 completions of 32 tokens
    .venv/bin/python bench/rollout.py --arch llama --vocab small --tokens 64 --reps 3
    .venv/bin/python bench/rollout.py --device cuda --hidden 896 --layers 24 --dtype bfloat16   # on a GPU

One GRPO step's generation: 4 prompts x G = 8 samples, temperature 1, `max_completion_length` tokens, seeded.
The model is one of `bench/models.py` (random weights, realistic proportions; `--hidden/--layers` scale it,
e.g. to a Qwen2-0.5B shape on a GPU), loaded by each child as a trainer would (`build_model_bundle`).
Each (engine, repetition) runs in its own child process, alternating (A B B A ...) because these shared
machines drift in speed over minutes. A child times one warm-up rollout, then `--rollouts` more; a vLLM
child also times building its engine and one weight sync (`sync_weights`, what follows each optimiser step).
Completions may stop early at EOS: the figure is generated tokens (EOS included) over wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import SEED, TORCH_THREADS, read_prompts, write_prompts
from models import ARCHS, REALISTIC, VOCABS, Shape, build_model, default_cache_dir, hf_config, hf_tokenizer

ENGINES = ("native", "vllm")
PROMPTS, GENERATIONS = 4, 8


def child_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(TORCH_THREADS)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from contract.config import GRPOConfig
    from worker.grpo.backends import fast_path_for
    from worker.grpo.concurrency import SideThread, side_thread_helps
    from worker.grpo.modeling import build_model_bundle
    from worker.grpo.rollout import NativeRollout, render_prompt
    from worker.grpo.vllm_rollout import VLLMRollout

    config = GRPOConfig(
        num_generations=GENERATIONS,
        prompts_per_step=PROMPTS,
        max_steps=1,
        max_completion_length=args.tokens,
        temperature=1.0,
        dtype=args.dtype,
        use_vllm=args.child == "vllm",
        seed=SEED,
    )
    work = Path(args.work)
    models = build_model_bundle(args.model_dir, config, cache_dir=work, total_updates=1, device=args.device)
    prompts = [render_prompt(models.tokenizer, row["prompt"]) for row in read_prompts(Path(args.data))][:PROMPTS]
    record: dict[str, Any] = {"engine": args.child, "rollout_s": [], "tokens": []}
    side = SideThread() if side_thread_helps(models.policy.device) else None
    started = time.perf_counter()
    engine: Any = (
        VLLMRollout(models, config, work / f"engine-{os.getpid()}")
        if args.child == "vllm"
        else NativeRollout(models.policy, models.tokenizer, config, fast=fast_path_for(models, config))
    )
    record["build_s"] = time.perf_counter() - started
    for index in range(args.rollouts + 1):  # the first is a warm-up
        started = time.perf_counter()
        rollout = engine.generate(prompts, generator_seed=SEED + index, side=side)
        if models.policy.device.type == "cuda":
            torch.cuda.synchronize()
        if index:
            record["rollout_s"].append(time.perf_counter() - started)
            record["tokens"].append(int(rollout.completion_mask.sum()))
    started = time.perf_counter()
    engine.sync_weights()
    record["sync_s"] = time.perf_counter() - started
    engine.close()
    if side is not None:
        side.close()
    Path(args.record).write_text(json.dumps(record))


def _child_env() -> dict[str, str]:
    return os.environ | {
        "OMP_NUM_THREADS": str(TORCH_THREADS),
        "MKL_NUM_THREADS": str(TORCH_THREADS),
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def spawn(engine: str, args: argparse.Namespace, model_dir: Path, data: Path, work: Path, rep: int) -> dict[str, Any]:
    record_path = work / f"{engine}-{rep}.json"
    command = [sys.executable, __file__, "--child", engine, "--model-dir", str(model_dir), "--data", str(data)]
    command += ["--work", str(work), "--record", str(record_path), "--tokens", str(args.tokens)]
    command += ["--rollouts", str(args.rollouts), "--device", args.device, "--dtype", args.dtype]
    done = subprocess.run(command, env=_child_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} child failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return dict(json.loads(record_path.read_text()))


def build_scaled_model(args: argparse.Namespace, out_dir: Path, cache_dir: Path) -> Path:
    """bench/models.py's model, at its realistic shape or scaled by --hidden/--layers (random weights)."""
    if args.hidden is None and args.layers is None:
        return build_model(args.arch, args.vocab, out_dir, cache_dir=cache_dir)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    hidden = args.hidden or REALISTIC.hidden_size
    shape = Shape(
        hidden_size=hidden,
        intermediate_size=(int(hidden * 2.69) // 16) * 16,
        num_hidden_layers=args.layers or REALISTIC.num_hidden_layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        head_dim=64,
    )
    tokenizer = hf_tokenizer(args.vocab, cache_dir)
    special = {"pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(args.arch, len(tokenizer), special, shape))
    model.generation_config = GenerationConfig(
        bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"]
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--vocab", choices=VOCABS, default="32k")
    parser.add_argument("--tokens", type=int, default=32, help="max_completion_length")
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per child (after one warm-up)")
    parser.add_argument("--reps", type=int, default=2, help="children per engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (heads of 64, GQA 4:1)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    # child-only
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="grpo-rollout-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cache_dir = args.cache_dir or default_cache_dir()
    scale = "" if args.hidden is None and args.layers is None else f"-h{args.hidden}-l{args.layers}"
    model_dir = build_scaled_model(args, work / f"{args.arch}-{args.vocab}{scale}", cache_dir)
    data = write_prompts(work / "prompts.jsonl", PROMPTS)
    records: dict[str, list[dict[str, Any]]] = {engine: [] for engine in ENGINES}
    for rep in range(args.reps):
        order = ENGINES if rep % 2 == 0 else ENGINES[::-1]  # A B, B A, ...
        for engine in order:
            records[engine].append(spawn(engine, args, model_dir, data, work, rep))

    def rate(engine: str) -> list[float]:
        return [t / s for r in records[engine] for t, s in zip(r["tokens"], r["rollout_s"], strict=True)]

    print(f"rollout: {args.arch} {args.vocab}{scale}, {PROMPTS} prompts x {GENERATIONS}, up to {args.tokens} tokens, "
          f"{args.device} {args.dtype}, {TORCH_THREADS} threads, {args.reps} children x {args.rollouts} rollouts each")
    print("| engine | tokens/s median (min-max) | rollout s median | engine build s | weight sync s |")
    print("|---|---:|---:|---:|---:|")
    summary: dict[str, Any] = {}
    for engine in ENGINES:
        rates = rate(engine)
        seconds = [s for r in records[engine] for s in r["rollout_s"]]
        build = statistics.median(r["build_s"] for r in records[engine])
        sync = statistics.median(r["sync_s"] for r in records[engine])
        summary[engine] = {"tokens_per_s": rates, "rollout_s": seconds, "build_s": build, "sync_s": sync}
        print(f"| {engine} | {statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
              f"{statistics.median(seconds):.3f} | {build:.2f} | {sync:.3f} |")
    speedup = statistics.median(rate("vllm")) / statistics.median(rate("native"))
    print(f"vLLM / native tokens/s: {speedup:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
