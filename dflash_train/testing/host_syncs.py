"""Count the points where the host waits for the device: a CPU-visible stand-in for CUDA's sync check.

On a GPU, a host-device synchronisation stalls the Python thread until every queued kernel
has run, so the next step's launches cannot overlap this step's compute. CUDA can flag them
(``torch.cuda.set_sync_debug_mode``), but no CUDA is needed to find them: every sync is one
of a few operator kinds, and a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
sees those on CPU tensors just as on CUDA ones:

- a scalar read back (``.item()``, ``float(t)``, ``if t.any():``): ``aten._local_scalar_dense``;
- an output whose size depends on the data (``nonzero``, boolean-mask indexing and assignment,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``);
- a copy from another device to the CPU (``.cpu()``, ``.to("cpu")``; on CPU runs these never
  occur, so a CPU count is a lower bound there).

``Tensor.tolist()`` reads the storage without dispatching an operator, so the counter wraps it
too. On CPU every ``tolist`` is counted, host-only tensors included: code that must run between
steps without a sync keeps host values in Python lists, not in tensors.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default}
_DATA_DEPENDENT_SHAPES = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.unique_dim.default,
}
_PACKAGE_ROOTS = ("dflash_train", "nemo_automodel", "nemo", "transformers", "lightning", "torch")


def _is_mask_index(func, args) -> bool:
    """Indexing or assignment through a boolean mask: its index count is data dependent."""
    if func not in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _is_repeat_without_size(func, kwargs) -> bool:
    return func in (torch.ops.aten.repeat_interleave.Tensor, torch.ops.aten.repeat_interleave.self_Tensor) and (
        kwargs.get("output_size") is None
    )


def _is_copy_to_host(func, args, kwargs) -> bool:
    if func is torch.ops.aten._to_copy.default:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if func is torch.ops.aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _short(frame: traceback.FrameSummary) -> str:
    parts = Path(frame.filename).parts
    root = next((i for i, part in enumerate(parts) if part in _PACKAGE_ROOTS), None)
    return f"{'/'.join(parts[root:]) if root is not None else parts[-1]}:{frame.lineno}"


def _call_site() -> str:
    """``file:line`` of the innermost caller outside torch, with torch's own innermost frame in brackets when
    the sync happens inside torch (an optimizer, a functional), skipping dispatch and compile plumbing."""
    frames = [
        f
        for f in traceback.extract_stack()[:-3]
        if Path(f.filename).name != "host_syncs.py" and not any(s in f.filename for s in _PLUMBING)
    ]
    inside_torch = [f for f in frames if "/torch/" in f.filename]
    outside = [f for f in frames if "/torch/" not in f.filename]
    site = _short(outside[-1]) if outside else "?"
    if frames and frames[-1] in inside_torch:
        site += f" [{_short(frames[-1])}]"
    return site


_PLUMBING = ("torch/utils/_python_dispatch", "torch/_compile.py", "torch/_dynamo/", "torch/_tensor.py", "torch/utils/_contextlib")


class HostSyncCounter(TorchDispatchMode):
    """Counts host-device syncs while active, by kind and call site.

    ``with HostSyncCounter() as syncs: ...`` then ``syncs.total`` and ``syncs.sites`` (a
    :class:`~collections.Counter` of ``"kind at file:line"``). ``pause()`` / ``resume()`` bracket
    code that should not be counted (a callback's own bookkeeping).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self._counting = True
        self._tolist = None

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def record(self, kind: str) -> None:
        if self._counting:
            self.sites[f"{kind} at {_call_site()}"] += 1

    def pause(self) -> None:
        self._counting = False

    def resume(self) -> None:
        self._counting = True

    def reset(self) -> None:
        self.sites.clear()

    def __enter__(self) -> "HostSyncCounter":
        original = torch.Tensor.tolist
        counter = self

        def counted_tolist(tensor: torch.Tensor):
            counter.record("tolist")
            return original(tensor)

        self._tolist = original
        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc) -> Optional[bool]:
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SCALAR_READS:
            self.record("scalar read")
        elif func in _DATA_DEPENDENT_SHAPES or _is_mask_index(func, args) or _is_repeat_without_size(func, kwargs):
            self.record(f"data-dependent shape ({func.__name__})")
        elif _is_copy_to_host(func, args, kwargs):
            self.record("copy to host")
        return func(*args, **kwargs)
