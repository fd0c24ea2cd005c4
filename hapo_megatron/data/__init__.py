"""Prompt data: verl/DAPO-layout files, tokenized datasets, a resumable sampler, and the offline
arithmetic task + character tokenizer used by tests and the CPU example.

``build_char_tokenizer`` imports transformers lazily, so importing this package stays light.
"""

from hapo_megatron.data.arithmetic import evaluate_expression, generate_arithmetic_rows, write_arithmetic_dataset
from hapo_megatron.data.dataset import PromptDataset, PromptRecord, render_prompt
from hapo_megatron.data.rows import load_prompt_rows, validate_row, write_rows
from hapo_megatron.data.sampler import PromptSampler


def build_char_tokenizer(out_dir=None, model_max_length: int = 4096):
    """See ``hapo_megatron.data.char_tokenizer.build_char_tokenizer``."""
    from hapo_megatron.data.char_tokenizer import build_char_tokenizer as build

    return build(out_dir, model_max_length=model_max_length)


__all__ = [
    "load_prompt_rows", "validate_row", "write_rows", "PromptDataset", "PromptRecord", "render_prompt",
    "PromptSampler", "generate_arithmetic_rows", "write_arithmetic_dataset", "evaluate_expression",
    "build_char_tokenizer",
]
