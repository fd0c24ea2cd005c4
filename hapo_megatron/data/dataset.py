"""PromptDataset: validated, tokenized prompts with stable ids."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from hapo_megatron.data.rows import load_prompt_rows

__all__ = ["PromptRecord", "PromptDataset", "render_prompt"]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt ready for rollout.

    uid: stable id ``"<file index>-<file stem>-<row>"``; prompt_ids: token ids (chat template
    applied); prompt_text: the rendered prompt; ground_truth / data_source: from the row;
    messages: the chat messages; extra_info: the row's extra_info; index: position in the dataset.
    """

    uid: str
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    data_source: str
    messages: list[dict[str, str]] = field(default_factory=list)
    extra_info: dict[str, Any] = field(default_factory=dict)
    index: int = -1


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(messages: list[dict[str, str]], tokenizer, apply_chat_template: bool) -> tuple[str, bool]:
    """Prompt text and whether it came from the chat template (then it holds its special tokens).

    With ``apply_chat_template`` and a tokenizer that has a template: the template with the
    generation prompt; otherwise the message contents joined by newlines.
    """
    if apply_chat_template and _has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, True
    return "\n".join(m["content"] for m in messages), False


class PromptDataset:
    """Prompts of one or more .parquet/.jsonl files, tokenized when the dataset is built.

    Raises ValueError at construction for a malformed row or a prompt longer than
    ``max_prompt_length`` tokens (naming the file, the row and the lengths), so a bad dataset
    fails before any rollout work; with ``filter_overlong`` such prompts are dropped instead and
    counted in ``num_overlong_filtered`` (uids keep the row numbers of the file).
    """

    def __init__(self, files: Union[str, Sequence[str]], tokenizer, *, prompt_key: str,
                 max_prompt_length: int, apply_chat_template: bool, filter_overlong: bool = False):
        if isinstance(files, str):
            files = [files]
        if not files:
            raise ValueError("files must name at least one .parquet or .jsonl file")
        if max_prompt_length is None or max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        self.files = list(files)
        self.max_prompt_length = int(max_prompt_length)
        self.filter_overlong, self.num_overlong_filtered = bool(filter_overlong), 0
        self._records: list[PromptRecord] = []
        for file_index, path in enumerate(self.files):
            rows = load_prompt_rows(path, prompt_key=prompt_key)
            self._records.extend(self._tokenize_file(path, file_index, rows, tokenizer, prompt_key,
                                                     apply_chat_template))

    def _tokenize_file(self, path, file_index, rows, tokenizer, prompt_key, apply_chat_template):
        stem = os.path.splitext(os.path.basename(path))[0]
        rendered = [render_prompt(row[prompt_key], tokenizer, apply_chat_template) for row in rows]
        # A template already contains its special tokens; plain text gets the tokenizer's own.
        ids_all = self._encode([t for t, _ in rendered], tokenizer, add_special=not any(c for _, c in rendered))
        too_long = [(i, len(ids)) for i, ids in enumerate(ids_all) if len(ids) > self.max_prompt_length]
        if too_long and not self.filter_overlong:
            i, n = too_long[0]
            raise ValueError(f"{path}: row {i} has a prompt of {n} tokens > max_prompt_length="
                             f"{self.max_prompt_length} ({len(too_long)} of {len(rows)} rows in this "
                             "file are too long; raise data.max_prompt_length, set "
                             "data.filter_overlong_prompts=true to drop such rows, or filter the data)")
        self.num_overlong_filtered += len(too_long)
        kept = [i for i, ids in enumerate(ids_all) if len(ids) <= self.max_prompt_length]
        base = len(self._records)
        return [
            PromptRecord(uid=f"{file_index}-{stem}-{i}", prompt_ids=list(ids_all[i]), prompt_text=rendered[i][0],
                         ground_truth=rows[i]["reward_model"]["ground_truth"], data_source=rows[i]["data_source"],
                         messages=rows[i][prompt_key], extra_info=rows[i]["extra_info"], index=base + k)
            for k, i in enumerate(kept)
        ]

    @staticmethod
    def _encode(texts: list[str], tokenizer, add_special: bool) -> list[list[int]]:
        if not texts:
            return []
        return list(tokenizer(texts, add_special_tokens=add_special)["input_ids"])

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self._records[index]

    def __iter__(self):
        return iter(self._records)
