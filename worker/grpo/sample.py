"""Load a saved model (a downloaded checkpoint, a local path or a hub id) and generate from it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def generate_text(model_path: str | Path, prompt: str, *, max_new_tokens: int = 32) -> str:
    """Greedy continuation of `prompt`, decoded without special tokens. Loads through from_pretrained."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(  # type: ignore[operator,misc]
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return str(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
