"""Run a script as on the stock GPU image ``benchmarks/gpu_check.sh`` targets:

    python tests/stock_image.py SCRIPT [ARGS...]

Importable are the standard library, torch, lightning and transformers with what they require, the
distributions ``benchmarks/gpu_check_wheels.txt`` carries, and this project. Every other installed
distribution is hidden first: its modules unimportable (``sys.modules[name] = None``: ``import``
raises and ``importlib.util.find_spec`` says absent) and its metadata gone from
``importlib.metadata``, the two ways libraries probe optional packages. A run that passes here needs
nothing beyond what the script carries.
"""

from __future__ import annotations

import importlib.metadata
import re
import runpy
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
STOCK_IMAGE = ("torch", "lightning", "transformers")  # what the lent GPU image has (and what they require)


def closure(roots) -> set[str]:
    """The installed distributions ``roots`` require, transitively (markers evaluated, no extras)."""
    seen, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        seen.add(name)
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def carried() -> dict[str, str]:
    """``{distribution: pinned version}`` of ``benchmarks/gpu_check_wheels.txt``."""
    lines = (REPO / "benchmarks" / "gpu_check_wheels.txt").read_text().splitlines()
    pins = [re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line) for line in lines if line and not line.startswith("#")]
    if not all(pins):
        raise ValueError("gpu_check_wheels.txt must hold name==version lines")
    return {canonicalize_name(m[1]): m[2] for m in pins}


def hide_everything_else() -> list[str]:
    """Hide every distribution outside the stock image, the carried list and this project (module
    docstring); returns the hidden top-level module names."""
    allowed = closure(STOCK_IMAGE) | set(carried()) | {"dflash-train"}
    hidden = []
    for module, owners in packages_distributions().items():
        if module in sys.stdlib_module_names or module in sys.modules:
            continue
        if not any(canonicalize_name(owner) in allowed for owner in owners):
            sys.modules[module] = None
            hidden.append(module)
    discover = importlib.metadata.Distribution.discover

    def discover_allowed(**kwargs):
        return (found for found in discover(**kwargs) if canonicalize_name(found.metadata["Name"] or "") in allowed)

    importlib.metadata.Distribution.discover = staticmethod(discover_allowed)
    return hidden


if __name__ == "__main__":
    hide_everything_else()
    script, *arguments = sys.argv[1:]
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")
