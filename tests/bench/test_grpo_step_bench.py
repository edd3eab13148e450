"""The GRPO step benchmark's own logic: command line, cases, table, FLOP count, offline tokenizer.

The benchmark runs as a script with bench/ on sys.path (`from common import ...`); these tests do the same.
Nothing here times anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import flops  # noqa: E402
import grpo_step  # noqa: E402
import models  # noqa: E402
from common import Summary  # noqa: E402

# --- command line and cases -----------------------------------------------------------------------


def test_default_run_is_presets_then_every_architecture_vocabulary_and_tune() -> None:
    args = grpo_step.parse_args([])
    names = [case.name for case in grpo_step.cases_for(args)]
    assert names[:2] == ["tiny", "small"]
    assert len(names) == 2 + 4 * 2 * 2 + 2 * 2
    assert names[2:6] == ["llama small full", "llama small lora", "llama 32k full", "llama 32k lora"]
    assert {name.split()[0] for name in names[2:-4]} == {"llama", "qwen2", "qwen3", "mistral"}
    # The models of real size keep their own vocabulary: one case per tune, last.
    assert names[-4:] == ["smollm2 49k full", "smollm2 49k lora", "gemma3 262k full", "gemma3 262k lora"]
    assert (args.steps, args.reps) == (8, 2)


def test_real_size_models_ignore_the_vocabulary_option_and_have_their_targets() -> None:
    args = grpo_step.parse_args(["--presets", "none", "--arch", "gemma3,smollm2,qwen2", "--vocab", "small"])
    cases = grpo_step.cases_for(args)
    assert [c.name for c in cases] == [
        "gemma3 262k full",
        "gemma3 262k lora",
        "smollm2 49k full",
        "smollm2 49k lora",
        "qwen2 small full",
        "qwen2 small lora",
    ]
    assert [(c.target, c.chat) for c in cases[:4]] == [(1.0, False)] * 2 + [(0.7, True)] * 2
    for case in cases:
        assert grpo_step.Case.parse(case.name) == case
    with pytest.raises(ValueError, match="not a benchmark case"):
        grpo_step.Case.parse("gemma3 32k lora")  # gemma3 has only its own vocabulary


def test_quick_is_one_short_case_and_explicit_options_win() -> None:
    quick = grpo_step.parse_args(["--quick"])
    assert [c.name for c in grpo_step.cases_for(quick)] == ["llama small full"]
    assert (quick.steps, quick.reps) == (3, 1)
    mixed = grpo_step.parse_args(
        ["--quick", "--arch", "qwen2,mistral", "--lora", "--vocab", "32k", "--steps", "4"]
    )
    assert [c.name for c in grpo_step.cases_for(mixed)] == ["qwen2 32k lora", "mistral 32k lora"]
    assert mixed.steps == 4


def test_lora_flag_selects_lora_cases_only() -> None:
    args = grpo_step.parse_args(["--lora", "--vocab", "small"])  # the presets are full fine-tunes
    assert [c.name for c in grpo_step.cases_for(args)] == [
        "llama small lora",
        "qwen2 small lora",
        "qwen3 small lora",
        "mistral small lora",
        "smollm2 49k lora",
        "gemma3 262k lora",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "gpt2"], "--arch: unknown gpt2"),
        (["--vocab", "152k"], "--vocab: unknown 152k"),
        (["--presets", "huge"], "--presets: unknown huge"),
        (["--lora", "--tune", "full"], "--lora: conflicts with --tune"),
        (["--presets", "none", "--arch", "none"], "nothing to measure"),
        (["--steps", "1"], "--steps must be at least 2"),
    ],
)
def test_bad_options_name_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        grpo_step.parse_args(argv)
    assert message in capsys.readouterr().err


def test_case_names_round_trip_for_the_children() -> None:
    for case in grpo_step.cases_for(grpo_step.parse_args(["--presets", "tiny,small,medium"])):
        assert grpo_step.Case.parse(case.name) == case
    assert grpo_step.Case("qwen3", "32k", lora=True).target == 0.7
    assert grpo_step.Case("tiny").target == 0.5
    with pytest.raises(ValueError, match="not a benchmark case"):
        grpo_step.Case.parse("qwen3 32k half")


def _summary(step_s: float, train_s: float, rss: float, completion_tokens: float = 32 * 30) -> Summary:
    return Summary(
        median_step_s=step_s,
        median_cpu_s=2 * step_s,
        tokens_per_s=completion_tokens / step_s,
        generate_tokens_per_s=completion_tokens / (step_s - train_s),
        median_train_s=train_s,
        completion_tokens=completion_tokens,
        peak_rss_mib=rss,
        steps=14,
    )


def test_table_row_figures_come_from_both_summaries() -> None:
    dims = flops.ModelDims(
        hidden=256, intermediate=688, layers=6, heads=8, kv_heads=2, head_dim=32, vocab=32000
    )
    result = grpo_step.CaseResult(
        grpo_step.Case("qwen2", "32k", lora=True),
        trl=_summary(step_s=2.0, train_s=1.5, rss=1000),
        ours=_summary(step_s=1.2, train_s=0.6, rss=900),
        dims=dims,
        prompt_tokens=7,
        backend="fused",
    )
    peak = 1e11
    (row,) = grpo_step.table_rows([result], peak)
    assert dict(zip(grpo_step.COLUMNS, row, strict=True)) | {"": row[-1]} == {
        "case": "qwen2 32k lora",
        "ours on": "fused",
        "TRL step s": "2.000",
        "ours step s": "1.200",
        "ours/TRL / target": "0.60 / 0.7",
        "CPU ours/TRL": "0.60",
        "gen tok/s TRL": "1920",  # 960 tokens in 0.5 s of generation
        "gen tok/s ours": "1600",
        "train/peak TRL": f"{result.train_flops(result.trl) / 1.5 / peak:.2f}",
        "train/peak ours": f"{result.train_flops(result.ours) / 0.6 / peak:.2f}",
        "RSS MiB TRL": "1000",
        "RSS MiB ours": "900",
        "RSS ours/TRL": "0.90",
        "": "ok",
    }
    slower = grpo_step.CaseResult(result.case, result.trl, _summary(1.5, 0.6, 900), dims, 7)
    assert grpo_step.table_rows([slower], peak)[0][-1] == "MISS"  # 0.75 > 0.7
    heavier = grpo_step.CaseResult(result.case, result.trl, _summary(1.2, 0.6, 1100), dims, 7)
    assert grpo_step.table_rows([heavier], peak)[0][-1] == "MISS"  # more memory than TRL


# --- FLOP count -----------------------------------------------------------------------------------


def test_flop_count_by_hand() -> None:
    """One layer, hidden 4, MLP 8, 2 query heads and 1 KV head of 2 features, vocabulary 10; 4 rows in
    groups of 2, prompts of 3 tokens, completions of 2."""
    dims = flops.ModelDims(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2, vocab=10)
    tokens = flops.StepTokens(rows=4, group_size=2, prompt=3, completion=2)
    assert dims.body_weights == 16 + 8 + 8 + 16 + 32 + 32 + 32  # q k v o gate up down
    assert tokens.positions == 2 * 3 + 4 * 2  # two shared prompts, four completions
    assert tokens.attention_pairs == 2 * (1 + 2 + 3) + 4 * ((3 + 1) + (3 + 2))
    linear_forward = 2 * (144 * 14 + 40 * 8)  # 4672: body over 14 positions, LM head over 8
    attention_forward = 4 * 2 * 2 * 48  # 768
    assert flops.training_phase_flops(dims, tokens, lora_rank=None, beta=0.0) == 3 * (4672 + 768)
    assert flops.training_phase_flops(dims, tokens, lora_rank=None, beta=0.04) == 4 * (4672 + 768)
    adapters = 2 * 1 * (8 + 6 + 6 + 8 + 12 + 12 + 12) * 14  # r=1: 2 r (in + out) per position
    frozen_backward = linear_forward - 2 * (16 + 8 + 8) * 14  # layer 0's q/k/v input gradients skipped
    first_a_inputs = 2 * 1 * 3 * 4 * 14  # nor those of their A matrices
    lora = linear_forward + frozen_backward + 3 * adapters - first_a_inputs + 3 * attention_forward
    assert flops.training_phase_flops(dims, tokens, lora_rank=1, beta=0.0) == lora
    assert flops.training_phase_flops(dims, tokens, lora_rank=1, beta=0.04) == lora + 4672 + 768


def _counted_matmul_flops(model: torch.nn.Module, prompt: int, completion: int) -> int:
    """FLOPs of every matmul (mm, addmm, bmm) in one forward and backward, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(3, 60, (1, prompt + completion))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, logits_to_keep=completion).logits.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    assert {str(op) for op in counts} <= {"aten.mm", "aten.addmm", "aten.bmm"}
    return sum(counts.values())


@pytest.mark.parametrize("arch", models.ARCHS)
@pytest.mark.parametrize("lora", [False, True])
def test_linear_flop_count_matches_what_torch_runs(arch: models.Arch, lora: bool) -> None:
    """The analytic count of one sequence's forward + backward against torch's own FLOP counter, on
    each architecture, full and LoRA (peft, all linear layers). Eager attention multiplies full
    (S x S) score matrices, masked or not: 4 H D S^2 per layer forward, twice that backward."""
    from transformers import AutoModelForCausalLM

    shape = models.Shape(
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    config = models.hf_config(arch, 64, {"pad": 0, "bos": 1, "eos": 2}, shape)
    config._attn_implementation = "eager"  # attention as plain matmuls, which the counter sees
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    rank = None
    if lora:
        from peft import LoraConfig, get_peft_model

        rank = 4
        model = get_peft_model(model, LoraConfig(r=rank, target_modules="all-linear", lora_dropout=0.0))
    prompt, completion = 5, 3
    linear = flops.training_phase_linear_flops(
        flops.ModelDims.of(config),
        flops.StepTokens(rows=1, group_size=1, prompt=prompt, completion=completion),
        lora_rank=rank,
        beta=0.0,
    )
    eager_attention = 3 * 2 * 4 * 4 * 8 * (prompt + completion) ** 2  # (fwd + bwd) x layers x 4 H D S^2
    assert _counted_matmul_flops(model, prompt, completion) == linear + eager_attention


def test_gemma3_case_has_gemma_3_270m_shape_and_parameter_count() -> None:
    """The hf-only case is gemma-3-270m's architecture: its 268,098,176 parameters (built on the meta device),
    all but the norms matmul weights of the FLOP count; none of the fused path's Llama family."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    config = models.gemma3_270m_config(models.GEMMA3_VOCAB, {"pad": 0, "bos": 1, "eos": 2})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model) is Gemma3ForCausalLM
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    dims = flops.ModelDims.of(config)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert dims.body_weights + dims.vocab * dims.hidden + norms == 268_098_176  # tied: one embedding
    assert config.layer_types.count("full_attention") == 3 and config.final_logit_softcapping is None


# --- the offline 32k tokenizer --------------------------------------------------------------------

SMALL_RECIPE = models.BPERecipe(vocab_size=600, lexicon_size=800, sentences=1500)


def _hash_in_subprocess(recipe: models.BPERecipe, hash_seed: str) -> str:
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import models; "
        f"print(models.vocab_hash(models.train_bpe(models.BPERecipe(**{recipe.__dict__!r}))))"
    )
    env = os.environ | {"PYTHONHASHSEED": hash_seed, "TOKENIZERS_PARALLELISM": "true"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    here = models.vocab_hash(models.train_bpe(SMALL_RECIPE))
    assert here == models.vocab_hash(models.train_bpe(SMALL_RECIPE))
    assert _hash_in_subprocess(SMALL_RECIPE, "1") == here
    assert _hash_in_subprocess(SMALL_RECIPE, "2") == here
    other = models.BPERecipe(**{**SMALL_RECIPE.__dict__, "seed": 1})
    assert models.vocab_hash(models.train_bpe(other)) != here
    assert other.key != SMALL_RECIPE.key


def test_bpe_tokenizer_round_trips_text_and_is_cached(tmp_path: Path) -> None:
    tokenizer = models.cached_bpe(SMALL_RECIPE, tmp_path)
    assert tokenizer.get_vocab_size() == 600
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<pad>", "<s>", "</s>"]
    text = "Repeat the digit 7: ünïcode\tand\nnewlines 12345"
    encoded = tokenizer.encode(text)
    assert encoded.ids[0] == 1  # BOS
    assert tokenizer.decode(encoded.ids) == text  # byte-level: nothing is lost
    (cached,) = tmp_path.iterdir()
    assert SMALL_RECIPE.key in cached.name
    assert models.vocab_hash(models.cached_bpe(SMALL_RECIPE, tmp_path)) == models.vocab_hash(tokenizer)
    cached.write_text(json.dumps(json.loads(cached.read_text()) | {"added_tokens": []}))
    assert models.cached_bpe(SMALL_RECIPE, tmp_path).token_to_id("<pad>") is not None  # read from the file


@pytest.mark.slow
def test_the_32k_recipe_gives_32000_tokens(tmp_path: Path) -> None:
    tokenizer = models.hf_tokenizer("32k", tmp_path)
    assert len(tokenizer) == 32_000
    ids = tokenizer("Repeat the digit 7: ")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) < 12  # English words are whole tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Repeat the digit 7: "
