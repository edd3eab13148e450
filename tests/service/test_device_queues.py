"""One queue per kind and device count: a job needing N devices only reaches workers with N or more."""

from __future__ import annotations

import pytest

from contract.spec import JobSpec
from service.jobs.service import queue_for
from service.kit.queue import CeleryJobQueue, parse_queue, queue_name, queues_for_devices


def _spec(base_model: str, devices: int, nodes: int = 1) -> JobSpec:
    return JobSpec.model_validate({
        "base_model": base_model, "train_dataset": "ds_1", "rewards": [{"type": "builtin", "name": "exact_match"}],
        "hyperparameters": {"max_steps": 1, "prompts_per_step": 8}, "resources": {"devices": devices, "nodes": nodes},
    })


class TestQueueNames:
    @pytest.mark.parametrize(("base_model", "devices", "queue"), [
        ("builtin:tiny", 1, "cpu"), ("builtin:tiny", 2, "cpu-2"), ("Qwen/Qwen2.5-0.5B", 1, "gpu"),
        ("Qwen/Qwen2.5-0.5B", 4, "gpu-4"),
    ])
    def test_a_job_goes_to_the_queue_of_its_device_count(self, base_model: str, devices: int, queue: str) -> None:
        assert queue_for(_spec(base_model, devices)) == queue
        assert parse_queue(queue) == (queue.split("-")[0], devices)

    @pytest.mark.parametrize(("devices", "nodes", "queue"), [(2, 2, "gpu"), (8, 2, "gpu-4"), (8, 8, "gpu")])
    def test_a_job_on_several_nodes_goes_to_the_queue_of_its_devices_per_node(
        self, devices: int, nodes: int, queue: str
    ) -> None:
        """One worker per node: each needs the devices of one node, not the job's total."""
        assert queue_for(_spec("Qwen/Qwen2.5-0.5B", devices, nodes)) == queue

    def test_a_worker_serves_every_count_up_to_its_devices(self) -> None:
        assert queues_for_devices(["gpu", "cpu"], 1) == ["gpu", "cpu"]
        assert queues_for_devices(["gpu"], 3) == ["gpu", "gpu-2", "gpu-3"]

    @pytest.mark.parametrize("name", ["gpu-1", "gpu-0", "gpu-x", "tpu", "cpu-2-2", "gpu-", "-2"])
    def test_other_names_are_refused(self, name: str) -> None:
        with pytest.raises(ValueError, match="queue"):
            parse_queue(name)
        with pytest.raises(ValueError, match="queue"):
            CeleryJobQueue("redis://127.0.0.1:1/0").send_job("job_1", queue=name)

    def test_queue_name_bounds(self) -> None:
        assert queue_name("cpu", 1024) == "cpu-1024"
        with pytest.raises(ValueError):
            queue_name("cpu", 0)
