"""Work-arounds for other packages' bugs on the vLLM versions we serve with; each states its versions.

Only :func:`dflash_train.vllm_plugin.register` calls these, after vLLM and NeMo are imported.
"""

from __future__ import annotations

import sys


def shield_llvmlite_from_kernel_scan() -> bool:
    """Let vLLM-CPU's kernel-override scan pass llvmlite's library wrapper; returns whether it applied.

    vLLM 0.32 (``vllm.triton_utils.dispatcher._rebind_kernels``, run by the CPU platform's
    ``register_triton_kernel_overrides`` when a worker starts) reads ``vars(value).get("kernel")``
    for every module attribute. ``llvmlite.binding.ffi.lib`` (imported by NeMo through numba)
    answers any attribute, ``__dict__`` included, with a C-function wrapper, so the scan dies with
    "'_lib_fn_wrapper' object has no attribute 'get'". Seeding the wrapper's function table with
    an empty ``__dict__`` makes it answer like a plain object; no llvmlite function is named so.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is None or not hasattr(getattr(ffi, "lib", None), "_fntab"):
        return False
    ffi.lib._fntab["__dict__"] = {}
    return True


def per_layer_context_k_norm_on_cpu() -> bool:
    """Give every DFlash draft layer its own K-norm on vLLM-CPU; returns whether it applied.

    vLLM 0.32's DFlash model (``qwen3_dflash.DFlashQwen3Model._normalize_context_k``) normalizes
    the context keys of all draft layers in one ``rms_norm`` call with a ``[layers, head_dim]``
    weight. The CPU kernel uses only the first row of a 2-D weight, so on CPU every layer's
    context keys get layer 0's K-norm: a draft of two or more layers proposes from keys it was
    not trained with (demo draft: output off by ~2 % after layer 1; a trained draft loses ~2 %
    MAL). Applied only where a probe shows the kernel ignoring the rows, so a fixed kernel or
    another platform keeps vLLM's code.
    """
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    model = getattr(qwen3_dflash, "DFlashQwen3Model", None)
    if model is None or not hasattr(model, "_normalize_context_k") or getattr(model, "_per_layer_k_norm", False):
        return False
    probe, weight = torch.ones(2, 1, 1, 64), torch.stack([torch.ones(64), torch.full((64,), 2.0)])
    out = torch.empty_like(probe)
    ops.rms_norm(out, probe, weight, 1e-6)
    if torch.allclose(out[1], 2 * out[0]):
        return False

    def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        normed = torch.empty_like(all_k)
        for layer, weight in enumerate(self._k_norm_weights):
            ops.rms_norm(normed[layer], all_k[layer].contiguous(), weight, self._rms_norm_eps)
        return normed

    model._normalize_context_k = normalize_context_k
    model._per_layer_k_norm = True
    return True
