"""On a GPU without Transformer Engine the TE rows of `hapo doctor` skip and point at the import
row, which is the one failure (with its fix) for that cause: seen on an H200 whose image had no
TE, where three rows failed for it."""

import torch

from hapo_megatron.doctor import model_checks
from hapo_megatron.doctor.report import SKIP


def test_te_rows_skip_on_a_gpu_without_te(monkeypatch):
    import hapo_megatron.models.gpt as gpt
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "te_available", lambda: False)
    for check in (model_checks.check_te_vs_local, model_checks.check_packed_vs_padded):
        res = check()
        assert res.status == SKIP and res.figure == model_checks.TE_MISSING, res
