"""One job on 1 or 2 ranks (gloo on CPU, 2 ranks x 1 thread) gives the same weights and metrics.

Each run is `grpo train` (worker.grpo.local) with a checkpoint after every step, so one run shows both
one GRPO step (checkpoint-1) and a few (checkpoint-3). Sampling is included: a group samples the same
tokens whatever rank generates it. Checkpoints resume across rank counts, FSDP's sharded ones too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from contract.spec import JobSpec
from tests.engine.preloaded import Preloaded
from worker.grpo.checkpoint import verify_manifest
from worker.grpo.distributed import SHARDED_DIR, merge_rank_stats
from worker.grpo.local import RANK_MODULE

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # each test launches ranks in child processes
WORDS = ["cat", "dog", "sun", "map", "hat", "pen", "cup", "box"]
TIMING = ("time/", "tokens_per_s")

SPEC: dict[str, Any] = {
    "base_model": "builtin:tiny",
    "train_dataset": "train.jsonl",
    "rewards": [{"type": "builtin", "name": "regex_match", "params": {"pattern": "[aeiou]"}}],
    "hyperparameters": {
        "max_steps": 3, "num_generations": 4, "prompts_per_step": 4, "max_completion_length": 4,
        "learning_rate": 0.003, "lr_scheduler": "constant", "beta": 0.04, "seed": 0,
        "checkpoint_every": 1, "save_total_limit": None,
    },
}


def _spec(devices: int, parallelism: str, lora: bool, **hyper: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(SPEC))
    spec["resources"] = {"devices": devices}
    spec["hyperparameters"].update(parallelism=parallelism, **hyper)
    if lora:
        spec["lora"] = {"r": 4, "alpha": 8}
    return spec


def run_env() -> dict[str, str]:
    """The environment of a `grpo train` child: the repository importable, one OpenMP thread (as the ranks')."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


def grpo_train(
    root: Path, name: str, spec: dict[str, Any], output: Path | None = None, *, module_forward: bool = False,
    python: Preloaded | None = None,
) -> Path:
    """`grpo train` in a child process (the ranks are its children); returns the output directory.
    `module_forward`: one process on the hf backend even where the fused one applies (what fsdp runs on).
    `python`: the child is forked from that server, which imported the engine once for all the runs, instead of
    importing it again in a new interpreter."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{w}: "}) + "\n" for w in WORDS))
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(spec))
    output = output or root / name
    code = (
        "import sys; from pathlib import Path; from worker.grpo.local import run_local; "
        f"sys.exit(run_local(Path({str(config)!r}), Path({str(output)!r})))"
    )
    if module_forward:  # `auto` then finds the fused path does not apply
        code = "import worker.grpo.backends as backends; backends.fused_applies = lambda *_: False; " + code
    if python is None:
        result = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True, text=True,
                                timeout=300)
    else:
        result = python.run(code, env=run_env(), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (output / "grpo-train.log").write_text(result.stdout)
    return output


def weights(checkpoint: Path, lora: bool) -> dict[str, torch.Tensor]:
    """The adapter's tensors, or the model's, from one file or from shards (fsdp's consolidated model)."""
    if lora:
        return load_file(checkpoint / "adapter_model.safetensors")
    index = checkpoint / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(checkpoint / "model.safetensors")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return {name: tensor for file in files for name, tensor in load_file(checkpoint / file).items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def history(checkpoint: Path) -> list[dict[str, float]]:
    return list(torch.load(checkpoint / "trainer_state.pt", weights_only=True)["history"])


def assert_same_metrics(one: list[dict[str, float]], two: list[dict[str, float]]) -> None:
    assert len(one) == len(two)
    for step, (a, b) in enumerate(zip(one, two, strict=True), start=1):
        assert a.keys() == b.keys(), step
        for key in a:
            if not key.startswith(TIMING):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)


class Runs(dict[str, Path]):
    """"single-full", "fsdp-lora"...: each run made the first time a test asks for it, then shared. "hf-full":
    one process on the hf backend, the one fsdp runs on (the tiny model takes the fused one by default)."""

    def __init__(self, root: Path, *, python: Preloaded | None = None, **hyper: Any) -> None:
        super().__init__()
        self.root = root
        self.python = python  # where the runs are forked from (grpo_train), if anywhere
        self.hyper = hyper  # hyperparameters every run sets besides SPEC's (e.g. use_vllm)

    def __missing__(self, name: str) -> Path:
        scheme, kind = name.split("-")
        devices, parallelism = (1, "auto") if scheme in ("single", "hf") else (2, scheme)
        spec = _spec(devices, parallelism, kind == "lora", **self.hyper)
        self[name] = grpo_train(self.root, name, spec, module_forward=scheme == "hf", python=self.python)
        return self[name]


def one_process(parallelism: str) -> str:
    """The one-process run a 2-rank run is compared with: on the same backend (fsdp: hf)."""
    return "hf" if parallelism == "fsdp" else "single"


@pytest.fixture(scope="module")
def engine() -> Iterator[Preloaded]:
    """The engine imported once, in the environment of the runs, for the `grpo train` children forked from it."""
    with Preloaded([RANK_MODULE], run_env()) as python:
        yield python


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, engine: Preloaded) -> Runs:
    return Runs(tmp_path_factory.mktemp("dist"), python=engine)


@pytest.mark.parametrize("kind", ["full", "lora"])
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
class TestSameResultOnTwoRanks:
    def test_one_step_gives_the_same_parameters(self, runs: dict[str, Path], parallelism: str, kind: str) -> None:
        lora = kind == "lora"
        single = weights(runs[f"{one_process(parallelism)}-{kind}"] / "checkpoint-1", lora)
        diff = max_abs_diff(single, weights(runs[f"{parallelism}-{kind}"] / "checkpoint-1", lora))
        print(f"one step, {parallelism} {kind}: max abs difference {diff:.3g}")
        assert diff <= 1e-5
        # Not a vacuous match: the step had a gradient, and both ran it equally (global gradient norm).
        one = history(runs[f"{one_process(parallelism)}-{kind}"] / "checkpoint-1")
        two = history(runs[f"{parallelism}-{kind}"] / "checkpoint-1")
        assert one[0]["grad_norm"] > 0.1
        assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)

    def test_a_few_steps_give_the_same_weights_and_metrics(
        self, runs: dict[str, Path], parallelism: str, kind: str
    ) -> None:
        lora = kind == "lora"
        one = runs[f"{one_process(parallelism)}-{kind}"] / "checkpoint-3"
        two = runs[f"{parallelism}-{kind}"] / "checkpoint-3"
        diff = max_abs_diff(weights(one, lora), weights(two, lora))
        print(f"three steps, {parallelism} {kind}: max abs difference {diff:.3g}")
        assert diff <= 1e-4
        # Gradient norms, losses, rewards, KL...: what one process reports for the global batch.
        assert_same_metrics(history(one), history(two))


class TestCheckpoints:
    def test_fsdp_checkpoint_holds_shards_and_consolidated_weights(self, runs: dict[str, Path]) -> None:
        checkpoint = runs["fsdp-full"] / "checkpoint-3"
        verify_manifest(checkpoint)
        shards = sorted(p.name for p in (checkpoint / SHARDED_DIR).iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
        assert state["optimizer"] is None  # sharded: in distributed/
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        saved = weights(checkpoint, lora=False)
        assert torch.equal(model.lm_head.weight.detach(), saved["lm_head.weight"])

    def test_lora_fsdp_checkpoint_has_the_merged_model(self, runs: dict[str, Path]) -> None:
        """Written from the shards a layer at a time: the merged model one process writes, in shards."""
        merged = runs["fsdp-lora"] / "checkpoint-3" / "merged"
        index = json.loads((merged / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 5  # 4 decoder layers and the rest
        one = weights(runs["hf-lora"] / "checkpoint-3" / "merged", lora=False)
        diff = max_abs_diff(one, weights(merged, lora=False))
        assert diff <= 1e-4
        assert max_abs_diff(one, weights(runs["hf-lora"] / "checkpoint-1" / "merged", lora=False)) > 1e-3

    @pytest.mark.parametrize(
        ("written_by", "resumed_on", "parallelism"),
        [("fsdp-full", 1, "auto"), ("single-full", 2, "fsdp"), ("ddp-full", 2, "fsdp"), ("fsdp-full", 2, "ddp")],
    )
    def test_resume_on_another_rank_count(
        self, runs: dict[str, Path], engine: Preloaded, tmp_path: Path, written_by: str, resumed_on: int,
        parallelism: str,
    ) -> None:
        """Stopped after step 2, resumed elsewhere for step 3: the same as never stopping."""
        output = tmp_path / "resumed"
        shutil.copytree(runs[written_by], output)
        shutil.rmtree(output / "checkpoint-3")
        grpo_train(tmp_path, "resume", _spec(resumed_on, parallelism, False), output, python=engine)
        diff = max_abs_diff(weights(runs["single-full"] / "checkpoint-3", False), weights(output / "checkpoint-3", False))
        print(f"{written_by} checkpoint-2 resumed on {resumed_on} rank(s) ({parallelism}): max abs difference {diff:.3g}")
        assert diff <= 1e-4
        assert_same_metrics(history(runs["single-full"] / "checkpoint-3"), history(output / "checkpoint-3"))


def test_fsdp_takes_the_module_forward_where_ddp_takes_the_fused_backend(runs: Runs) -> None:
    """The Llama-family tiny model takes the fused backend, which reads every layer's weights at once: ddp
    averages its gradients by hand; fsdp shards through the module forward instead, a unit per decoder layer (4)
    and the root, since the fused path would gather the whole policy as one unit."""
    assert "5 FSDP units" in (runs["fsdp-full"] / "grpo-train.log").read_text()
    assert "averaged after each update" in (runs["ddp-full"] / "grpo-train.log").read_text()


def grpo_train_on_two_nodes(root: Path, name: str, spec: dict[str, Any], output: Path | None = None) -> Path:
    """The ranks of `grpo train` as two "nodes" on loopback: two launchers of one rank each, meeting in the
    store the first serves, as two workers' launchers do (worker.nodes)."""
    from tests.worker.procs import free_port
    from worker.grpo.launch import launch_command

    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{w}: "}) + "\n" for w in WORDS))
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(spec))
    output = output or root / name
    endpoint = f"127.0.0.1:{free_port()}"
    env = run_env()
    launchers = [
        subprocess.Popen(
            launch_command(RANK_MODULE, [str(config), str(output)], nproc_per_node=1, nnodes=2,
                           node_rank=node, store=endpoint, run_id=f"{name:0>32}", join_timeout_s=120),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    assert all(launcher.returncode == 0 for launcher in launchers), "\n".join(o[-3000:] for o in outputs)
    return output


class TestTwoNodes:
    """Ranks on different nodes share no filesystem: an fsdp checkpoint then gathers the optimiser state into
    trainer_state.pt instead of keeping each rank's shards, and still resumes exactly anywhere."""

    @pytest.fixture(scope="class")
    def two_nodes(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return grpo_train_on_two_nodes(tmp_path_factory.mktemp("nodes"), "nodes", _spec(2, "fsdp", False))

    def test_same_weights_and_metrics_as_one_process(self, runs: dict[str, Path], two_nodes: Path) -> None:
        one, two = runs["single-full"] / "checkpoint-3", two_nodes / "checkpoint-3"
        diff = max_abs_diff(weights(one, False), weights(two, False))
        print(f"three steps, fsdp on two nodes: max abs difference {diff:.3g}")
        assert diff <= 1e-4
        assert_same_metrics(history(one), history(two))

    def test_checkpoint_holds_the_whole_optimiser_state(self, runs: dict[str, Path], two_nodes: Path) -> None:
        checkpoint = two_nodes / "checkpoint-3"
        verify_manifest(checkpoint)
        assert not (checkpoint / SHARDED_DIR).exists()
        gathered = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["optimizer"]
        single = torch.load(runs["ddp-full"] / "checkpoint-3" / "trainer_state.pt", weights_only=True)["optimizer"]
        assert gathered["param_groups"][0]["params"] == single["param_groups"][0]["params"]
        for index, moments in single["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(gathered["state"][index][key], moments[key], atol=1e-6), (index, key)

    @pytest.mark.parametrize(("resumed_on", "parallelism"), [(1, "auto"), (2, "fsdp")])
    def test_resumes_on_one_node(
        self, runs: dict[str, Path], engine: Preloaded, two_nodes: Path, tmp_path: Path, resumed_on: int,
        parallelism: str,
    ) -> None:
        output = tmp_path / "resumed"
        shutil.copytree(two_nodes, output)
        shutil.rmtree(output / "checkpoint-3")
        grpo_train(tmp_path, "resume", _spec(resumed_on, parallelism, False), output, python=engine)
        diff = max_abs_diff(weights(runs["single-full"] / "checkpoint-3", False), weights(output / "checkpoint-3", False))
        print(f"two-node checkpoint-2 resumed on {resumed_on} rank(s) ({parallelism}): max abs difference {diff:.3g}")
        assert diff <= 1e-4


class TestSpec:
    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"resources": {"devices": 3}}, "prompts_per_step (4) must be a multiple of resources.devices (3)"),
            ({"resources": {"devices": 4, "nodes": 3}}, "devices (4) must be a multiple of nodes (3)"),
            ({"resources": {"devices": 0}}, "resources.devices"),
            ({"resources": {"devices": 2, "gpus": 2}}, "resources.gpus"),
            ({"resources": {"devices": 2}, "hyperparameters": {"mini_batch_size": 1}},
             "mini_batch_size (1) must be a multiple of resources.devices"),
            ({"resources": {"devices": 2}, "hyperparameters": {"dynamic_sampling": True}},
             "dynamic_sampling is not supported"),
            ({"hyperparameters": {"parallelism": "zero3"}}, "hyperparameters.parallelism"),
        ],
    )
    def test_bad_resources_are_refused_naming_the_field(self, change: dict[str, Any], message: str) -> None:
        from pydantic import ValidationError

        spec = json.loads(json.dumps(SPEC))
        spec["resources"] = change.get("resources", {})
        spec["hyperparameters"].update(change.get("hyperparameters", {}))
        with pytest.raises(ValidationError) as caught:
            JobSpec.model_validate(spec)
        assert message in str(caught.value)

    def test_parallelism_defaults_by_fine_tuning_kind(self) -> None:
        assert JobSpec.model_validate(_spec(2, "auto", False)).hyperparameters.resolved_parallelism() == "fsdp"
        assert JobSpec.model_validate(_spec(2, "auto", True)).hyperparameters.resolved_parallelism() == "ddp"
        assert JobSpec.model_validate(SPEC).resources.devices == 1


class TestMergeStats:
    def test_token_means_weight_by_tokens_and_extremes_take_the_extreme(self) -> None:
        parts = [({"kl": 1.0, "clip_ratio/low_min": 0.2, "loss": 1.0}, 30.0),
                 ({"kl": 3.0, "clip_ratio/low_min": 0.1, "loss": 3.0}, 10.0)]
        assert merge_rank_stats(parts) == {"kl": 1.5, "clip_ratio/low_min": 0.1, "loss": 2.0}


def test_the_launcher_binds_collectives_to_the_interface_of_the_node_address() -> None:
    from worker.grpo.launch import World, interface_of, rank_environment

    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(ValueError, match="no network interface"):
        interface_of("192.0.2.1")  # TEST-NET-1: held by no interface here; nothing connects to it
    env = rank_environment(World("127.0.0.1", "127.0.0.1", 40000, "r" * 32, 2, 2, 1), 1, 40000, {})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]) == ("3", "4", "1", "1")
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
