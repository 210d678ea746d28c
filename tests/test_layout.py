"""The package layout: folders are the concepts and imports flow one way (docs/development.md, Layout)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_train"

# Lower levels never import higher ones; a unit may import its own level.
LEVELS = {
    "constants": 0, "casting": 0, "errors": 0, "atomic": 0, "files": 0, "distributed": 0, "loss": 0, "progress": 0,
    "variants": 1,
    "config": 2,
    "data": 3, "target": 3, "draft": 3,
    "evaluate": 4, "vllm_plugin": 4, "testing": 4,
    "training": 5,
    "plan": 6,
    "smoke": 7,
    "cli": 8, "__main__": 8,
}


def _unit(module: str) -> str:
    """``dflash_train.training.module`` -> ``training``."""
    return module.split(".")[1]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name.startswith("dflash_train.")}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(relative.parts).removesuffix(".__init__"), path


def test_every_unit_has_a_level():
    units = {_unit(name) for name, _ in _modules() if name != "dflash_train"}
    assert units <= set(LEVELS), f"give these a level: {sorted(units - set(LEVELS))}"


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda value: str(value).split("/")[-1])
def test_imports_never_run_upward(name, path):
    if name == "dflash_train":
        return
    level = LEVELS[_unit(name)]
    upward = sorted(i for i in _imports(path) if i.count(".") and LEVELS.get(_unit(i), -1) > level)
    assert not upward, f"{name} (level {level}) imports {upward}"
