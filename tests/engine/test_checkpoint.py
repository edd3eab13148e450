"""Checkpoint save/load: atomic directories, manifests that catch corruption, pruning, RNG round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.config import GRPOConfig, LoraConfig
from worker.grpo.checkpoint import (
    MANIFEST_NAME,
    STATE_NAME,
    CheckpointCorrupt,
    capture_rng_state,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_manifest,
)
from worker.grpo.tiny import build_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def model_and_tokenizer(tiny_path: Path) -> tuple[Any, Any]:
    return AutoModelForCausalLM.from_pretrained(tiny_path), AutoTokenizer.from_pretrained(tiny_path)


def _save(
    output_dir: Path, step: int, model: Any, tokenizer: Any, **kwargs: Any
) -> tuple[Path, dict[str, Any]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"optimizer": optimizer.state_dict(), "rng": capture_rng_state(), "sampler": {"epoch": 1}}
    return save_checkpoint(
        output_dir,
        step=step,
        model=model,
        tokenizer=tokenizer,
        config=GRPOConfig.model_validate({"max_steps": 10}),
        trainer_state=state,
        **kwargs,
    )


class TestSave:
    def test_layout_and_manifest_cover_every_file(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        path, manifest = _save(tmp_path, 3, *model_and_tokenizer)
        assert path == tmp_path / "checkpoint-3"
        files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST_NAME}
        assert set(manifest["files"]) == files
        assert {"model.safetensors", "config.json", "tokenizer.json", STATE_NAME, "grpo_config.json"} <= files
        for name, entry in manifest["files"].items():
            assert entry["size"] == (path / name).stat().st_size
        assert json.loads((path / MANIFEST_NAME).read_text()) == manifest
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]  # no temporary directory left

    def test_saved_weights_load_back_identically(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        model, tokenizer = model_and_tokenizer
        path, _ = _save(tmp_path, 1, model, tokenizer)
        reloaded = AutoModelForCausalLM.from_pretrained(path)
        for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
            assert torch.equal(a, b), name

    def test_lora_saves_only_the_adapter(self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        model, tokenizer = model_and_tokenizer
        lora = LoraConfig.model_validate({"r": 4, "alpha": 8})
        peft_model = get_peft_model(
            model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules="all-linear")
        )
        path, manifest = _save(tmp_path, 1, peft_model, tokenizer)
        assert "adapter_model.safetensors" in manifest["files"]
        assert "model.safetensors" not in manifest["files"]
        assert "merged/model.safetensors" in manifest["files"]

    def test_lora_adapter_and_merged_weights_load_and_generate_alike(
        self, tmp_path: Path, tiny_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        """The adapter loads onto the base with PeftModel.from_pretrained, the merged weights with
        AutoModelForCausalLM.from_pretrained; both compute the trained model and decode the same tokens."""
        from peft import LoraConfig as PeftLoraConfig
        from peft import PeftModel, get_peft_model

        model, tokenizer = model_and_tokenizer
        torch.manual_seed(0)
        # Projections and the embedding: every adapted weight must reach the merged model.
        peft_model = get_peft_model(
            model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "embed_tokens"])
        )
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_B" in name or "lora_embedding" in name:
                    parameter.normal_(0, 0.2)  # a trained adapter: B (and the embedding's A) no longer zero
        path, _ = _save(tmp_path, 1, peft_model, tokenizer)
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), path).eval()
        merged = AutoModelForCausalLM.from_pretrained(path / "merged").eval()
        base = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
        prompt = AutoTokenizer.from_pretrained(path / "merged")("the cat sat", return_tensors="pt")
        with torch.no_grad():
            expected = peft_model.eval()(**prompt).logits
            assert torch.allclose(adapter(**prompt).logits, expected, atol=1e-5)
            assert torch.allclose(merged(**prompt).logits, expected, atol=1e-4)
            assert not torch.allclose(base(**prompt).logits, expected, atol=1e-2)  # the adapter matters

            def greedy(lm: Any) -> torch.Tensor:
                out = lm.generate(**prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)
                return out[:, prompt["input_ids"].shape[1] :]

            tokens = greedy(adapter)
            assert tokens.shape[1] > 0
            assert torch.equal(greedy(merged), tokens)

    def test_failed_save_leaves_nothing_visible(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        model, _ = model_and_tokenizer

        class BrokenTokenizer:
            def save_pretrained(self, directory: Path) -> None:
                (Path(directory) / "half.json").write_text("{")
                raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            _save(tmp_path, 1, model, BrokenTokenizer())
        assert list(tmp_path.iterdir()) == []

    def test_prunes_to_save_total_limit(self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]) -> None:
        for step in (2, 4, 6, 10):
            _save(tmp_path, step, *model_and_tokenizer, save_total_limit=2)
        assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-10"]

    def test_saving_the_same_step_again_replaces_it(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        _save(tmp_path, 5, *model_and_tokenizer)
        path, _ = _save(tmp_path, 5, *model_and_tokenizer)
        verify_manifest(path)
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]


class TestLoadAndVerify:
    def test_round_trip_of_trainer_state(self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]) -> None:
        path, manifest = _save(tmp_path, 7, *model_and_tokenizer)
        loaded = load_checkpoint(path)
        assert loaded.step == 7
        assert loaded.manifest == manifest
        assert loaded.config["config"]["max_steps"] == 10
        assert loaded.trainer_state["sampler"] == {"epoch": 1}
        assert "param_groups" in loaded.trainer_state["optimizer"]

    def test_flipped_byte_is_refused_naming_the_file(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any]
    ) -> None:
        path, _ = _save(tmp_path, 1, *model_and_tokenizer)
        weights = path / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        with pytest.raises(CheckpointCorrupt, match="model.safetensors does not match its sha256"):
            load_checkpoint(path)

    @pytest.mark.parametrize(
        ("damage", "message"),
        [
            (lambda p: (p / STATE_NAME).unlink(), f"{STATE_NAME} is missing"),
            (lambda p: (p / "extra.bin").write_bytes(b"x"), "extra.bin is not listed"),
            (lambda p: (p / MANIFEST_NAME).unlink(), "manifest.json is missing"),
            (lambda p: (p / MANIFEST_NAME).write_text("{"), "manifest.json is unreadable"),
            (lambda p: (p / "config.json").write_text("{}"), "config.json has 2 bytes"),
        ],
    )
    def test_other_damage_is_refused(
        self, tmp_path: Path, model_and_tokenizer: tuple[Any, Any], damage: Any, message: str
    ) -> None:
        path, _ = _save(tmp_path, 1, *model_and_tokenizer)
        damage(path)
        with pytest.raises(CheckpointCorrupt, match=message):
            verify_manifest(path)


def test_rng_state_round_trip() -> None:
    state = capture_rng_state()
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(5)  # move every generator on
    restore_rng_state(state)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2])
