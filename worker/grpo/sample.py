"""Load a saved model (a downloaded checkpoint, a local path or a hub id) and answer questions with it
(`grpo demo`)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging


def answer_questions(model_path: str | Path, questions: list[str], *, max_new_tokens: int = 8) -> list[str]:
    """Greedy answers to single-turn chat questions (rendered with the model's chat template), one load."""
    hf_logging.disable_progress_bar()  # no loading bar between the caller's lines
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    model.eval()
    answers = []
    for question in questions:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        inputs = tokenizer(str(prompt), return_tensors="pt")
        with torch.no_grad():
            output = model.generate(  # type: ignore[operator,misc]
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answers.append(str(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)))
    return answers
