"""The target-side EAGLE-3 contract DFlash needs, checked without importing vLLM.

DFlash conditions the draft on target hidden states from ``dflash_config.target_layer_ids``
(vLLM's "aux hidden states"). vLLM asks the *target* for them through its ``SupportsEagle3``
methods; a multimodal target has to pass the request on to its inner language model, and
that backbone must implement them. When it does not, vLLM's own message ("Model does not
support EAGLE3 interface ...") names neither the backbone nor the fix.
"""

from __future__ import annotations

from typing import Any

AUX_HIDDEN_STATE_METHODS = ("set_aux_hidden_state_layers", "get_eagle3_default_aux_hidden_state_layers")


class AuxHiddenStatesUnsupported(RuntimeError):
    """The target's language model cannot return the hidden states a DFlash draft reads."""


def require_aux_hidden_states(language_model: Any) -> Any:
    """Return ``language_model`` if it implements vLLM's aux-hidden-state methods; else raise one clear line."""
    missing = [name for name in AUX_HIDDEN_STATE_METHODS if not callable(getattr(language_model, name, None))]
    if missing:
        raise AuxHiddenStatesUnsupported(
            f"the SALM target's LLM backbone {type(language_model).__name__} does not implement vLLM's "
            f"EAGLE-3 aux-hidden-state methods ({', '.join(missing)}), so DFlash drafts cannot read its "
            "hidden states; serve this target without --speculative-config or use a backbone whose vLLM "
            "class implements SupportsEagle3 (e.g. Qwen3ForCausalLM)"
        )
    return language_model
