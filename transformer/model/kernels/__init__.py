"""Attention kernels: ways to compute the attention formula (registry.py: KERNELS, what each
offers of the capabilities declared in capabilities.py), the one place that chooses a
layer's kernel and logs the choices (choice.py), a traced step's fallbacks logged once
(fallbacks.py), the formula itself (reference.py), a memory-bounded blockwise form
(blockwise.py) and the Pallas flash-attention kernels (pallas/). The rest of the package
enters here."""

from transformer.model.kernels.capabilities import Needs
from transformer.model.kernels.choice import (Target, check_kernel_name, choose, choosing_for,
                                             kernel_choices, kernel_warnings)
from transformer.model.kernels.reference import attention_weights, repeat_heads, soft_cap
from transformer.model.kernels.registry import KERNELS

__all__ = ["KERNELS", "Needs", "Target", "attention_weights", "check_kernel_name", "choose",
           "choosing_for", "kernel_choices", "kernel_warnings", "repeat_heads", "soft_cap"]
