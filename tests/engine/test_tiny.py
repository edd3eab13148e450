"""The offline tiny model builder: sizes, determinism, idempotence, tokenizer round trip."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from worker.grpo.model_paths import resolve_model_path
from worker.grpo.tiny import build_tiny_model, model_config


class TestPresets:
    @pytest.mark.parametrize(
        ("preset", "low", "high"), [("tiny", 0.6e6, 0.8e6), ("small", 3.5e6, 4.5e6), ("medium", 22e6, 28e6)]
    )
    def test_parameter_counts(self, preset: str, low: float, high: float) -> None:
        with torch.device("meta"):  # shapes only, no memory or init time
            model = LlamaForCausalLM(model_config(preset))  # type: ignore[arg-type]
        assert low <= sum(p.numel() for p in model.parameters()) <= high

    def test_unknown_preset_is_named(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="'huge'"):
            build_tiny_model("huge", tmp_path / "m")  # type: ignore[arg-type]

    def test_saved_model_loads_with_from_pretrained(self, tiny_model_dir: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
        assert 0.6e6 <= model.num_parameters() <= 0.8e6


class TestBuild:
    def test_deterministic_for_a_seed(self, tmp_path: Path, tiny_model_dir: Path) -> None:
        again = load_file(build_tiny_model("tiny", tmp_path / "same", seed=0) / "model.safetensors")
        other = load_file(build_tiny_model("tiny", tmp_path / "other", seed=1) / "model.safetensors")
        reference = load_file(tiny_model_dir / "model.safetensors")
        assert reference.keys() == again.keys()
        assert all(torch.equal(reference[k], again[k]) for k in reference)
        assert not torch.equal(reference["lm_head.weight"], other["lm_head.weight"])

    def test_global_rng_untouched(self, tmp_path: Path) -> None:
        state = torch.get_rng_state()
        build_tiny_model("tiny", tmp_path / "m", seed=3)
        assert torch.equal(torch.get_rng_state(), state)

    def test_idempotent(self, tiny_model_dir: Path) -> None:
        weights = tiny_model_dir / "model.safetensors"
        before = weights.stat().st_mtime_ns
        assert build_tiny_model("tiny", tiny_model_dir) == tiny_model_dir
        assert weights.stat().st_mtime_ns == before
        # No temporary build directories are left next to it.
        assert [p.name for p in tiny_model_dir.parent.iterdir() if p.name.startswith(".")] == []

    def test_refuses_a_non_empty_foreign_directory(self, tmp_path: Path) -> None:
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "notes.txt").write_text("mine")
        with pytest.raises(FileExistsError, match="not empty"):
            build_tiny_model("tiny", tmp_path / "m")


class TestTokenizer:
    def test_printable_text_round_trips_one_token_per_char(self, tiny_model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        text = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "") + "\nline two"
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.unk_token_id not in ids

    def test_special_tokens(self, tiny_model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
        assert None not in special and len(special) == 3
        assert tokenizer.padding_side == "left"
        assert (
            tokenizer.decode([tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True) == ""
        )
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.pad_token_id == tokenizer.pad_token_id

    def test_chat_template(self, tiny_model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "2+2?"},
        ]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == "user: hi\nassistant: hello</s>\nuser: 2+2?\nassistant: "

    def test_unknown_characters_map_to_unk(self, tiny_model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]


class TestResolveModelPath:
    def test_builtin_is_built_into_the_cache(self, tmp_path: Path) -> None:
        path = resolve_model_path("builtin:tiny", tmp_path)
        assert Path(path) == tmp_path / "tiny" and (Path(path) / "config.json").is_file()

    def test_other_names_pass_through(self, tmp_path: Path) -> None:
        assert resolve_model_path("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"
        assert resolve_model_path("/models/mine", tmp_path) == "/models/mine"
        assert list(tmp_path.iterdir()) == []

    def test_unknown_builtin_names_the_value(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="builtin:huge"):
            resolve_model_path("builtin:huge", tmp_path)
