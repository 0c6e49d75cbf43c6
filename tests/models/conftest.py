"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def float64_rms_norm(monkeypatch):
    """Hugging Face's Llama / Qwen2 / Qwen3 RMSNorm in its input's dtype: it computes in float32 even in a float64
    model, which alone would leave about 1e-7 between its logits and attnlab's."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)

