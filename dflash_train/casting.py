"""Casting a module's floating tensors to one dtype by replacing them, which works on real and fake tensors alike.

``nn.Module.to(dtype)`` swaps a fake parameter's storage in place (``torch.utils.swap_tensors``), which the
fake-tensor mode ``dflash-plan`` runs the step under refuses while its memo holds weak references to the
tensor ("Couldn't swap ..."); replacing each tensor by its cast copy has no such limit.
"""

from __future__ import annotations

import torch


def cast_floating(model: torch.nn.Module, dtype: torch.dtype, frozen: bool = False) -> None:
    """Every floating parameter and buffer of ``model`` in ``dtype``: each replaced by its cast copy (tied tensors
    stay one tensor); a parameter keeps its ``requires_grad`` unless ``frozen`` (then none requires grad)."""
    cast: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in cast:
                    new = tensor.detach().to(dtype)
                    if table is module._parameters:
                        new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad and not frozen)
                    cast[id(tensor)] = new
                table[name] = cast[id(tensor)]
