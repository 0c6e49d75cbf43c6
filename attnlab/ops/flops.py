"""FLOP formulas PyTorch's ``FlopCounterMode`` lacks, registered on import of :mod:`attnlab.ops`.

It counts SDPA's CUDA kernels (4 B H N M D forward: q k^T and weights @ v) but not the CPU one, so on the CPU standard
attention and the torch path of every mechanism would count no attention at all, while attnlab's fused kernels (custom
ops with formulas of their own) do. The same formulas are registered for the CPU kernel where they are missing.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula


def _sdpa_cpu_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


for _op, _formula in ((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, _sdpa_cpu_flops),
                      (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, _sdpa_cpu_backward_flops)):
    if _op not in flop_counter.flop_registry:
        register_flop_formula(_op)(_formula)
