"""Dataclass schema of every key the recipe accepts.

The composed Hydra config is checked against these classes before any model is built
(see :mod:`dflash_train.config.validate`). Fields typed ``dict``/``Any`` are passed
through to another library (NeMo's SALM config, a Hydra ``_target_`` object) and are
checked there. The ``dflash`` section is typed by its variant: each variant module of
:mod:`dflash_train.variants` owns its schema class.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from dflash_train.variants import DFlash2Config, DFlashConfig

LABEL_SOURCES = ("target_argmax", "ground_truth")
PERCEPTION_DTYPES = ("bfloat16", "float16", "float32")
ATTENTION_BACKENDS = ("flex_attention", "sdpa")
# Recipe precision names -> the Lightning precision plugin that implements them.
# bf16-flash: BF16 autocast with FP32 master weights for the draft (flash/flex attention on GPU).
LIGHTNING_PRECISION = {
    "bf16-flash": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "32-true": "32-true",
}
PRECISION_ALIASES = {"bf16-automodel": "bf16-flash"}
STRATEGIES = ("auto", "ddp", "fsdp2")
CHECKPOINT_MODES = ("max", "min")
EXPORT_CHECKPOINTS = ("last", "best")  # exp_manager.export_checkpoint (training/checkpoint_choice.py)
DEFAULT_PROMPT_FORMAT = "qwen"


@dataclass
class ModelConfig:
    """The frozen SALM target: where it comes from and how strictly its weights must load."""

    pretrained_name: Optional[str] = MISSING
    salm: Optional[dict] = None
    init_from_checkpoint: Optional[str] = None
    init_from_checkpoint_strict: bool = True
    audio_locator_tag: str = "<|audio|>"
    encoder_chunk_size_seconds: Optional[float] = None
    packed_sequences: Optional[bool] = None  # NeMo's name: true = data.train_ds.packing (see resolve_nemo_aliases)
    # NeMo's SALM / SALMAutomodel keys (salm_automodel.yaml), with NeMo's meaning (docs/target.md, "NeMo's keys"):
    prompt_format: Optional[str] = None  # NeMo's name for data.prompt_format ("nemotron-nano-v3" = nemotron_nano_v3)
    pretrained_llm: Optional[str] = None  # how the SpeechLM is built: checked against a checkpoint, else builds it
    pretrained_asr: Optional[str] = None
    perception: Optional[dict] = None
    pretrained_weights: Optional[bool] = None
    use_nemo_automodel: Optional[bool] = None  # the LLM in nemo_automodel's modules (native checkpoint names)
    automodel_backend: Optional[dict] = None  # nemo_automodel kernels for the LLM (GPU); the CPU target runs HF's
    mtp: Optional[dict] = None  # the SpeechLM's own MTP heads (stored beside the LLM, not part of the target)
    # Keys that steer training the SpeechLM itself; the target is frozen here, so they change nothing.
    freeze_params: Optional[Any] = None
    prevent_freeze_params: Optional[Any] = None
    aux_loss_coeff: Optional[float] = None
    train_gate: Optional[bool] = None
    packed_encoder_sequences: Optional[bool] = None
    lora: Optional[dict] = None
    optimizer: Optional[dict] = None
    lr_scheduler: Optional[dict] = None


@dataclass
class InputConfig:
    """One data source in ``input_cfg`` (see docs/data.md for the record formats).

    ``lhotse_as_conversation`` reads a lhotse CutSet (``cuts_path``), a lhotse Shar directory
    (``shar_path``), a NeMo ASR manifest (``manifest_filepath``) or NeMo tarred audio
    (``manifest_filepath`` + ``tarred_audio_filepaths``) and turns every utterance into
    [system] [user: context] [user: audio] [assistant: transcript]; NeMo's narrower type names
    (``lhotse``, ``lhotse_shar``, ``nemo``, ``nemo_tarred``) read the same way.
    ``multimodal_conversation`` reads multi-turn conversation JSONL (``manifest_filepath``).
    """

    type: str = MISSING
    cuts_path: Optional[str] = None
    shar_path: Optional[str] = None
    manifest_filepath: Optional[str] = None
    tarred_audio_filepaths: Optional[str] = None
    weight: float = 1.0
    name: Optional[str] = None
    tags: dict = field(default_factory=dict)
    assistant_turns: str = "all"
    audio_locator_tag: Optional[str] = None  # NeMo's per-input key; must equal model.audio_locator_tag when set


@dataclass
class DatasetConfig:
    """The inputs of one split and how their samples are filtered and batched."""

    input_cfg: list[InputConfig] = MISSING
    batch_size: Optional[int] = None
    batch_tokens: Optional[int] = None
    measure_total_length: bool = True
    max_tokens: Optional[int] = None
    min_duration: Optional[float] = None
    max_duration: Optional[float] = None
    packing: bool = False
    use_packed_sequence_sampling: Optional[bool] = None  # NeMo's name for packing (one meaning)
    use_multimodal_sampling: Optional[bool] = None  # NeMo's: true = token-budget batches (batch_tokens)
    use_bucketing: bool = False
    num_buckets: int = 10
    bucket_bins: Optional[list[int]] = None
    bucket_estimate_samples: int = 2000
    bucket_buffer_size: int = 10000
    shuffle: Optional[bool] = None
    shuffle_buffer_size: int = 10000
    num_workers: int = 0
    prefetch_factor: Optional[int] = None
    pin_memory: Optional[bool] = None


@dataclass
class DataConfig:
    """Speech conversation data: prompt format, training inputs and named validation sets."""

    prompt_format: Optional[str] = DEFAULT_PROMPT_FORMAT  # the recipe's null: model.prompt_format, else the default
    system_prompt: Optional[str] = None
    train_ds: DatasetConfig = field(default_factory=DatasetConfig)
    validation_ds: Optional[DatasetConfig] = None


@dataclass
class ParallelismConfig:
    """Process topology. Only data parallelism (DDP / FSDP2) and expert parallelism are supported."""

    name: str = "fsdp2"
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    dp_size: Optional[int] = None
    reshard_after_forward: bool = True  # FSDP2: free each layer's gathered weights after forward


@dataclass
class TrainerConfig:
    """Keys the framework interprets; every other ``trainer.*`` key must be a ``lightning.Trainer`` argument."""

    precision: str = "bf16-flash"
    strategy: ParallelismConfig = field(default_factory=ParallelismConfig)


@dataclass
class ExpManagerConfig:
    """Where a run writes logs and checkpoints, and whether it resumes from them."""

    exp_dir: str = "outputs"
    name: str = "dflash"
    version: Optional[str] = None
    explicit_log_dir: Optional[str] = None
    resume_if_exists: bool = True
    resume_ignore_no_checkpoint: bool = True
    checkpoint_monitor: str = "val_acc"
    checkpoint_mode: str = "max"
    save_top_k: int = 1
    export_checkpoint: str = "last"  # best: export the best checkpoint by checkpoint_monitor (training/checkpoint_choice.py)
    save_last: bool = True
    checkpoint_every_n_steps: Optional[int] = None
    create_tensorboard_logger: bool = True
    create_csv_logger: bool = True
    create_wandb_logger: bool = False
    wandb_logger_kwargs: Optional[dict] = None  # Lightning's WandbLogger arguments (project, offline, ...)
    create_mlflow_logger: bool = False
    mlflow_logger_kwargs: Optional[dict] = None  # Lightning's MLFlowLogger arguments (tracking_uri, ...)
    requeue_on_preemption: bool = False
    record_sample_ids: bool = False


@dataclass
class RunConfig:
    """The whole recipe after composition; ``dflash`` is typed by its ``variant``."""

    name: str = "dflash"
    seed: int = 42
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    exp_manager: ExpManagerConfig = field(default_factory=ExpManagerConfig)
    dflash: DFlashConfig = field(default_factory=DFlash2Config)
