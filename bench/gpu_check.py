"""GPU check: the CUDA tests, then one GRPO step ours vs TRL on a Qwen2.5-0.5B-shaped model in bfloat16.

    bash bench/gpu_check.sh              # on a machine with one NVIDIA GPU (bench/README.md, "GPU check")
    bash bench/gpu_check.sh --dry-run    # the same code paths on the CPU with tiny shapes (CI runs it)

Sized for a 15-minute device lease: it stops starting new runs after --budget-s (default 420 s) and prints:

1. the CUDA tests' result: every test that skips without a CUDA device (a `skipif` whose reason names CUDA
   or a `cuda` marker), from the test files that ask `torch.cuda.is_available()`;
   on a GPU all must pass, none may skip;
2. per case (full fine-tune, LoRA r=16 on all linear layers): the step time ours/TRL (1.16), each
   framework in child processes alternating as in bench/grpo_step.py (whose child runners this reuses);
3. generated tokens/s and peak GPU memory (`torch.cuda.max_memory_allocated` of the child) of each;
4. the training phase's achieved FLOP/s (the step less its generation, counted by bench/flops.py) over the
   card's dense bf16 peak, looked up by the device's name (printed with the figure used), and over a
   bf16 8192^3 matmul measured on the card in the same run.

The model: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads of 64, MLP 4864, q/k/v biases,
tied embeddings, 151,936-token vocabulary: the 32k tokenizer of bench/models.py widened with tokens no text
encodes to), random weights saved in bfloat16; both frameworks load bfloat16 weights (TRL: `bf16=True` and
`model_init_kwargs={"dtype": "bfloat16"}`; ours: `dtype="bfloat16"`). The workload is the CPU table's
(4 prompts x 8 completions, beta 0.04, loss dapo, no gradient checkpointing) with 128 new tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from common import COMPLETIONS_PER_STEP, NUM_GENERATIONS, PROMPTS_PER_STEP, RunRecord, summarise  # noqa: E402
from cuda_tests import run_cuda_tests  # noqa: E402
from flops import ModelDims  # noqa: E402
from grpo_step import (  # noqa: E402
    BETA,
    FRAMEWORKS,
    LORA_RANK,
    LOSS_TYPE,
    CaseResult,
    Runtime,
    _child_env,
    _run_child,
    run_ours,
    run_trl,
)
from models import Shape  # noqa: E402

# Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B): 494 M parameters, 136 M of them the tied embedding.
QWEN25_05B = Shape(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
)
QWEN25_VOCAB = 151_936
# --dry-run: the same proportions' features (GQA, biases, tied embeddings, a widened vocabulary), tiny.
DRY_SHAPE = Shape(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
DRY_VOCAB = 512

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, by a part of torch's device name; the
# first match wins. torch names the H100 SXM "NVIDIA H100 80GB HBM3", the PCIe card "NVIDIA H100 PCIe".
BF16_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756e12, "H100 PCIe"),
    ("H100 NVL", 835e12, "H100 NVL"),
    ("H100", 989e12, "H100 SXM"),
    ("H200", 989e12, "H200 (the H100 SXM's chip)"),
    ("H800", 989e12, "H800 SXM"),
    ("A100", 312e12, "A100"),
    ("L40S", 362e12, "L40S"),
    ("B200", 2250e12, "B200"),
)

LINE = "gpu check:"  # prefix of the header and closing lines


def bf16_peak(device_name: str) -> tuple[float, str] | None:
    """(FLOP/s, which card's datasheet) for a CUDA device name, or None for a card not in the table."""
    for part, flops, label in BF16_PEAKS:
        if part.lower() in device_name.lower():
            return flops, label
    return None


# ==================================================================================================
# What is measured
# ==================================================================================================


@dataclass(frozen=True)
class GpuCase:
    """One row: the model, fully fine-tuned or with LoRA. Has what grpo_step's runners and CaseResult
    read of a case (`lora`, `name`, `target`)."""

    lora: bool
    target: float = 1.0  # never slower than TRL (the bound for what only the hf backend serves)

    @property
    def name(self) -> str:
        return "lora" if self.lora else "full"


CASES = (GpuCase(lora=False), GpuCase(lora=True))


@dataclass(frozen=True)
class Plan:
    """Everything a run depends on (what --dry-run changes)."""

    dry_run: bool
    steps: int
    reps: int
    completion_length: int

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def shape(self) -> Shape:
        return DRY_SHAPE if self.dry_run else QWEN25_05B

    @property
    def vocab_size(self) -> int:
        return DRY_VOCAB if self.dry_run else QWEN25_VOCAB

    @property
    def runtime(self) -> Runtime:
        return Runtime(device=self.device, bf16=True, max_completion_length=self.completion_length)


def build_check_model(plan: Plan, work: Path, cache_dir: Path) -> Path:
    """The Qwen2-architecture model at the plan's shape, bfloat16, tied embeddings, widened vocabulary."""
    from models import build_model, hf_tokenizer, widen_vocabulary

    base = hf_tokenizer("small" if plan.dry_run else "32k", cache_dir)
    return build_model(
        "qwen2",
        "small" if plan.dry_run else "32k",
        work / "models" / ("dry-qwen2" if plan.dry_run else "qwen2.5-0.5b-shaped"),
        cache_dir=cache_dir,
        shape=plan.shape,
        tokenizer=widen_vocabulary(base, plan.vocab_size),
        overrides={"tie_word_embeddings": True, "rms_norm_eps": 1e-6},
        dtype="bfloat16",
    )


# ==================================================================================================
# Child processes: the card and its peak, the CUDA tests, one framework's run
# ==================================================================================================


def child_info(record: Path) -> None:
    """The device, the versions, and the measured matmul peak (bf16 on a GPU, float32 on the CPU)."""
    import torch
    from flops import cuda_matmul_peak_flops, matmul_peak_flops
    from grpo_step import TORCH_THREADS

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "peft", "accelerate", "trl", "datasets", "pydantic"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - reported as missing
            versions[package] = "missing"
    info: dict[str, Any] = {"versions": versions, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info |= {
            "device": props.name,
            "cuda_version": torch.version.cuda,
            "memory_gib": props.total_memory / 2**30,
            "sms": props.multi_processor_count,
            "measured_peak": cuda_matmul_peak_flops(),
            "measured_what": "bf16 8192^3 matmul",
        }
    else:
        info |= {
            "device": f"cpu ({platform.processor() or platform.machine()})",
            "measured_peak": matmul_peak_flops(threads=TORCH_THREADS, sizes=(256, 512)),
            "measured_what": f"float32 matmul on {TORCH_THREADS} threads",
        }
    record.write_text(json.dumps(info))


def child_run(args: argparse.Namespace) -> None:
    """One framework's run of one case; the record gets the child's peak GPU memory."""
    import torch
    from grpo_step import _limit_threads

    from worker.grpo.allocator import keep_freed_memory

    _limit_threads()
    keep_freed_memory()  # as grpo_step's children: both frameworks get the engine's malloc settings
    plan = Plan(args.dry_run, args.steps, 1, args.completion_length)
    case = GpuCase(lora=args.case == "lora")
    record = RunRecord(framework=args.child, case=case.name)
    runner = run_trl if args.child == "trl" else run_ours
    runner(case, Path(args.model_dir), Path(args.data), args.steps, record, Path(args.work), plan.runtime)  # type: ignore[arg-type]
    if len(record.step_s) != args.steps or len(record.generate_s) != args.steps:
        raise RuntimeError(f"{args.child}: recorded {len(record.step_s)} step times for {args.steps} steps")
    peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
    Path(args.record).write_text(json.dumps(asdict(record) | {"peak_gpu_mib": peak_gpu}))


# ==================================================================================================
# Parent
# ==================================================================================================


def spawn_child(
    framework: str, case: GpuCase, plan: Plan, paths: dict[str, Path], timeout_s: float
) -> tuple[RunRecord, float]:
    """One framework's run in a child process: its record and its peak GPU memory in MiB."""
    record_path = paths["work"] / f"{framework}-{case.name}.json"
    command = [
        "--child", framework, "--case", case.name, "--model-dir", str(paths["model"]),
        "--data", str(paths["data"]), "--work", str(paths["work"]), "--record", str(record_path),
        "--steps", str(plan.steps), "--completion-length", str(plan.completion_length),
    ]  # fmt: skip
    if plan.dry_run:
        command.append("--dry-run")
    env = _child_env("passive") | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    rss = _run_child(command, env, f"{framework} {case.name}", script=__file__, timeout_s=timeout_s)
    payload = json.loads(record_path.read_text())
    peak_gpu = float(payload.pop("peak_gpu_mib"))
    record = RunRecord(**payload)
    record.peak_rss_mib = rss
    return record, peak_gpu


def _info(work: Path, timeout_s: float) -> dict[str, Any]:
    path = work / "info.json"
    _run_child(["--child", "info", "--record", str(path)], _child_env("passive"), "device info", __file__, timeout_s)
    info: dict[str, Any] = json.loads(path.read_text())
    return info


def _fmt_rate(flops_per_s: float) -> str:
    return "n/a" if not math.isfinite(flops_per_s) else f"{flops_per_s / 1e12:.3g}"


def _fmt(value: float, spec: str) -> str:
    return "n/a" if not math.isfinite(value) else format(value, spec)


TABLE_COLUMNS = (
    "case", "TRL step s", "ours step s", "ours/TRL",
    "gen tok/s TRL", "gen tok/s ours",
    "peak GPU MiB TRL", "peak GPU MiB ours",
    "train TFLOP/s TRL", "train TFLOP/s ours",
    "train/bf16 peak TRL", "train/bf16 peak ours",
    "train/matmul TRL", "train/matmul ours",
)  # fmt: skip


def table(results: list[dict[str, Any]]) -> list[str]:
    """The figures as a Markdown table (ready for bench/README.md); "-" where TRL did not run."""

    def cell(row: dict[str, Any], framework: str, key: str, spec: str) -> str:
        if framework not in row:
            return "-"
        value = row[framework][key]
        return _fmt_rate(value) if spec == "TFLOP/s" else _fmt(value, spec)

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---" + "|---:" * (len(TABLE_COLUMNS) - 1) + "|"]
    for row in results:
        ratio = f"{row['ours']['step_s'] / row['trl']['step_s']:.2f}" if "trl" in row else "-"
        cells = [row["case"], cell(row, "trl", "step_s", ".3f"), cell(row, "ours", "step_s", ".3f"), ratio]
        for key, spec in (
            ("gen_tokens_per_s", ".0f"),
            ("peak_gpu_mib", ".0f"),
            ("train_flops_per_s", "TFLOP/s"),
            ("train_peak_share", ".3f"),
            ("train_matmul_share", ".3f"),
        ):
            cells += [cell(row, "trl", key, spec), cell(row, "ours", key, spec)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, 2 steps, 8 new tokens")
    parser.add_argument("--steps", type=int, help="optimiser steps per run, step 1 excluded (default 4; dry 2)")
    parser.add_argument("--reps", type=int, default=1, help="runs per framework and case, alternating (default 1)")
    parser.add_argument("--completion-length", type=int, help="new tokens per completion (default 128; dry 8)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no run after this (default 420)")
    parser.add_argument("--skip-tests", action="store_true", help="leave the CUDA tests out")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument("--workdir", type=Path, help="models and scratch files (default: a temp dir)")
    parser.add_argument("--child", choices=(*FRAMEWORKS, "info"), help=argparse.SUPPRESS)
    for internal in ("--case", "--model-dir", "--data", "--work", "--record"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.dry_run else 4)
    args.completion_length = args.completion_length or (8 if args.dry_run else 128)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is excluded as warm-up)")
    if args.child == "info":
        child_info(Path(args.record))
        return 0
    if args.child:
        child_run(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        return check(Plan(args.dry_run, args.steps, args.reps, args.completion_length), args, work)


@dataclass
class Setup:
    """What every case of a run shares."""

    plan: Plan
    work: Path
    model_dir: Path
    data: Path
    dims: ModelDims
    prompt_tokens: float  # mean prompt length in tokens, BOS included
    frameworks: list[str]
    bf16_peak: tuple[float, str] | None
    measured_peak: float
    started: float
    budget_s: float

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)


def print_device(info: dict[str, Any], plan: Plan) -> tuple[float, str] | None:
    """The header lines; returns the datasheet peak used (None on the CPU or an unknown card)."""
    versions = ", ".join(f"{name} {value}" for name, value in info["versions"].items())
    mode = "dry run on the CPU, tiny shapes" if plan.dry_run else "CUDA"
    print(f"{LINE} {info['device']} ({mode}); {versions}", flush=True)
    peak = bf16_peak(info["device"]) if info["cuda"] else None
    if peak:
        print(f"bf16 peak: {peak[0] / 1e12:.0f} TFLOP/s ({peak[1]} datasheet, dense, matched in the device name)")
    else:
        print(f"bf16 peak: none known for {info['device']}: shares of the measured matmul only")
    print(f"measured peak: {info['measured_peak'] / 1e12:.3g} TFLOP/s ({info['measured_what']})", flush=True)
    return peak


def prepare_model(plan: Plan, work: Path) -> tuple[Path, Path, ModelDims, float]:
    """Builds the model and the prompts; prints what they are. (model dir, prompts, dims, prompt tokens)"""
    from common import read_prompts, write_prompts
    from models import default_cache_dir
    from transformers import AutoConfig, AutoTokenizer

    model_dir = build_check_model(plan, work, default_cache_dir())
    config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.of(config)
    embeddings = dims.vocab * dims.hidden * (1 if config.tie_word_embeddings else 2)
    print(
        f"model: qwen2, hidden {dims.hidden}, {dims.layers} layers, {dims.heads}/{dims.kv_heads} heads of "
        f"{dims.head_dim}, MLP {dims.intermediate}, vocabulary {dims.vocab}, tied {config.tie_word_embeddings}, "
        f"{(dims.body_weights + embeddings) / 1e6:.1f} M matmul and embedding weights, bfloat16, random"
    )
    data = write_prompts(work / "prompts.jsonl", max(64, PROMPTS_PER_STEP * plan.steps))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenizer([row["prompt"] for row in read_prompts(data)])["input_ids"]
    print(
        f"workload: {PROMPTS_PER_STEP} prompts x {NUM_GENERATIONS} completions, {plan.completion_length} new "
        f"tokens, beta {BETA}, loss {LOSS_TYPE}, LoRA r={LORA_RANK} all-linear, {plan.steps} steps "
        f"(step 1 excluded) x {plan.reps} reps, frameworks alternating",
        flush=True,
    )
    return model_dir, data, dims, statistics.fmean(len(ids) for ids in encoded)


def run_case(case: GpuCase, setup: Setup, first: int, failures: list[str]) -> dict[str, Any] | None:
    """Both frameworks' runs of a case (alternating, starting with FRAMEWORKS[first % 2]): the table's row."""
    plan = setup.plan
    paths = {"work": setup.work, "model": setup.model_dir, "data": setup.data}
    records: dict[str, list[RunRecord]] = {fw: [] for fw in setup.frameworks}
    gpu_peaks: dict[str, float] = dict.fromkeys(setup.frameworks, math.nan)  # NaN on the CPU
    for rep in range(plan.reps):
        order = setup.frameworks if (first + rep) % 2 == 0 else setup.frameworks[::-1]  # A B, B A, ...
        for framework in order:
            what = f"{case.name} rep {rep + 1} {framework:4s}"
            if setup.left() <= 0:
                print(f"{what}: not started, over the {setup.budget_s:.0f} s budget", flush=True)
                failures.append(f"{case.name} {framework} not run")
                continue
            try:
                record, peak_gpu = spawn_child(framework, case, plan, paths, timeout_s=max(30.0, setup.left() + 60))
            except RuntimeError as error:
                print(f"{what}: FAILED\n{str(error)[-3000:]}", flush=True)
                failures.append(f"{case.name} {framework}")
                continue
            records[framework].append(record)
            gpu_peaks[framework] = max(peak_gpu, gpu_peaks[framework]) if rep else peak_gpu
            print(
                f"{what}: median step {statistics.median(record.step_s[1:]):.3f} s, peak GPU "
                f"{_fmt(peak_gpu, '.0f')} MiB, RSS {record.peak_rss_mib:.0f} MiB, setup {record.setup_s:.1f} s",
                flush=True,
            )
    if not records["ours"]:
        return None
    row: dict[str, Any] = {"case": case.name}
    for framework, framework_records in records.items():
        if not framework_records:
            continue
        summary = summarise(framework_records)
        # grpo_step's count of the step's training-phase FLOPs (at this framework's completion lengths).
        count = CaseResult(case, summary, summary, setup.dims, setup.prompt_tokens).train_flops(summary)  # type: ignore[arg-type]
        train_rate = count / summary.median_train_s
        row[framework] = {
            "step_s": summary.median_step_s,
            "train_s": summary.median_train_s,
            "gen_tokens_per_s": summary.generate_tokens_per_s,
            "completion_tokens": summary.completion_tokens / COMPLETIONS_PER_STEP,
            "peak_gpu_mib": gpu_peaks[framework],
            "peak_rss_mib": summary.peak_rss_mib,
            "train_flops_per_s": train_rate,
            "train_peak_share": train_rate / setup.bf16_peak[0] if setup.bf16_peak else math.nan,
            "train_matmul_share": train_rate / setup.measured_peak,
        }
    return row


def check(plan: Plan, args: argparse.Namespace, work: Path) -> int:
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained's shard bar
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    failures: list[str] = []
    info = _info(work, timeout_s=120)
    peak = print_device(info, plan)
    if not plan.dry_run and not info["cuda"]:
        print(f"{LINE} no CUDA device: run with --dry-run here [FAIL]")
        return 1

    if args.skip_tests:
        print("cuda tests: left out (--skip-tests)")
    else:
        left = args.budget_s - (time.perf_counter() - started)
        line, ok = run_cuda_tests(work, timeout_s=max(60.0, min(240.0, left - 60)))
        print(line, flush=True)
        if not ok and not plan.dry_run:
            failures.append("cuda tests")

    has_trl = importlib.util.find_spec("trl") is not None
    if not has_trl:
        print("trl: not installed (the `bench` extra, or .gpu-wheels on the device machine): TRL's side left out")
        if not plan.dry_run:
            failures.append("trl missing")
    model_dir, data, dims, prompt_tokens = prepare_model(plan, work)
    setup = Setup(
        plan, work, model_dir, data, dims, prompt_tokens,
        frameworks=[fw for fw in FRAMEWORKS if has_trl or fw == "ours"],
        bf16_peak=peak, measured_peak=info["measured_peak"], started=started, budget_s=args.budget_s,
    )  # fmt: skip
    results = [row for i, case in enumerate(CASES) if (row := run_case(case, setup, i, failures))]

    print()
    for text in table(results):
        print(text)
    for row in results:
        if "trl" in row:
            o, t = row["ours"], row["trl"]
            print(
                f"result {row['case']}: ours/TRL step time {o['step_s'] / t['step_s']:.2f}, "
                f"generated tokens/s ours/TRL {o['gen_tokens_per_s'] / t['gen_tokens_per_s']:.2f}, "
                f"peak GPU memory ours/TRL {_fmt(o['peak_gpu_mib'] / t['peak_gpu_mib'], '.2f')}"
            )
    if args.json:
        payload = {"plan": asdict(plan), "info": info, "bf16_peak": peak, "results": results, "failures": failures}
        args.json.write_text(json.dumps(payload, indent=2))
    verdict = f"FAIL ({'; '.join(failures)})" if failures else "ok"
    print(f"{LINE} done in {time.perf_counter() - started:.0f} s [{verdict}]", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
