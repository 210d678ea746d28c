"""Draft families: how a variant's draft is built, trained, warm-started, exported and served.

A variant (:mod:`dflash_train.variants`) names its family in ``DraftVariant.family``; the
variant module holds its keys, rules and decoding, the family the code those need from this
level (draft models, the target's export). Three families exist:

* ``block``: DFlash and DFlash2, nemo_automodel's draft and trainer-core classes, exported as a
  draft-only HF directory next to the target (``{"method": "dflash", "model": DIR}``);
* ``mtp``: one MTP step (:mod:`dflash_train.draft.mtp`) trained by
  :class:`~dflash_train.draft.mtp_objective.MTPTrainerCore`, exported inside the target's
  vLLM-ready directory (``{"method": "mtp"}``);
* ``eagle3``: nemo_automodel's EAGLE-3 draft and TTT trainer (:mod:`dflash_train.draft.eagle3`), exported as
  a draft-only directory in vLLM's EAGLE-3 format (``{"method": "eagle3", "model": DIR}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

from torch import nn

from dflash_train.draft.build import DraftSpec
from dflash_train.variants import DraftVariant


class DraftFamily(Protocol):
    """The draft-level operations the training recipe and module run for a variant."""

    def build_draft(self, target, spec: DraftSpec, attention_backend: str) -> nn.Module:
        """A freshly initialised draft for ``target``."""

    def build_core(self, draft: nn.Module, target, spec: DraftSpec, attention_backend: str, stable_shapes: bool) -> nn.Module:
        """The trainer core around ``draft``: anchors, masks, loss and metrics of one batch."""

    def warm_start(self, draft: nn.Module, path: str, spec: DraftSpec) -> None:
        """Load ``dflash.init_from_pretrained`` into ``draft`` strictly."""

    def fit_to_data(self, draft: nn.Module, datamodule, spec: DraftSpec) -> None:
        """Fit what a fresh draft takes from the training data before its first step (EAGLE-3: its output
        vocabulary, from the supervised tokens' frequencies); the other families take nothing."""

    def write_export(self, staging: Path, location: Path, draft: nn.Module, state: dict, run, training_info) -> int:
        """Write the serving export into ``staging`` (renamed to ``location`` afterwards), reload it strictly and
        compare it with ``state``; returns the tensor count."""

    def verify_export(self, location: Path, draft: nn.Module, state: dict, run) -> int:
        """Reload the export at ``location`` strictly with the matching class and check every trained tensor equals
        ``state`` (:meth:`write_export` runs it on the staging copy, ``dflash-smoke`` on the final export);
        returns the tensor count."""

    def serve_command(self, export_dir: Path, serve_target: Optional[str], num_speculative_tokens: int,
                      cpu: bool = False) -> str:
        """The ``vllm serve`` line for the export (``serve_target``: the vLLM-ready target, if one was written;
        ``cpu``: the line for vLLM's CPU build)."""

    def serving_copy(self, draft: nn.Module, target, spec: DraftSpec, state: dict) -> nn.Module:
        """An unsharded copy of the draft holding ``state`` (its full state dict) in the form its export is
        served and decoded in: what validation's reference decoder runs with."""


class BlockDrafts:
    """DFlash / DFlash2: nemo_automodel's classes, a draft-only export served beside the target."""

    def build_draft(self, target, spec, attention_backend):
        from dflash_train.draft.build import build_draft

        return build_draft(target.llm_config, spec, attention_backend)

    def build_core(self, draft, target, spec, attention_backend, stable_shapes):
        from dflash_train.draft.build import anchor_count_multiple, build_trainer_core

        multiple = anchor_count_multiple(spec.cfg.block_size) if stable_shapes else None
        if attention_backend == "flex_attention":
            from dflash_train.draft.attention import use_shape_classes

            use_shape_classes(spec.cfg.compile_recompile_limit)
        return build_trainer_core(draft, target, spec, attention_backend, anchor_multiple=multiple)

    def warm_start(self, draft, path, spec):
        from dflash_train.draft.build import warm_start

        warm_start(draft, path, spec)

    def fit_to_data(self, draft, datamodule, spec):
        return None

    def write_export(self, staging, location, draft, state, run, training_info):
        from dflash_train.draft.export import write_export

        write_export(staging, draft.config, state, training_info=training_info)
        return self.verify_export(staging, draft, state, run)

    def verify_export(self, location, draft, state, run):
        from dflash_train.draft.export import verify_export

        return verify_export(location, state)

    def serve_command(self, export_dir, serve_target, num_speculative_tokens, cpu=False):
        from dflash_train.target.vllm_export import serve_command

        target = serve_target or "<vLLM-ready target: dflash-export-target SALM_CKPT OUT>"
        return serve_command(target, export_dir.resolve(), num_speculative_tokens, cpu)

    def serving_copy(self, draft, target, spec, state):
        from dflash_train.draft.export import serving_draft

        return serving_draft(draft.config, state)


class MTPHeads:
    """MTP: one repeated step on the target's final hidden state, exported as the target's own MTP heads."""

    def build_draft(self, target, spec, attention_backend):
        from dflash_train.draft.mtp import MTPStep

        return MTPStep.for_llm(target.llm_config.get_text_config(), spec.cfg.hybrid_override_pattern)

    def build_core(self, draft, target, spec, attention_backend, stable_shapes):
        from dflash_train.draft.mtp_objective import MTPTrainerCore

        return MTPTrainerCore(draft, target.lm_head, spec.variant.step_weights(spec.cfg), spec.cfg.num_anchors,
                              spec.cfg.loss_chunk_size, per_document=spec.cfg.anchor_budget == "per_document",
                              terms=spec.variant.loss_terms(spec.cfg))

    def warm_start(self, draft, path, spec):
        from dflash_train.draft.mtp_export import warm_start_mtp

        warm_start_mtp(draft, path)

    def fit_to_data(self, draft, datamodule, spec):
        return None

    def write_export(self, staging, location, draft, state, run, training_info):
        from dflash_train.draft.mtp_export import write_mtp_export

        heads, source = run.dflash.num_nextn_predict_layers, run.model.pretrained_name
        write_mtp_export(staging, source, draft, state, heads, location=location, training_info=training_info)
        return self.verify_export(staging, draft, state, run)

    def verify_export(self, location, draft, state, run):
        from dflash_train.draft.mtp_export import verify_mtp_export

        return verify_mtp_export(location, run.model.pretrained_name, draft, state, run.dflash.num_nextn_predict_layers)

    def serve_command(self, export_dir, serve_target, num_speculative_tokens, cpu=False):
        from dflash_train.target.vllm_export import mtp_serve_command

        return mtp_serve_command(export_dir.resolve(), num_speculative_tokens, cpu)  # the export is the target

    def serving_copy(self, draft, target, spec, state):
        from dflash_train.files import load_state_exactly

        step = self.build_draft(target, spec, "sdpa")
        load_state_exactly(step, state, "the training MTP step", "its full state dict")
        return step


class Eagle3Drafts:
    """EAGLE-3: one layer on three fused taps, trained by TTT, a draft-only export served beside the target."""

    def build_draft(self, target, spec, attention_backend):
        from dflash_train.draft.eagle3 import build_eagle3_draft

        return build_eagle3_draft(target, spec.cfg.draft_vocab_size, spec.layer_ids, spec.cfg.ttt_steps,
                                  target.embed_tokens.weight.dtype)

    def build_core(self, draft, target, spec, attention_backend, stable_shapes):
        from dflash_train.draft.eagle3 import Eagle3Core

        audio = getattr(target, "audio_locator_tag_id", None)  # a speech target's: its frames are served as it
        frames = None if audio is None else (spec.mask_token_id, audio)
        return Eagle3Core(draft, target.lm_head, spec.cfg.ttt_steps, audio_frames=frames)

    def warm_start(self, draft, path, spec):
        from dflash_train.draft.eagle3_export import warm_start_eagle3

        warm_start_eagle3(draft, path)

    def fit_to_data(self, draft, datamodule, spec):
        from dflash_train.draft.eagle3 import choose_draft_vocabulary

        choose_draft_vocabulary(draft, datamodule.supervised_sample(spec.cfg.draft_vocab_samples))

    def write_export(self, staging, location, draft, state, run, training_info):
        from dflash_train.draft.eagle3_export import write_eagle3_export

        write_eagle3_export(staging, draft, state, training_info)
        return self.verify_export(staging, draft, state, run)

    def verify_export(self, location, draft, state, run):
        from dflash_train.draft.eagle3_export import verify_eagle3_export

        return verify_eagle3_export(location, state, draft)

    def serve_command(self, export_dir, serve_target, num_speculative_tokens, cpu=False):
        from dflash_train.target.vllm_export import serve_command

        target = serve_target or "<vLLM-ready target: dflash-export-target SALM_CKPT OUT>"
        return serve_command(target, export_dir.resolve(), num_speculative_tokens, cpu, method="eagle3")

    def serving_copy(self, draft, target, spec, state):
        from dflash_train.files import load_state_exactly

        copy = self.build_draft(target, spec, "eager")
        load_state_exactly(copy, state, "the training EAGLE-3 draft", "its full state dict")
        return copy


FAMILIES: dict[str, DraftFamily] = {"block": BlockDrafts(), "mtp": MTPHeads(), "eagle3": Eagle3Drafts()}


def family_of(variant: DraftVariant) -> DraftFamily:
    """The family of ``variant``."""
    return FAMILIES[variant.family]


def serving_lines(variant: DraftVariant, cfg, export_dir: Path, serve_target: Optional[str]) -> list[str]:
    """How to serve ``export_dir`` (a ``variant`` draft trained with the ``dflash`` keys ``cfg``): the ``vllm
    serve`` line, the line for vLLM's CPU build where that build serves the variant, and the variant's note."""
    family = family_of(variant)
    k = variant.speculative_tokens(cfg)
    lines = ["serve: " + family.serve_command(export_dir, serve_target, k)]
    if variant.serves_on_vllm_cpu:
        lines.append("serve on vLLM's CPU build: " + family.serve_command(export_dir, serve_target, k, cpu=True))
    if variant.serving_note:
        lines.append(f"note: {variant.serving_note}")
    return lines
