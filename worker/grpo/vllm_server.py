"""Rollouts from a vLLM server in a process of its own (TRL's vllm_mode "server").

The colocated engine (worker.grpo.vllm_rollout) shares the job's process: its decoding competes with the trainer
for the GIL and, on a GPU, for memory. In server mode the job starts vLLM's OpenAI-compatible server as a child
process (`python -m vllm.entrypoints.openai.api_server`), bound to 127.0.0.1 on a free port, and talks to it over
HTTP; it dies with the job (parent-death signal) and is stopped when the run ends.

- Sampling: `/v1/completions` with our own prompt token ids, one request per prompt (each with its seed, as the
  colocated engine seeds each request), `n` = G, the sampled tokens' ids (`return_token_ids`) and their
  processed log-probs (`--logprobs-mode processed_logprobs`: after temperature, as the trainer's).
- Weights: vLLM reloads weights in place from a folder (`reload_weights` through the dev-mode `/collective_rpc`
  endpoint, `VLLM_SERVER_DEV_MODE=1`, which only this child process sees). A push writes the policy's merged
  weights (LoRA merged, as for the colocated engine) as one safetensors file into the engine's folder, atomically,
  and asks the server to reload it and to drop its prefix cache. The folder also holds the config and tokenizer
  the server was started from, and the first weights: vLLM cannot reload into placeholder weights.
- The weight-sync check scores sequences through `prompt_logprobs` (raw logits).

One device per job; the transfer goes through the job's disk, so a push costs writing W once. TRL pushes over
NCCL between GPUs instead, which has no CPU path.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from contract.config import GRPOConfig
from worker.grpo.distributed import Parallel
from worker.grpo.full_weights import policy_weights
from worker.grpo.modeling import ModelBundle
from worker.grpo.vllm_rollout import VLLMRollout
from worker.processes import stop_process

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
WEIGHTS_FILE = "model.safetensors"


class VLLMServerError(RuntimeError):
    """The vLLM server did not start, or answered a request with an error."""


class VLLMServerRollout(VLLMRollout):
    """A `VLLMRollout` whose engine is a vLLM server process; the same methods, over HTTP."""

    def __init__(
        self, models: ModelBundle, config: GRPOConfig, workdir: Path, parallel: Parallel | None = None
    ) -> None:
        if parallel is not None and parallel.ranks.distributed:
            raise ValueError("vllm_mode 'server' runs on one device")
        self.process: subprocess.Popen[bytes] | None = None
        self.client: httpx.Client | None = None
        super().__init__(models, config, workdir, parallel)

    # --- the server ---------------------------------------------------------------------------

    def _build(self, model_dir: Path) -> Any:
        self._model_dir = model_dir
        self._write_weights()  # the server starts from real weights: it cannot reload into placeholder ones
        port = _free_port()
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", self.config.dtype, "--seed", str(self.config.seed % 2**31),
            "--logprobs-mode", "processed_logprobs",
        ]
        length = self._max_model_length()
        if length is not None:
            command += ["--max-model-len", str(length)]
        if self.device.type == "cuda":
            command += ["--gpu-memory-utilization", str(self.config.vllm_gpu_memory_utilization)]
        else:
            command += ["--enforce-eager", "--kv-cache-memory-bytes", str(self._cpu_kv_cache_bytes())]
        # The weight reload endpoint exists only in vLLM's dev mode: set for this child alone, on loopback.
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        log = (model_dir.parent / "server.log").open("wb")
        self.process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=model_dir.parent,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=self.config.vllm_server_timeout)
        self._wait_until_healthy(model_dir.parent / "server.log")
        return self.client

    def _wait_until_healthy(self, log: Path) -> None:
        assert self.process is not None and self.client is not None
        deadline = time.monotonic() + self.config.vllm_server_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VLLMServerError(f"the vLLM server exited with {self.process.returncode}: {_tail(log)}")
            try:
                if self.client.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.close()
        raise VLLMServerError(f"the vLLM server did not answer within {self.config.vllm_server_timeout:.0f} s")

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        assert self.client is not None
        response = self.client.post(path, json=body)
        if response.status_code != 200:
            raise VLLMServerError(f"vLLM server {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None

    # --- sampling and scoring -----------------------------------------------------------------

    def _sample(
        self, requests: list[list[int]], seeds: list[int], *, n: int | None = None, max_tokens: list[int] | None = None
    ) -> list[tuple[list[int], list[float]]]:
        config = self.config
        budgets = max_tokens or [config.max_completion_length] * len(requests)

        def one(ids: list[int], seed: int, budget: int) -> list[tuple[list[int], list[float]]]:
            body = {
                "model": "policy", "prompt": ids, "n": config.num_generations if n is None else n,
                "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k, "max_tokens": budget,
                "stop_token_ids": self.eos_ids, "logprobs": 0, "seed": seed, "return_token_ids": True,
            }
            choices = sorted(self._post("/v1/completions", body)["choices"], key=lambda c: c["index"])
            return [(list(c["token_ids"]), list(c["logprobs"]["token_logprobs"])) for c in choices]

        with ThreadPoolExecutor(max(1, min(32, len(requests)))) as pool:  # the server batches them
            groups = list(pool.map(one, requests, seeds, budgets))
        return [sample for group in groups for sample in group]

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for ids in sequences:
            body = {"model": "policy", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
            positions = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
            out.append([0.0] + [positions[p][str(token)]["logprob"] for p, token in enumerate(ids) if p > 0])
        return out

    # --- weight sync ----------------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Write the policy's merged weights into the engine's folder and have the server reload them."""
        self._write_weights()
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self._model_dir)}})
        # Without this, a prompt longer than one KV block is served from the old weights' cache.
        self._post("/reset_prefix_cache", {})

    def _write_weights(self) -> None:
        # Copies: tied weights share storage, which safetensors refuses to write twice.
        tensors = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in policy_weights(self.models)}
        partial = self._model_dir / f".{WEIGHTS_FILE}.partial"
        save_file(tensors, str(partial))
        os.replace(partial, self._model_dir / WEIGHTS_FILE)  # the server never reads half a file

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.process is not None and self.process.poll() is None:
            stop_process(self.process, grace_s=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the server's process, before exec (Linux): SIGTERM when the job's process dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(log: Path, size: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-size:]
    except OSError:
        return "(no log)"
