"""Sampling throughput of the primitive training API's samplers: the native decoder against vLLM
(GRPO_PRIMITIVES_SAMPLER=vllm), on the same base model and the same saved adapters.

    .venv/bin/python bench/primitives_sampling.py                      # SmolLM2-135M-Instruct, r 32, 1 and 3 samplers
    .venv/bin/python bench/primitives_sampling.py --models tiny,smollm2 --samplers 1,4 --samples 16 --reps 3
    .venv/bin/python bench/primitives_sampling.py --device cuda --samples 64 --tokens 256     # on a GPU

What the primitives worker does for a Tinker `sample` call on a saved sampler: `--samples` continuations of one
prompt, `--tokens` tokens each (stop=[]: every sequence runs to max_tokens, so both samplers generate the same
number of tokens), temperature 1, seeded. A child loads the base (worker.grpo.resident.ResidentBase) and, for
vllm, its engine (worker.grpo.primitive_vllm.VLLMSampler, timed as `build`); makes K samplers, each a client of
its own seed taken one optimiser step away from the base and saved (rank `--rank`, every linear layer, as the
API trains by default); then times `--calls` sample calls rotating through the K samplers, after one warm-up
call on each. With K > 1 every vLLM call switches the engine's one LoRA slot to another adapter, as tenants'
calls interleave on a worker.

Each (sampler, repetition) runs in its own child process, alternating (A B, B A, ...) over `--reps`, because
these shared machines drift in speed over minutes; a figure is the median over repetitions. Printed per (model,
K): generated tokens per second of each sampler, vllm / native (above 1: vLLM is faster), and vLLM's engine
build time, which a worker pays once per base model at start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from common import TORCH_THREADS  # noqa: E402
from grpo_step import _child_env, _run_child  # noqa: E402
from primitives_memory import MODELS, _int_list  # noqa: E402

SAMPLERS = ("native", "vllm")
PROMPT_TEXT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


# ==================================================================================================
# Child process: one sampler
# ==================================================================================================


def make_samplers(resident: Any, count: int, rank: int, work: Path) -> list[str]:
    """`count` saved samplers on `resident`, each a seeded client one cross_entropy step from the base."""
    import numpy as np

    from worker.grpo.resident import AdamSettings, Datum, LoraSpec

    tokens = list(resident.tokenizer.encode(PROMPT_TEXT))
    datum = Datum(tokens, {"target_tokens": np.asarray(tokens[1:] + tokens[:1]), "weights": np.ones(len(tokens))})
    names = []
    for index in range(count):
        client = f"client-{index}"
        resident.add_client(client, LoraSpec(rank=rank, seed=index))
        resident.forward_backward(client, [datum], "cross_entropy")
        resident.optim_step(client, AdamSettings(learning_rate=1e-3))
        resident.save_state(client, work / client, optimizer=False)
        resident.remove_client(client)
        resident.add_sampler(f"sampler-{index}", work / client)
        names.append(f"sampler-{index}")
    return names


def child_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from worker.grpo.primitive_vllm import VLLMSampler
    from worker.grpo.resident import ResidentBase

    work = Path(args.work)
    resident = ResidentBase(args.model_dir, device=args.device)
    build_s = 0.0
    if args.child == "vllm":
        started = time.perf_counter()
        resident.use_vllm(VLLMSampler(args.model_dir, work / "vllm", max_lora_rank=args.max_lora_rank,
                                      device=resident.device, gpu_memory_utilization=0.3))
        build_s = time.perf_counter() - started
    samplers = make_samplers(resident, args.child_samplers, args.rank, work)
    prompt = list(resident.tokenizer.encode(PROMPT_TEXT))

    def call(index: int) -> int:
        sequences = resident.sample(samplers[index % len(samplers)], prompt, num_samples=args.samples,
                                    max_tokens=args.tokens, temperature=1.0, seed=index, stop=[])
        return sum(len(sequence.tokens) for sequence in sequences)

    for index in range(len(samplers)):
        call(index)  # warm-up: each adapter loaded once, kernels and caches warm
    started = time.perf_counter()
    generated = sum(call(index) for index in range(args.calls))
    seconds = time.perf_counter() - started
    resident.close()
    Path(args.record).write_text(json.dumps({"tokens": generated, "seconds": seconds, "build_s": build_s}))


# ==================================================================================================
# Parent: children, alternating, and the table
# ==================================================================================================


def measure(sampler: str, model_dir: Path, samplers: int, args: argparse.Namespace, work: Path) -> dict[str, float]:
    record_path = work / f"record-{sampler}-{samplers}.json"
    command = [
        "--child", sampler, "--model-dir", str(model_dir), "--child-samplers", str(samplers), "--work",
        tempfile.mkdtemp(dir=work), "--record", str(record_path), "--rank", str(args.rank),
        "--max-lora-rank", str(args.max_lora_rank), "--samples", str(args.samples), "--tokens", str(args.tokens),
        "--calls", str(args.calls), "--threads", str(args.threads), "--device", args.device,
    ]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = _child_env("passive") | {"PYTHONPATH": pythonpath}
    _run_child(command, env, f"{sampler} x{samplers}", __file__, 3600)
    record: dict[str, float] = json.loads(record_path.read_text())
    record_path.unlink()
    return record


def rate(records: Sequence[dict[str, float]]) -> float:
    """Median generated tokens per second over repetitions."""
    return statistics.median(record["tokens"] / record["seconds"] for record in records)


def table_lines(results: dict[tuple[str, int], dict[str, list[dict[str, float]]]]) -> list[str]:
    lines = [
        "| model | samplers | native tok/s | vllm tok/s | vllm / native | vllm build s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (model, samplers), records in results.items():
        native, vllm = rate(records["native"]), rate(records["vllm"])
        build = statistics.median(record["build_s"] for record in records["vllm"])
        lines.append(f"| {model} | {samplers} | {native:.0f} | {vllm:.0f} | {vllm / native:.2f} | {build:.1f} |")
    return lines


# ==================================================================================================
# Command line
# ==================================================================================================


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--samplers", default="1,3", help="comma-separated sampler counts K (default 1,3)")
    parser.add_argument("--rank", type=int, default=32, help="the samplers' LoRA rank (default 32)")
    parser.add_argument("--max-lora-rank", type=int, default=32, help="the vLLM engine's (default 32)")
    parser.add_argument("--samples", type=int, default=8, help="num_samples per call (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens per sample (default 64)")
    parser.add_argument("--calls", type=int, default=6, help="timed calls per child (default 6)")
    parser.add_argument("--reps", type=int, default=2, help="children per sampler, alternating (default 2)")
    parser.add_argument("--threads", type=int, default=TORCH_THREADS, help="torch threads per child")
    parser.add_argument("--device", default="cpu", help="torch device of the resident model and the engine")
    parser.add_argument(
        "--cache-dir", type=Path, default=ROOT / "grpo-data" / "models",
        help="where the builtin models are built once (default grpo-data/models)",
    )
    # Internal: the child-process entry point.
    parser.add_argument("--child", choices=SAMPLERS, help=argparse.SUPPRESS)
    parser.add_argument("--child-samplers", type=int, help=argparse.SUPPRESS)
    for internal in ("--model-dir", "--work", "--record"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    args.model_list = [item.strip() for item in args.models.split(",") if item.strip()]
    unknown = [item for item in args.model_list if item not in MODELS]
    if unknown or not args.model_list:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    args.sampler_list = _int_list(parser, "--samplers", args.samplers)
    for option in ("rank", "samples", "tokens", "calls", "reps", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.rank > args.max_lora_rank:
        parser.error("--rank above --max-lora-rank would sample natively on both sides")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    from worker.grpo.model_paths import resolve_model_path

    results: dict[tuple[str, int], dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-primitives-sampling-") as tmp:
        for model in args.model_list:
            model_dir = Path(resolve_model_path(MODELS[model], args.cache_dir))  # built once, before any child
            for samplers in args.sampler_list:
                records: dict[str, list[dict[str, float]]] = {sampler: [] for sampler in SAMPLERS}
                for rep in range(args.reps):
                    for sampler in SAMPLERS if rep % 2 == 0 else SAMPLERS[::-1]:
                        record = measure(sampler, model_dir, samplers, args, Path(tmp))
                        records[sampler].append(record)
                        print(f"{model} x{samplers} rep {rep + 1} {sampler}: {record['tokens']} tokens in "
                              f"{record['seconds']:.2f} s (build {record['build_s']:.1f} s)", flush=True)
                results[(model, samplers)] = records
    print(f"\n{args.calls} calls of {args.samples} x {args.tokens} tokens (temperature 1, r {args.rank}), "
          f"{args.device}, {args.threads} threads, medians of {args.reps} children per sampler")
    print("\n".join(table_lines(results)))


if __name__ == "__main__":
    main()
