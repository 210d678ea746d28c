"""One MTP step of a SpeechLM in PyTorch: the computation vLLM's ``NemotronHMTP`` serves, for our code to run.

An MTP step reads, at position *i*, the embedding of the next token *t_{i+1}* (an audio frame's
embedding at audio positions) and a hidden state *h_i* (the target's final, post-norm hidden
state for the first step; the step's own output after that), and predicts *t_{i+2}* through the
target's LM head:

    x = eh_proj(cat[enorm(e_{i+1}), hnorm(h_i)])            # eh_proj: [H, 2H], embedding half first
    for each sublayer of the pattern ('*': attention, causal, no RoPE; pre-norm, residual):
        x, residual = norm(x [+ residual]); x = attention(x)
    out = final_layernorm(x + residual)                       # logits = lm_head(out)

The attention of a sublayer sees every earlier position of its own inputs (the step keeps a KV
cache like any decoder layer). Weights are NeMo's (``llm.mtp.layers.<j>.*``, one module per
pattern character per step); RMS norms compute in float32, as vLLM's do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from dflash_train.constants import CONFIG_FILE, LLM_BACKBONE_DIR, MTP_WEIGHT_PREFIX, WEIGHTS_FILE
from dflash_train.errors import ConfigError
from dflash_train.files import load_state_exactly, read_json_object

MTP_LAYERS = f"{MTP_WEIGHT_PREFIX}layers."

SUBLAYER_TYPES = {"*": "full_attention", "E": "moe"}
"""MTP sublayers vLLM's ``NemotronHMTP`` builds: attention without RoPE (no MLP), and MoE (GPU only)."""

_STORED_MODULE = re.compile(rf"^{re.escape(MTP_LAYERS)}(\d+)\.(.+)$")


class MTPConfigError(ConfigError):
    """A SpeechLM MTP checkpoint vLLM's MTP route cannot serve; the message names the key to change."""


@dataclass(frozen=True)
class MTPBlock:
    """The ``mtp`` block of a SpeechLM config, checked: what vLLM's MTP route serves and the reference runs."""

    heads: int
    use_repeated_layer: bool
    pattern: str

    @classmethod
    def from_block(cls, block: Any, source: str = "config.json") -> Optional["MTPBlock"]:
        """The settings of an enabled block; ``None`` when MTP is absent or ``enabled`` is false.

        A block of several distinct heads is refused: vLLM never passes a step index to an MTP
        draft, so every draft position would run head 0 (and the others would never serve).
        """
        if block is None:
            return None
        if not isinstance(block, Mapping):
            raise MTPConfigError(
                f"{source}: mtp must be a mapping (enabled, num_nextn_predict_layers, ...), got {block!r}"
            )
        if not block.get("enabled", False):
            return None
        heads = block.get("num_nextn_predict_layers", 1)
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise MTPConfigError(f"{source}: mtp.num_nextn_predict_layers must be an integer >= 1, got {heads!r}")
        repeated = bool(block.get("use_repeated_layer", False))
        if heads > 1 and not repeated:
            raise MTPConfigError(
                f"{source}: mtp.num_nextn_predict_layers={heads} distinct heads with mtp.use_repeated_layer=false; "
                "vLLM runs one MTP step for every draft position, so only a checkpoint trained with "
                "use_repeated_layer: true (one layer applied at every step) can be served"
            )
        pattern = block.get("hybrid_override_pattern", "*")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(SUBLAYER_TYPES):
            raise MTPConfigError(
                f"{source}: mtp.hybrid_override_pattern={pattern!r} is not served; vLLM's MTP sublayers are "
                "'*' (attention) and 'E' (MoE, GPU only), e.g. '*'"
            )
        return cls(heads, repeated, pattern)


def stored_step_module(name: str, modules_per_step: int) -> tuple[int, str]:
    """``(j, rest)`` of a checkpoint tensor ``llm.mtp.layers.<j>.<rest>``; a tensor of a second stored step
    (``j`` past the pattern's modules: distinct heads) is refused."""
    match = _STORED_MODULE.match(name)
    if match is None:
        raise MTPConfigError(f"checkpoint tensor '{name}' is not under {MTP_LAYERS}<j>.")
    j = int(match.group(1))
    if j >= modules_per_step:
        raise MTPConfigError(
            f"checkpoint tensor '{name}' belongs to a second MTP step: this checkpoint stores distinct heads, "
            f"but mtp.hybrid_override_pattern has {modules_per_step} sublayer(s) per step and vLLM serves one "
            "repeated step; retrain with use_repeated_layer: true"
        )
    return j, match.group(2)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, in float32 whatever the input dtype (vLLM's and HF's order of operations)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(queries, keys, values) -> outputs`` of one attention sublayer, heads first (``[..., heads, n, D]``)."""


class AttentionSublayer(nn.Module):
    """A Nemotron-H attention block of an MTP step: ``norm`` then grouped-query attention, no RoPE."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[..., heads, n, D]``, keys and values ``[..., kv_heads, n, D]`` of ``x`` ``[..., n, H]``."""
        n = x.shape[-2]

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:
            return t.view(*t.shape[:-2], n, count, self.head_dim).transpose(-3, -2)

        return heads(self.q_proj(x), self.heads), heads(self.k_proj(x), self.kv_heads), heads(self.v_proj(x), self.kv_heads)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of attention outputs ``[..., heads, n, D]``: ``[..., n, H]``."""
        merged = attended.transpose(-3, -2)
        return self.o_proj(merged.reshape(*merged.shape[:-2], self.heads * self.head_dim))

    def forward(
        self, residual: torch.Tensor, cache: Optional["KVCache"] = None, attention: Optional[Attention] = None
    ) -> torch.Tensor:
        """``attention(q, k, v)`` of ``norm(residual)``, projected back to ``[..., n, H]``.

        Decoding (``attention`` ``None``): ``residual`` ``[n, H]`` sits at the positions after
        ``cache``'s, sees them and itself causally, and appends its keys and values to ``cache``.
        Training passes its own ``attention`` (batched, with its masks and extra keys).
        """
        q, k, v = self.project(self.norm(residual))
        if attention is not None:
            return self.output(attention(q, k, v))
        n, past = residual.shape[0], 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=residual.device).tril(diagonal=past)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.output(out)


class KVCache:
    """Keys and values ``[kv_heads, length, head_dim]`` of one attention sublayer, croppable."""

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :length], self.v[:, :length]


class MTPStep(nn.Module):
    """One MTP step (module docstring); ``pattern`` of attention sublayers only ('*')."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, pattern: str = "*"):
        super().__init__()
        if not pattern or set(pattern) - {"*"}:
            raise ConfigError(
                f"mtp.hybrid_override_pattern={pattern!r}: the reference MTP step runs '*' sublayers only"
            )
        self.pattern = pattern
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(AttentionSublayer(hidden, heads, kv_heads, head_dim, eps) for _ in pattern)
        self.final_layernorm = RMSNorm(hidden, eps)

    def new_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cache: Optional[list[KVCache]] = None,
        attention: Optional[Callable[[int], Attention]] = None,
    ) -> torch.Tensor:
        """Outputs ``[..., n, H]`` for ``n`` positions (``embeds``: next-token embeddings, ``hidden``: states).

        ``cache``: one KV cache per sublayer (decoding); ``attention(i)``: sublayer ``i``'s attention
        function instead (training). Every sublayer is called as a module, so FSDP2 gathers its weights.
        """
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        residual = None
        for i, layer in enumerate(self.layers):
            residual = x if residual is None else x + residual
            x = layer(
                residual, cache[i] if cache is not None else None, attention(i) if attention is not None else None
            )
        return self.final_layernorm(x + residual)

    @classmethod
    def for_llm(cls, text_config, pattern: str = "*") -> "MTPStep":
        """A freshly initialised step shaped after an LLM's text config (its hidden size, heads and norm eps)."""
        eps = getattr(text_config, "layer_norm_epsilon", None) or getattr(text_config, "rms_norm_eps", None) or 1e-5
        return cls(
            text_config.hidden_size,
            text_config.num_attention_heads,
            text_config.num_key_value_heads or text_config.num_attention_heads,
            getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
            eps,
            pattern,
        )

    def checkpoint_state(self, state: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """``state`` (default: this step's own) under NeMo's names ``llm.mtp.layers.<j>.*``, on the CPU."""
        state = self.state_dict() if state is None else state
        return {checkpoint_name(name, len(self.pattern)): t.detach().cpu().contiguous() for name, t in state.items()}

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> tuple["MTPStep", int]:
        """The stored step of a SpeechLM MTP checkpoint and its trained head count (``num_nextn_predict_layers``)."""
        from safetensors import safe_open
        from transformers import AutoConfig

        path = Path(path)
        config = read_json_object(path / CONFIG_FILE, "point --target at a SpeechLM checkpoint directory")
        block = MTPBlock.from_block(config.get("mtp"), str(path / CONFIG_FILE))
        if block is None:
            raise ConfigError(f"{path / CONFIG_FILE} has no mtp block with enabled: true: this target has no MTP heads")
        step = cls.for_llm(AutoConfig.from_pretrained(path / LLM_BACKBONE_DIR).get_text_config(), block.pattern)
        state = {}
        with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
            for name in f.keys():
                if name.startswith(MTP_LAYERS) and "._extra_state" not in name:
                    state[_step_name(name, len(step.pattern))] = f.get_tensor(name)
        load_state_exactly(step, state, path / WEIGHTS_FILE, "llm.mtp.*")
        return step.eval(), block.heads


_FUSION_AND_FINAL = ("enorm", "hnorm", "eh_proj", "final_layernorm")


def _step_name(name: str, modules: int) -> str:
    """Our parameter name for a checkpoint tensor ``llm.mtp.layers.<j>.<rest>`` (NeMo's, vLLM's layout)."""
    j, rest = stored_step_module(name, modules)
    if rest.split(".")[0] in _FUSION_AND_FINAL:
        return rest
    return f"layers.{j}." + rest.removeprefix("mixer.")


def checkpoint_name(name: str, modules: int) -> str:
    """NeMo's checkpoint name of our step parameter ``name``: the fusion in the first module, the final
    norm in the last, each sublayer's projections under ``mixer.`` (the inverse of reading a checkpoint)."""
    head = name.split(".")[0]
    if head in _FUSION_AND_FINAL:
        j = modules - 1 if head == "final_layernorm" else 0
        return f"{MTP_LAYERS}{j}.{name}"
    _, j, rest = name.split(".", 2)
    return f"{MTP_LAYERS}{j}.{rest}" if rest.startswith("norm.") else f"{MTP_LAYERS}{j}.mixer.{rest}"
