"""NeMo ``SALM`` as a frozen target: loading, freezing, audio splicing and taps."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from dflash_train.config.schema import ModelConfig
from dflash_train.constants import CONFIG_FILE, LLM_BACKBONE_DIR, MTP_WEIGHT_PREFIX, VERBOSE_ENV, WEIGHTS_FILE
from dflash_train.errors import ConfigError
from dflash_train.files import check_safetensors, read_json_object, require_directory
from dflash_train.target.audio import AudioLLM
from dflash_train.variants import TargetDims

log = logging.getLogger(__name__)



class TargetLoadError(RuntimeError):
    """The target checkpoint does not match the model it is loaded into."""


class SALMTarget(AudioLLM):
    """A NeMo SALM held frozen: eval mode always, no parameter requires grad.

    Exposes only what draft training needs: the embedding table and LM head (read-only),
    depth / hidden size / vocabulary, audio splicing into LLM inputs, and a forward that
    returns tapped decoder-block outputs.
    """

    def __init__(self, salm: nn.Module):
        super().__init__()
        self.salm = salm
        self.freeze()

    @property
    def tokenizer(self):
        return self.salm.tokenizer

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.salm.embed_tokens

    @property
    def causal_lm(self) -> nn.Module:
        """The HF causal LM inside SALM (unwrapped from PEFT when LoRA is installed)."""
        llm = self.salm.llm
        return llm.get_base_model() if hasattr(llm, "get_base_model") else llm

    @property
    def audio_locator_tag_id(self) -> int:
        return int(self.salm.audio_locator_tag_id)

    @property
    def pad_id(self) -> int:
        return int(self.salm.text_pad_id)

    @property
    def sampling_rate(self) -> int:
        return int(self.salm.sampling_rate)

    @property
    def perception(self) -> nn.Module:
        return self.salm.perception

    @property
    def encoder_chunk_size_seconds(self) -> float | None:
        return self.salm.cfg.get("encoder_chunk_size_seconds", None)

    @property
    def audio_locator_tag(self) -> str:
        return str(self.salm.audio_locator_tag)


def llm_config_for(model: ModelConfig):
    """The target LLM's HF config, read from files only (no weights are built)."""
    from transformers import AutoConfig
    from transformers.utils import cached_file

    if model.salm is not None:
        return AutoConfig.from_pretrained(model.salm["pretrained_llm"])
    name = model.pretrained_name
    salm_cfg_file = cached_file(name, "config.json", _raise_exceptions_for_missing_entries=False)
    if salm_cfg_file is None:
        raise ConfigError(f"model.pretrained_name='{name}' has no config.json; point it at a SALM checkpoint")
    backbone = cached_file(name, f"{LLM_BACKBONE_DIR}/config.json", _raise_exceptions_for_missing_entries=False)
    if backbone is not None:
        return AutoConfig.from_pretrained(str(Path(backbone).parent))
    return AutoConfig.from_pretrained(json.loads(Path(salm_cfg_file).read_text())["pretrained_llm"])


def check_salm_checkpoint(path: str | Path, key: str) -> Path:
    """A local SALM checkpoint directory whose ``config.json`` parses and whose weights file is complete.

    ``key`` names the setting that pointed here (``model.pretrained_name``, ``--target``); the
    checks cost a header read, so a truncated copy fails before any weight loads.
    """
    fix = f"point {key} at a SALM checkpoint directory (SALM.save_pretrained: {CONFIG_FILE} + {WEIGHTS_FILE})"
    path = require_directory(Path(path).expanduser(), f"a SALM checkpoint directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    read_json_object(path / CONFIG_FILE, fix)
    check_safetensors(path / WEIGHTS_FILE, fix)
    return path


def read_target_dims(model: ModelConfig) -> TargetDims:
    """Depth, hidden size and vocabulary of the target LLM, without loading weights."""
    name = model.pretrained_name
    if name is not None:
        hub_id_like = name.count("/") == 1 and not name.startswith((".", "/", "~"))
        if not Path(name).expanduser().exists() and not hub_id_like:
            raise ConfigError(
                f"model.pretrained_name='{name}' does not exist; point it at a SALM checkpoint directory "
                "(config.json + model.safetensors) or a hub id (org/name)"
            )
        if Path(name).expanduser().exists():
            check_salm_checkpoint(name, "model.pretrained_name")
    try:
        text = llm_config_for(model).get_text_config()
    except OSError as err:
        raise ConfigError(f"cannot read the target LLM config for model.pretrained_name='{name}': {err}") from None
    return TargetDims(int(text.num_hidden_layers), int(text.hidden_size), int(text.vocab_size))


def require_audio_tag(model: ModelConfig, target_tag: str) -> None:
    """``model.audio_locator_tag`` must be the loaded target's audio placeholder; else one line saying so."""
    if target_tag != model.audio_locator_tag:
        raise ConfigError(
            f"model.audio_locator_tag='{model.audio_locator_tag}' but the target uses '{target_tag}'; make them equal"
        )


def load_salm(model: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load (``pretrained_name``) or build (``salm``) the SALM in ``dtype``, then apply ``init_from_checkpoint``.

    A checkpoint loaded strictly goes straight into ``dtype`` (:func:`_salm_assigned_in`): no FP32
    copy of the model exists on the host at any point.
    """
    from nemo.collections.speechlm2.models import SALM

    if model.salm is not None:
        salm = SALM(dict(model.salm)).to(dtype)
        log.info("target: built SALM from model.salm (pretrained_weights=%s)", model.salm.get("pretrained_weights"))
    else:
        local = Path(model.pretrained_name).expanduser()
        stored: set[str] = set()
        if local.exists():
            check_salm_checkpoint(local, "model.pretrained_name")
            stored = stored_tensor_names(local / WEIGHTS_FILE)
        mtp_keys = {name for name in stored if name.startswith(MTP_WEIGHT_PREFIX)}
        try:
            with _without_hub_notice():
                if model.init_from_checkpoint_strict:
                    salm = _salm_assigned_in(dtype, model.pretrained_name).from_pretrained(model.pretrained_name)
                else:  # missing weights keep SALM's random initialisation: built in FP32 as NeMo builds it
                    salm = SALM.from_pretrained(model.pretrained_name, strict=False).to(dtype)
        except RuntimeError as err:
            if "state_dict" not in str(err):
                raise
            raise _mismatch(model.pretrained_name, err) from None
        log.info("target: loaded SALM checkpoint %s in %s%s", model.pretrained_name, str(dtype).removeprefix("torch."),
                 " (MTP heads left out)" if mtp_keys else "")
    require_audio_tag(model, salm.audio_locator_tag)
    if model.encoder_chunk_size_seconds is not None:
        from omegaconf import open_dict

        with open_dict(salm.cfg):
            salm.cfg.encoder_chunk_size_seconds = model.encoder_chunk_size_seconds
    if model.init_from_checkpoint is not None:
        load_weights_strictly(salm, model.init_from_checkpoint, strict=model.init_from_checkpoint_strict)
    return salm


def stored_tensor_names(weights_file: Path) -> set[str]:
    """The tensor names of a checkpoint's weights file (a header read)."""
    from safetensors import safe_open

    with safe_open(str(weights_file), "pt") as f:
        return set(f.keys())


def _mismatch(name: str, detail) -> TargetLoadError:
    return TargetLoadError(
        f"SALM checkpoint '{name}' does not match its config.json: {detail}; check the architecture settings in "
        "config.json (pretrained_llm, perception, modality adapter) against the checkpoint that wrote the weights"
    )


HUB_NOTICE = "Loading weights from local directory"  # huggingface_hub's print() in from_pretrained


@contextmanager
def _without_hub_notice() -> Iterator[None]:
    """Drop :data:`HUB_NOTICE` from what the block prints (huggingface_hub prints it with ``print``, on every
    rank, not through a logger a filter could reach); every other line is printed as it was.
    ``DFLASH_VERBOSE=1`` keeps it."""
    if os.environ.get(VERBOSE_ENV) == "1":
        yield
        return
    captured = io.StringIO()
    try:
        with redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines() if line != HUB_NOTICE]
        if kept:
            print("\n".join(kept))


def _salm_assigned_in(dtype: torch.dtype, name: str) -> type:
    """NeMo's ``SALM`` whose ``from_pretrained`` builds the parameters without storage and then assigns the
    checkpoint's tensors, each cast to ``dtype`` as it is read (MTP heads, ``llm.mtp.*``, left out).

    NeMo's own loader builds the whole model in FP32 (random initialisation included) and copies the
    weights in: 4 bytes a parameter plus the checkpoint, on every rank, before the recipe casts it.
    Here parameters live on the meta device while ``SALM.__init__`` runs (accelerate's
    ``init_empty_weights``; buffers such as the rotary frequencies and the mel filterbank are built
    as usual), so the host holds the checkpoint's tensors in ``dtype`` and nothing else. Every
    floating buffer then goes to ``dtype`` too, as ``.to(dtype)`` on NeMo's model would.
    """
    from accelerate import init_empty_weights
    from nemo.collections.speechlm2.models import SALM

    class SALMAssignedInDtype(SALM):
        @classmethod
        def _from_pretrained(cls, **kwargs):
            with init_empty_weights():  # NeMo's flow: config, tokenizer, modules; weights below, outside it
                model = super()._from_pretrained(**kwargs)
            weights_file = getattr(model, "_weights_file", None)
            if weights_file is None:
                raise TargetLoadError(f"SALM checkpoint '{name}' has no {WEIGHTS_FILE}: save it with save_pretrained")
            assign_weights(model, weights_file, dtype, name)
            rebuild_positional_tables(model, f"SALM checkpoint '{name}'",
                                      "load it with model.init_from_checkpoint_strict=false (NeMo's FP32 loader)")
            return model.to(dtype).eval()

        @classmethod
        def _load_as_safetensor(cls, model, model_file, map_location, strict):
            model._weights_file = Path(model_file)
            return model

    return SALMAssignedInDtype


def rebuild_positional_tables(model: nn.Module, what: str, fix: str) -> None:
    """Rebuild what construction computed on the parameters' device (meta while it ran): NeMo's Conformer
    encoders fill their positional-encoding table there (``set_max_audio_length``); any other tensor
    left on the meta device is a :class:`TargetLoadError` naming it (``what``: the checkpoint, ``fix``: the
    way out)."""
    for module in model.modules():
        pos_enc = getattr(module, "pos_enc", None)
        if hasattr(module, "set_max_audio_length") and getattr(getattr(pos_enc, "pe", None), "is_meta", False):
            del pos_enc.pe  # NeMo's extend_pe keeps a table that is long enough, so the meta one must go
            module.set_max_audio_length(module.pos_emb_max_len)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise TargetLoadError(f"{what}: {left[:5]} were not rebuilt after building the model without weights; {fix}")


def _tied_names(salm: nn.Module) -> dict[str, str]:
    """``{LM head weight name: embedding weight name}`` when the LLM ties its output embeddings to its input
    embeddings (``tie_word_embeddings``; SALM keeps the embedding table outside the LLM, as ``embed_tokens``;
    HF's ``get_output_embeddings`` cannot name the head once SALM has moved the table out). A LoRA SALM's LLM
    is PEFT's wrapper, so its head is ``llm.base_model.model.lm_head.weight`` (canary-qwen-2.5b's case)."""
    config = salm.llm.config.get_text_config()
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    wrapped = hasattr(salm.llm, "get_base_model")  # PEFT's PeftModel: the HF model sits at base_model.model
    return {f"llm.{'base_model.model.' if wrapped else ''}lm_head.weight": "embed_tokens.weight"}


def assign_weights(salm: nn.Module, weights_file: Path, dtype: torch.dtype, name: str) -> None:
    """Assign every tensor of ``weights_file`` but the MTP heads to ``salm`` (parameters on the meta device),
    floating ones cast to ``dtype``; any missing, unexpected or mis-shaped name is a :class:`TargetLoadError`.

    A tied LM head and embedding table are one tensor, stored under one of the two names
    (safetensors keeps one name per shared tensor): both names get that tensor, one storage.
    """
    from safetensors import safe_open

    own = salm.state_dict(keep_vars=True)
    tied = _tied_names(salm)
    with safe_open(str(weights_file), "pt") as f:
        stored = {k for k in f.keys() if not k.startswith(MTP_WEIGHT_PREFIX)}
        aliases = {head: embed for head, embed in tied.items() if head not in stored} | {
            embed: head for head, embed in tied.items() if embed not in stored}
        missing = sorted(set(own) - stored - {a for a, source in aliases.items() if source in stored})
        unexpected = sorted(stored - set(own))
        if missing or unexpected:
            raise _mismatch(name, f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        state = {}
        for key in sorted(stored):
            tensor = f.get_tensor(key)
            if tensor.shape != own[key].shape:
                raise _mismatch(name, f"{key} has shape {tuple(tensor.shape)}, the model {tuple(own[key].shape)}")
            state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    state.update({alias: state[source] for alias, source in aliases.items() if source in state})
    salm.load_state_dict(state, strict=True, assign=True)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``model.init_from_checkpoint``: a .safetensors file, a directory holding one, or a torch
    checkpoint of tensors only (a Lightning ``state_dict`` is unwrapped)."""
    from safetensors.torch import load_file

    if path.is_dir():
        path = path / "model.safetensors"
    if not path.exists():
        raise ConfigError(f"model.init_from_checkpoint='{path}' does not exist")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:  # tensors and plain containers only: a pickle someone hands you must not run code
        checkpoint = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        blocked = str(err).split("Unsupported global:", 1)[-1].strip().splitlines()[0] if "Unsupported global" in str(
            err) else type(err).__name__
        raise TargetLoadError(
            f"model.init_from_checkpoint='{path}' holds pickled Python objects beyond tensors ({blocked}); loading "
            "it could run code, so it is refused: save its state_dict as .safetensors and point the key there"
        ) from None
    return checkpoint.get("state_dict", checkpoint)


def load_weights_strictly(module: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load ``path`` into ``module``; with ``strict`` any missing, unexpected or mis-shaped key is an error."""
    state = read_state_dict(Path(path))
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mis_shaped = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if mis_shaped:
        raise TargetLoadError(
            f"init_from_checkpoint '{path}': shape mismatch for {_preview(mis_shaped)} "
            f"(e.g. {mis_shaped[0]}: checkpoint {tuple(state[mis_shaped[0]].shape)} vs model "
            f"{tuple(own[mis_shaped[0]].shape)})"
        )
    if strict and (missing or unexpected):
        raise TargetLoadError(
            f"init_from_checkpoint '{path}' does not match the target: missing {_preview(missing)}, "
            f"unexpected {_preview(unexpected)}; check that it was written by a SALM of this architecture "
            "(model.pretrained_name / model.salm: LLM, perception and adapter settings)"
        )
    module.load_state_dict(state, strict=False)
    log.info(
        "target: loaded %s (%d tensors; %d missing, %d unexpected)", path, len(state), len(missing), len(unexpected)
    )


def _preview(keys: list[str], limit: int = 8) -> str:
    if not keys:
        return "none"
    shown = ", ".join(keys[:limit])
    return f"{len(keys)} key(s) [{shown}{', ...' if len(keys) > limit else ''}]"
