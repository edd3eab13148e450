"""Resident memory of many LoRA training clients on one base model (worker.grpo.resident) against one client,
and against K copies of the model with one adapter each.

    .venv/bin/python bench/primitives_memory.py                                  # tiny + SmolLM2, r 8 and 32, K 1, 3
    .venv/bin/python bench/primitives_memory.py --models smollm2 --ranks 32 --clients 1,3,8 --reps 3

The acceptance figure (the primitive API's issue): the resident memory of three tenants' training clients on the
same base model in one worker is at most 1.3x that of one client (the base shared).

Each configuration runs in its own child process, and configurations alternate (A B C, C B A, ...) over
`--reps` repetitions; a figure is the median over repetitions. A child imports torch, transformers, peft and
worker.grpo.resident, reads its RSS (`runtime`), loads the model, adds its clients (LoRA rank r, alpha 32, every
linear layer the primitive API trains by default: q/k/v/o, gate/up/down, lm_head), then runs every client
through `--calls` rounds of forward_backward (`--datums` datums of `--tokens` random tokens, cross_entropy)
and optim_step (AdamW, lr 1e-4), one client after the other as the primitives worker serves them, so that each
client's AdamW state exists. Then, after a gc.collect(): `steady` = VmRSS, `peak` = VmHWM (the high-water mark
of the whole child: imports, loading, every call), from /proc/self/status; then `trimmed` = VmRSS after glibc's
malloc_trim(0), which hands back the freed pages glibc keeps (the activations of the last calls, and holes
between live blocks): the live memory, to explain `steady`. The allocator is set up as `grpo primitives-worker`
sets it (worker.primitives_worker.prepare_process: large freed blocks go back to the kernel), or with
`--allocator glibc` left at glibc's defaults; nothing else trims.

Configurations, per model and rank:
- `shared x1`: one ResidentBase, one client; `shared xK`: one ResidentBase, K clients (what the service runs);
- `separate xK` (the comparator): K ResidentBase instances in one process, one client each, i.e. K copies of the
  base, what a service without a shared base would hold. One process shares the Python runtime and torch's
  libraries between the copies, so it is the cheapest way not to share the base; K worker processes of one
  client each would hold K x the `shared x1` figure (printed too, not run).

Printed per (model, rank, K): RSS of 1 client and of K clients, steady and peak, their ratio K/1 (acceptance:
<= 1.3 at K = 3, both), the same trimmed, what each client past the first adds (against the theory: its
adapter and AdamW's two moments in fp32; gradients are freed by optim_step), and shared xK against the
comparator. Memory only: nothing here is timed, so other work on the machine changes no figure much; glibc's
retention does, by tens of MiB from child to child (bench/README.md has the figures).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from common import TORCH_THREADS  # noqa: E402
from grpo_step import _child_env, _run_child  # noqa: E402

MODELS = {"tiny": "builtin:tiny-instruct", "smollm2": "builtin:smollm2-135m-instruct"}
LAYOUTS = ("shared", "separate")
ACCEPT_CLIENTS, ACCEPT_RATIO = 3, 1.3
LEARNING_RATE = 1e-4
MIB = 1024 * 1024
# What a child reports (MiB unless named otherwise), besides the parent's reading of its rusage.
RECORD_KEYS = (
    "runtime_mib", "loaded_mib", "steady_mib", "peak_mib", "trimmed_mib", "ru_maxrss_mib",
    "base_params", "adapter_params", "first_loss", "last_loss",
)


@dataclass(frozen=True)
class Workload:
    """What every client of a child does: LoRA rank, rounds of forward_backward + optim_step, their data."""

    rank: int
    calls: int = 3
    datums: int = 4
    tokens: int = 128


@dataclass(frozen=True)
class Layout:
    """One configuration: `clients` clients on one base (`shared`) or on a base each (`separate`)."""

    layout: str
    clients: int

    @property
    def name(self) -> str:
        return f"{self.layout} x{self.clients}"

    @property
    def bases(self) -> int:
        return 1 if self.layout == "shared" else self.clients


def layouts_for(clients: Sequence[int]) -> list[Layout]:
    """shared x1, then shared xK and separate xK for every K > 1 (separate x1 is shared x1)."""
    many = [k for k in clients if k > 1]
    return [Layout("shared", 1), *(Layout("shared", k) for k in many), *(Layout("separate", k) for k in many)]


# ==================================================================================================
# Child process: one configuration
# ==================================================================================================


def proc_status() -> dict[str, float]:
    """VmRSS and VmHWM of this process, MiB (Linux: /proc/self/status, in kB)."""
    figures: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            figures[key] = int(value.split()[0]) / 1024
    return figures


def trimmed_rss() -> float:
    """VmRSS after glibc's malloc_trim(0) has handed the free pages of its heaps back to the kernel: live memory
    and mappings, without what the allocator keeps of freed blocks (NaN where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return float("nan")
    return proc_status()["VmRSS"]


def make_data(vocab_size: int, workload: Workload, seed: int) -> list[Any]:
    """`workload.datums` datums of random tokens, each position's target the next token, weight 1."""
    import numpy as np

    from worker.grpo.resident import Datum

    rng = np.random.default_rng(seed)
    data = []
    for _ in range(workload.datums):
        ids = rng.integers(0, vocab_size, size=workload.tokens + 1, dtype=np.int64)
        inputs = {"target_tokens": ids[1:], "weights": np.ones(workload.tokens, dtype=np.float32)}
        data.append(Datum([int(token) for token in ids[:-1]], inputs))
    return data


def run_configuration(model_dir: Path, layout: Layout, workload: Workload) -> dict[str, float]:
    """In this process (a fresh child): load, add the clients, train them; returns the record (RECORD_KEYS less
    the parent's ru_maxrss_mib)."""
    from worker.grpo.resident import AdamSettings, LoraSpec, ResidentBase

    gc.collect()
    runtime = proc_status()["VmRSS"]
    bases = [ResidentBase(model_dir) for _ in range(layout.bases)]
    gc.collect()
    loaded = proc_status()["VmRSS"]
    clients = [(bases[index % layout.bases], f"client-{index}") for index in range(layout.clients)]
    for index, (base, client_id) in enumerate(clients):
        base.add_client(client_id, LoraSpec(rank=workload.rank, seed=index))
    data = [make_data(bases[0].vocab_size, workload, seed) for seed in range(layout.clients)]
    losses: list[float] = []
    for _ in range(workload.calls):  # round-robin, one call at a time, as the primitives worker runs them
        for index, (base, client_id) in enumerate(clients):
            result = base.forward_backward(client_id, data[index], "cross_entropy")
            base.optim_step(client_id, AdamSettings(learning_rate=LEARNING_RATE))
            if index == 0:
                losses.append(result.metrics["loss:sum"])
    gc.collect()
    status = proc_status()
    trimmed = trimmed_rss()  # after the steady reading: the service never trims, this only explains it
    module = bases[0]._module  # the transformers model with the LoRA layers injected
    base_params = sum(p.numel() for name, p in module.named_parameters() if "lora_" not in name)
    adapter_params = sum(p.numel() for p in bases[0]._clients["client-0"].params)
    return {
        "runtime_mib": runtime, "loaded_mib": loaded, "steady_mib": status["VmRSS"], "peak_mib": status["VmHWM"],
        "trimmed_mib": trimmed,
        "base_params": base_params, "adapter_params": adapter_params,
        "first_loss": losses[0], "last_loss": losses[-1],
    }


def child_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from worker.grpo import resident  # noqa: F401  # the runtime: imported before the first reading
    from worker.primitives_worker import prepare_process  # what `grpo primitives-worker` sets up, or not

    if args.allocator == "worker":
        prepare_process()

    layout = Layout(args.layout, args.child_clients)
    workload = Workload(args.rank, args.calls, args.datums, args.tokens)
    record = run_configuration(Path(args.model_dir), layout, workload)
    Path(args.record).write_text(json.dumps(record))


# ==================================================================================================
# Parent: children, alternating, and the table
# ==================================================================================================


def measure(
    model_dir: Path, layout: Layout, workload: Workload, work: Path, *, threads: int = TORCH_THREADS,
    timeout_s: float | None = 3600, allocator: str = "worker",
) -> dict[str, float]:
    """One configuration in a fresh child process; its record (RECORD_KEYS), the child's rusage peak included."""
    record_path = work / f"record-{layout.layout}-{layout.clients}-r{workload.rank}.json"
    command = [
        "--child", "--model-dir", str(model_dir), "--layout", layout.layout,
        "--child-clients", str(layout.clients), "--rank", str(workload.rank), "--calls", str(workload.calls),
        "--datums", str(workload.datums), "--tokens", str(workload.tokens), "--threads", str(threads),
        "--record", str(record_path), "--allocator", allocator,
    ]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = _child_env("passive") | {"PYTHONPATH": pythonpath}
    ru_maxrss_mib = _run_child(command, env, f"{layout.name} r {workload.rank}", __file__, timeout_s)
    record = json.loads(record_path.read_text())
    record_path.unlink()
    return {**record, "ru_maxrss_mib": ru_maxrss_mib}


def median_record(records: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(record[key] for record in records) for key in RECORD_KEYS}


@dataclass(frozen=True)
class Row:
    """One (model, rank, K > 1): medians of shared x1, shared xK and separate xK."""

    model: str
    rank: int
    clients: int
    one: dict[str, float]
    shared: dict[str, float]
    separate: dict[str, float]

    @property
    def steady_ratio(self) -> float:
        return self.shared["steady_mib"] / self.one["steady_mib"]

    @property
    def peak_ratio(self) -> float:
        return self.shared["peak_mib"] / self.one["peak_mib"]

    @property
    def added_ratio(self) -> float:
        """What the model and clients add above the runtime (steady RSS less the RSS after the imports), K / 1."""
        return (self.shared["steady_mib"] - self.shared["runtime_mib"]) / (
            self.one["steady_mib"] - self.one["runtime_mib"]
        )

    @property
    def trimmed_ratio(self) -> float:
        return self.shared["trimmed_mib"] / self.one["trimmed_mib"]

    def per_added_client(self, key: str = "steady_mib") -> float:
        """MiB of RSS (steady, or trimmed) each client past the first adds."""
        return (self.shared[key] - self.one[key]) / (self.clients - 1)

    @property
    def vs_separate(self) -> float:
        return self.shared["steady_mib"] / self.separate["steady_mib"]

    @property
    def vs_processes(self) -> float:
        """Against K worker processes of one client each (K x shared x1, not run)."""
        return self.shared["steady_mib"] / (self.clients * self.one["steady_mib"])

    @property
    def verdict(self) -> str:
        if self.clients != ACCEPT_CLIENTS:
            return ""
        return "ok" if max(self.steady_ratio, self.peak_ratio) <= ACCEPT_RATIO else "MISS"


def rows_for(model: str, rank: int, records: dict[Layout, list[dict[str, float]]]) -> list[Row]:
    medians = {layout: median_record(values) for layout, values in records.items()}
    one = medians[Layout("shared", 1)]
    many = sorted({layout.clients for layout in medians if layout.clients > 1})
    return [
        Row(model, rank, k, one, medians[Layout("shared", k)], medians[Layout("separate", k)]) for k in many
    ]


COLUMNS = (
    "model", "r", "K", "RSS 1", "RSS K", "K/1", "peak 1", "peak K", "peak K/1", "trimmed 1 / K", "trimmed K/1",
    "per added client: RSS / trimmed (theory)", "K bases, 1 process", "shared / K bases", "shared / K processes", "",
)


def table_lines(rows: Sequence[Row]) -> list[str]:
    """The table as Markdown, MiB. Per added client: (RSS K - RSS 1) / (K - 1), steady and trimmed, and in
    parentheses the adapter's weights and AdamW's two moments in fp32 (3 x the adapter)."""
    aligns = ["---" if index < 3 else "---:" for index in range(len(COLUMNS))]
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(aligns) + "|"]
    for row in rows:
        one, shared = row.one, row.shared
        cells = (
            row.model, str(row.rank), str(row.clients),
            f"{one['steady_mib']:.0f}", f"{shared['steady_mib']:.0f}", f"{row.steady_ratio:.2f}",
            f"{one['peak_mib']:.0f}", f"{shared['peak_mib']:.0f}", f"{row.peak_ratio:.2f}",
            f"{one['trimmed_mib']:.0f} / {shared['trimmed_mib']:.0f}", f"{row.trimmed_ratio:.2f}",
            f"{row.per_added_client():.0f} / {row.per_added_client('trimmed_mib'):.0f} "
            f"({3 * one['adapter_params'] * 4 / MIB:.0f})",
            f"{row.separate['steady_mib']:.0f}", f"{row.vs_separate:.2f}",
            f"{row.vs_processes:.2f}", row.verdict,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bench_model(
    model: str, model_dir: Path, args: argparse.Namespace, work: Path
) -> tuple[list[Row], dict[str, Any]]:
    """Every rank of one model: its configurations alternating over the repetitions."""
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for rank in args.rank_list:
        workload = Workload(rank, args.calls, args.datums, args.tokens)
        layouts = layouts_for(args.client_list)
        records: dict[Layout, list[dict[str, float]]] = {layout: [] for layout in layouts}
        for rep in range(args.reps):
            for layout in layouts if rep % 2 == 0 else layouts[::-1]:  # A B C, C B A: drift hits all alike
                record = measure(model_dir, layout, workload, work, threads=args.threads, allocator=args.allocator)
                records[layout].append(record)
                print(
                    f"{model} r {rank} rep {rep + 1} {layout.name}: runtime {record['runtime_mib']:.0f}, "
                    f"loaded {record['loaded_mib']:.0f}, steady {record['steady_mib']:.0f}, "
                    f"peak {record['peak_mib']:.0f}, trimmed {record['trimmed_mib']:.0f} MiB; loss {record['first_loss']:.1f} -> {record['last_loss']:.1f}",
                    flush=True,
                )
        rows += rows_for(model, rank, records)
        raw[f"r{rank}"] = {layout.name: values for layout, values in records.items()}
    return rows, raw


def describe(model: str, record: dict[str, float]) -> str:
    base_mib = record["base_params"] * 4 / MIB
    adapter_mib = record["adapter_params"] * 4 / MIB
    return (
        f"{model}: base {record['base_params'] / 1e6:.2f} M parameters = {base_mib:.1f} MiB fp32; "
        f"one client's adapter at this rank {record['adapter_params'] / 1e6:.3f} M = {adapter_mib:.2f} MiB, "
        f"with AdamW's two moments {3 * adapter_mib:.2f} MiB (gradients are freed by optim_step)"
    )


# ==================================================================================================
# Command line
# ==================================================================================================


def _int_list(parser: argparse.ArgumentParser, option: str, value: str) -> list[int]:
    try:
        numbers = sorted({int(item) for item in value.split(",") if item.strip()})
    except ValueError:
        parser.error(f"{option}: comma-separated positive integers, got {value!r}")
    if not numbers or numbers[0] < 1:
        parser.error(f"{option}: comma-separated positive integers, got {value!r}")
    return numbers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2", help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--ranks", default="8,32", help="comma-separated LoRA ranks (default 8,32)")
    parser.add_argument("--clients", default="1,3", help="comma-separated client counts, 1 among them (e.g. 1,3,8)")
    parser.add_argument("--reps", type=int, default=2, help="children per configuration, alternating (default 2)")
    parser.add_argument("--calls", type=int, default=3, help="forward_backward + optim_step rounds per client")
    parser.add_argument("--datums", type=int, default=4, help="datums per forward_backward (default 4)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per datum (default 128)")
    parser.add_argument("--threads", type=int, default=TORCH_THREADS, help="torch threads per child")
    parser.add_argument(
        "--cache-dir", type=Path, default=ROOT / "grpo-data" / "models",
        help="where the builtin models are built once (default grpo-data/models)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every record to this JSON file")
    parser.add_argument(
        "--allocator", choices=("worker", "glibc"), default="worker",
        help="worker: the allocator policy `grpo primitives-worker` sets (default); glibc: glibc's own",
    )
    # Internal: the child-process entry point.
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-clients", type=int, help=argparse.SUPPRESS)
    for internal in ("--model-dir", "--layout", "--rank", "--record"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.rank = int(args.rank)
        return args
    args.model_list = [item.strip() for item in args.models.split(",") if item.strip()]
    unknown = [item for item in args.model_list if item not in MODELS]
    if unknown or not args.model_list:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    args.rank_list = _int_list(parser, "--ranks", args.ranks)
    args.client_list = _int_list(parser, "--clients", args.clients)
    if args.client_list[0] != 1 or len(args.client_list) < 2:
        parser.error("--clients: needs 1 (the reference) and at least one count above it")
    for option in ("reps", "calls", "datums", "tokens", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    from worker.grpo.model_paths import resolve_model_path

    rows: list[Row] = []
    settings = ("model_list", "rank_list", "client_list", "reps", "calls", "datums", "tokens", "threads")
    payload: dict[str, Any] = {"settings": {name: getattr(args, name) for name in settings}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-primitives-memory-") as tmp:
        for model in args.model_list:
            model_dir = Path(resolve_model_path(MODELS[model], args.cache_dir))  # built once, before any child
            model_rows, raw = bench_model(model, model_dir, args, Path(tmp))
            rows += model_rows
            payload["models"][model] = raw
    print(
        f"\n{args.calls} x (forward_backward of {args.datums} x {args.tokens} tokens, cross_entropy + optim_step) "
        f"per client, {args.threads} threads, medians of {args.reps} children per configuration; MiB"
    )
    for row in rows:
        if row.clients == args.client_list[1]:
            print(describe(f"{row.model} r {row.rank}", row.one))
    print("\n".join(["", *table_lines(rows)]))
    print(
        f"\nK/1: RSS of K clients on one base over 1 client's (acceptance at K = {ACCEPT_CLIENTS}: steady and peak "
        f"<= {ACCEPT_RATIO}); trimmed: RSS after malloc_trim(0), i.e. without the freed memory glibc keeps; "
        "per added client: (RSS K - RSS 1) / (K - 1), theory = adapter + AdamW's two moments, fp32; K bases, "
        "1 process: the comparator (K ResidentBase, one client each); K processes: K x RSS 1 (not run)."
    )
    if args.json:
        payload["rows"] = [
            asdict(row) | {"steady_ratio": row.steady_ratio, "peak_ratio": row.peak_ratio,
                           "added_ratio": row.added_ratio, "trimmed_ratio": row.trimmed_ratio,
                           "per_added_client_mib": row.per_added_client(),
                           "per_added_client_trimmed_mib": row.per_added_client("trimmed_mib"),
                           "vs_separate": row.vs_separate,
                           "vs_processes": row.vs_processes, "verdict": row.verdict}
            for row in rows
        ]
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
