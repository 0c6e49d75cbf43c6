"""Capabilities instead of class identity: which mechanisms form one plain softmax per head (what QK-clip, entropy
and the attention Jacobian need), and terms that act during training plug into the trainer through the registry."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.analysis import entropy, jacobian
from attnlab.attention import CogAttention, DiffAttention, DnAAttention, DnACrossAttention
from attnlab.attention.base import Intermediates
from attnlab.attention.capabilities import capabilities_of
from attnlab.attention.standard import StandardAttention
from attnlab.errors import SpecError, UnsupportedModelError
from attnlab.reparam import qkclip
from attnlab.variants import VARIANTS, training_hooks


class OwnAttend(StandardAttention):
    def kernel(self, q, k, v, mask, want, backend):
        return v, Intermediates()  # not softmax attention any more


class DeclaredSoftmax(StandardAttention):
    capabilities = replace(StandardAttention.capabilities, intermediates=("head",))

    def kernel(self, q, k, v, mask, want, backend):
        return super().kernel(q, k, v, mask, want, backend)


def test_plain_softmax_is_declared_by_standard_only_and_lost_by_overriding_the_kernel():
    assert StandardAttention.capabilities.plain_softmax and DeclaredSoftmax.capabilities.plain_softmax
    for cls in (DnAAttention, DiffAttention, CogAttention, OwnAttend):
        assert not cls.capabilities.plain_softmax, cls
    assert not capabilities_of(DnACrossAttention(16, 2)).plain_softmax


def _model_with(cls):
    model = attnlab.build_model("vit_cifar", num_classes=10, attn="standard", depth=1)
    block = model.blocks[0]
    block.attn = cls.from_module(block.attn)
    return model


@pytest.mark.parametrize("cls,ok", [(OwnAttend, False), (DeclaredSoftmax, True)])
def test_qkclip_entropy_and_jacobian_follow_the_capability(cls, ok):
    model = _model_with(cls)
    modules = [model.blocks[0].attn]
    images = torch.randn(1, 3, 32, 32)
    if ok:
        qkclip.apply(model, modules)
        assert entropy.attention_entropy(model, images)
        assert jacobian.jacobian_conditioning(model, images, heads=[0]).kappa.isfinite().all()
    else:
        with pytest.raises(SpecError, match="softmax"):
            qkclip.apply(model, modules)
        with pytest.raises(UnsupportedModelError):
            entropy.attention_entropy(model, images)
        with pytest.raises(UnsupportedModelError, match="Jacobian is defined for softmax attention"):
            jacobian.jacobian_conditioning(model, images)


def test_the_trainer_names_no_method_and_gets_qkclip_from_the_registry():
    loop = (Path(attnlab.__file__).parent / "train" / "loop.py").read_text()
    for name in VARIANTS:
        assert f"reparam.{name}" not in loop and f"import {name}" not in loop, name
    assert qkclip.TRAINING in training_hooks()


class OwnCog(CogAttention):
    def kernel(self, q, k, v, mask, want, backend):
        return v, Intermediates()


def test_weight_maps_are_declared_per_mechanism_and_lost_by_overriding_the_kernel():
    from attnlab.analysis.maps import map_modules
    from attnlab.attention.nystrom import NystromAttention

    for cls in (StandardAttention, CogAttention, DnAAttention, DiffAttention):
        assert "weights" in cls.capabilities.intermediates, cls
    for cls in (OwnAttend, OwnCog, DeclaredSoftmax, NystromAttention):
        assert "weights" not in cls.capabilities.intermediates, cls
    model = _model_with(OwnCog)
    with pytest.raises(UnsupportedModelError, match="no attention weight maps"):
        map_modules(model)


def test_dna_cross_attention_reads_its_record_for_refusals_and_backends():
    """DnA cross-attention is no AttnlabAttention, yet its causal refusal and backend choice are its record's."""
    from attnlab.attention.mask import AttentionMask
    from attnlab.errors import ConfigError

    cross = DnACrossAttention(16, 2).double().eval()
    x, context = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError) as info:
        cross(x, context, attn_mask=AttentionMask(is_causal=True))
    assert str(info.value) == f"{cross.capabilities.causal}."
    with torch.no_grad():
        cross.use_backend("explicit")
        explicit = cross(x, context)
        cross.use_backend("sdpa")
        torch.testing.assert_close(cross(x, context), explicit, rtol=1e-12, atol=1e-12)
    with pytest.raises(ConfigError, match="has no 'flash' backend"):
        cross.use_backend("flash")
