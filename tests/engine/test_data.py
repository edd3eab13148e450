"""Dataset loading, validation and the resumable prompt sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract.dataset_format import validate_jsonl_lines
from worker.grpo.data import DatasetError, PromptRow, PromptSampler, load_jsonl, parse_jsonl_lines


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class TestLoadJsonl:
    def test_string_and_chat_prompts_with_extras(self, tmp_path: Path) -> None:
        path = _write(
            tmp_path / "d.jsonl",
            [
                json.dumps({"prompt": "2+2=", "answer": "4"}),
                "",
                json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "id": 7}),
            ],
        )
        rows = load_jsonl(path)
        assert rows == [
            PromptRow("2+2=", {"answer": "4"}),
            PromptRow([{"role": "user", "content": "hi"}], {"answer": "x", "id": 7}),
        ]

    def test_errors_name_each_line_and_problem(self, tmp_path: Path) -> None:
        path = _write(
            tmp_path / "bad.jsonl",
            [
                json.dumps({"prompt": "ok"}),
                "{not json",
                json.dumps({"answer": "1"}),
                json.dumps({"prompt": ""}),
                json.dumps([1, 2]),
                json.dumps({"prompt": [{"role": "robot", "content": "x"}]}),
                json.dumps({"prompt": 5}),
            ],
        )
        with pytest.raises(DatasetError) as info:
            load_jsonl(path)
        lines = {issue.line: issue.message for issue in info.value.issues}
        assert sorted(lines) == [2, 3, 4, 5, 6, 7]
        assert "invalid JSON" in lines[2]
        assert "missing required column 'prompt'" in lines[3]
        assert "empty string" in lines[4]
        assert "JSON object" in lines[5]
        assert "'role'" in lines[6]
        assert "int" in lines[7]
        assert "line 3: missing required column 'prompt'" in str(info.value)

    def test_error_list_is_capped_at_20_but_counts_all(self, tmp_path: Path) -> None:
        path = _write(tmp_path / "bad.jsonl", ["[]"] * 30)
        with pytest.raises(DatasetError) as info:
            load_jsonl(path)
        assert len(info.value.issues) == 20
        assert info.value.num_errors == 30
        assert "10 more" in str(info.value)

    def test_empty_and_missing_files_are_errors(self, tmp_path: Path) -> None:
        with pytest.raises(DatasetError, match="no rows"):
            load_jsonl(_write(tmp_path / "empty.jsonl", [""]))
        with pytest.raises(DatasetError, match="cannot read file"):
            load_jsonl(tmp_path / "missing.jsonl")

    def test_invalid_utf8_is_reported(self) -> None:
        with pytest.raises(DatasetError, match="line 1: not valid UTF-8"):
            parse_jsonl_lines([b'{"prompt": "\xff"}'])


class TestValidateJsonlLines:
    def test_summary_of_a_stream(self) -> None:
        summary = validate_jsonl_lines(
            [b'{"prompt": "a", "answer": "1"}\n', b"\n", b'{"prompt": "b", "level": 2}\n', b"oops\n"]
        )
        assert summary.num_rows == 2
        assert summary.columns == ["prompt", "answer", "level"]
        assert [(e.line, "invalid JSON" in e.message) for e in summary.errors] == [(4, True)]
        assert not summary.ok

    def test_validation_module_does_not_import_torch(self) -> None:
        import subprocess
        import sys

        code = "import sys, contract.dataset_format; assert 'torch' not in sys.modules"
        subprocess.run([sys.executable, "-c", code], check=True)


class TestPromptSampler:
    def test_each_epoch_is_a_permutation_and_epochs_differ(self) -> None:
        sampler = PromptSampler(10, seed=3)
        first, second = sampler.next_indices(10), sampler.next_indices(10)
        assert sorted(first) == sorted(second) == list(range(10))
        assert first != second
        assert sampler.epoch == 1

    def test_same_seed_same_order_and_other_seed_differs(self) -> None:
        assert PromptSampler(50, 1).next_indices(30) == PromptSampler(50, 1).next_indices(30)
        assert PromptSampler(50, 1).next_indices(30) != PromptSampler(50, 2).next_indices(30)

    def test_restored_cursor_continues_exactly(self) -> None:
        reference = PromptSampler(7, seed=0)
        expected = reference.next_indices(5) + reference.next_indices(12)

        first = PromptSampler(7, seed=0)
        head = first.next_indices(5)
        resumed = PromptSampler(7, seed=0)
        resumed.load_state_dict(first.state_dict())
        assert head + resumed.next_indices(12) == expected

    def test_restoring_onto_another_dataset_size_is_refused(self) -> None:
        state = PromptSampler(7, seed=0).state_dict()
        with pytest.raises(ValueError, match="7 prompts"):
            PromptSampler(8, seed=0).load_state_dict(state)
