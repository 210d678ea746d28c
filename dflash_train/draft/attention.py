"""The attention functions the draft's layers call, registered with transformers under our own names.

Two problems of the stock functions, fixed here by construction:

* **One dtype.** Under BF16 autocast the draft's values come straight from a linear layer
  (BF16) while queries and keys pass through RMSNorms with FP32 weights and come out FP32.
  CUDA's sdpa casts them back under autocast; flex_attention does not (it rejects mixed
  dtypes). Queries and keys are cast to the values' dtype, the one autocast chose; without
  autocast the three already agree and nothing is cast.
* **flex_attention compiled once.** transformers compiles ``flex_attention`` anew whenever
  ``module.training`` flips (every validation) and specialises on shapes; past
  ``torch._dynamo.config.recompile_limit`` it silently falls back to eager attention, which
  materialises the full score matrix (out of memory or a large slowdown). Here it is
  compiled once, with dynamic shapes, for training and validation alike, and hitting the
  recompile limit is an error that says what to change.

Shapes that reach a compiled function (this flex attention, nemo_automodel's compiled block-mask
builder) fall in a small fixed set of classes (:func:`use_shape_classes`): lengths are padded to
128 and anchor counts rounded so the draft's query length is at least two 128-query tiles; duck
sizing (one symbol for equal sizes, e.g. a batch of 4 next to 4 heads) and the 0/1 size
specialisation are off. What remains are four classes per function, whatever the lengths and anchor
counts: grad mode (training, validation) × a batch of one row or of more (a guard of the compiled
kernels themselves), under the default limit of 8 (``dflash.compile_recompile_limit``).
"""

from __future__ import annotations

import functools

import torch

# flex_attention's block size: flex runs pad the draft's inputs to a multiple of it, so few lengths are compiled.
FLEX_LENGTH_MULTIPLE = 128
ONE_DTYPE_PREFIX = "one_dtype_"  # no "flash" in it: transformers would take the name for a flash-attention kernel
# torch.compile backend of the draft's flex attention. Tests on CPU use "aot_eager" (same dynamo guards and
# cache entries): inductor's CPU flex kernel fails on some dynamic shapes (index out of bounds in torch 2.13).
FLEX_COMPILE_BACKEND = "inductor"


class FlexRecompileError(RuntimeError):
    """A compiled function of the draft step hit torch.compile's recompile limit."""


def use_shape_classes(recompile_limit: int) -> None:
    """Process-wide torch.compile settings of a flex run (module docstring): no duck sizing, no 0/1
    specialisation, ``recompile_limit`` entries per compiled function and an error past them."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    fx_config.backed_size_oblivious = True
    torch._dynamo.config.recompile_limit = recompile_limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def recompile_error(where: str, shapes: str) -> FlexRecompileError:
    """The one-line error for a recompile limit hit in ``where`` with ``shapes``, naming the knob."""
    return FlexRecompileError(
        f"{where} recompiled more than torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit} "
        f"times ({shapes}); raise dflash.compile_recompile_limit, or make batch shapes more regular "
        "(data.train_ds.use_bucketing, batch_tokens)"
    )


def compiled_entries() -> dict[str, int]:
    """Cache entries torch.compile holds for each compiled function of a flex draft step (our flex attention,
    nemo_automodel's compiled block-mask builder): what ``dflash.compile_recompile_limit`` bounds."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return {fn.__name__: len(_debug_get_cache_entry_list(fn.__code__)) for fn in (flex_attention, create_block_mask)}


def _agreeing(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if query.dtype != value.dtype or key.dtype != value.dtype:
        return query.to(value.dtype), key.to(value.dtype)
    return query, key


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True, backend=FLEX_COMPILE_BACKEND)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``[B, H, Q, D]`` queries over ``[B, H_kv, K, D]`` keys under a ``BlockMask``; returns ``([B, Q, H, D], None)``."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        raise TypeError(f"the draft's flex_attention needs a BlockMask, got {type(attention_mask).__name__}")
    if dropout:
        raise ValueError("the draft's flex_attention does not implement attention dropout")
    query, key = _agreeing(query, key, value)
    try:
        output = _compiled_flex_attention()(
            query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    except torch._dynamo.exc.FailOnRecompileLimitHit as err:
        raise recompile_error("flex_attention", f"query {tuple(query.shape)}, key {tuple(key.shape)}") from err
    return output.transpose(1, 2).contiguous(), None


def _one_dtype(backend: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(module, query, key, value, *args, **kwargs):
        query, key = _agreeing(query, key, value)
        return ALL_ATTENTION_FUNCTIONS[backend](module, query, key, value, *args, **kwargs)

    return attention


def draft_attention_implementation(backend: str) -> str:
    """The ``_attn_implementation`` name the draft's config uses for ``backend`` (registered on first use)."""
    from transformers import AttentionInterface

    name = ONE_DTYPE_PREFIX + backend
    AttentionInterface.register(name, flex_attention_forward if backend == "flex_attention" else _one_dtype(backend))
    return name
