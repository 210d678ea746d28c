"""Training-time draft class names as aliases of the names vLLM's model registry serves.

nemo_automodel trains ``Qwen3DFlashDraftModel`` / ``Qwen3DFlash2DraftModel``; vLLM serves
``DFlashDraftModel`` / ``DFlash2DraftModel``, and its ``EAGLEConfig`` rewrites a DFlash
draft's architecture ``X`` to ``DFlashX`` unless ``X`` starts or ends with ``DFlash``. Our
exports already carry vLLM's names (docs/serving.md); the aliases make drafts written with
training names (other exporters, older exports) load too. vLLM-free: works on any object
with vLLM's registry shape (``models`` dict + ``register_model``).
"""

from __future__ import annotations

from typing import Any, Mapping

from dflash_train.variants import ARCHITECTURE_ALIASES


def registration_target(entry: Any) -> type | str:
    """What ``register_model`` needs to register ``entry`` again under another name.

    A class-backed entry (vLLM's ``_RegisteredModel``) gives its class; a lazy entry
    (``_LazyRegisteredModel``) gives its ``"module:Class"`` string, so nothing is imported.
    """
    model_cls = getattr(entry, "model_cls", None)
    if model_cls is not None:
        return model_cls
    return f"{entry.module_name}:{entry.class_name}"


def alias_draft_architectures(registry: Any, aliases: Mapping[str, str] = ARCHITECTURE_ALIASES) -> dict[str, str]:
    """Register each alias the registry lacks as its serving name's entry; returns ``{alias: serving name}`` added.

    Idempotent: a name the registry already knows (vLLM's own, or added by an earlier call)
    is left alone; an alias whose serving name this vLLM lacks is skipped.
    """
    added = {}
    for alias, serving_name in aliases.items():
        if alias in registry.models or serving_name not in registry.models:
            continue
        registry.register_model(alias, registration_target(registry.models[serving_name]))
        added[alias] = serving_name
    return added
