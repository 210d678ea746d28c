"""Names and numbers shared across the package: the lowest import level (imports nothing of ours).

Everything that two or more concepts must agree on lives here once: where the shipped recipe
is, the audio tag NeMo's vLLM plugin serves, the file names of an export, the audio sample
rate of the speech targets and how many tokens a draft proposes per round.
"""

from __future__ import annotations

import signal
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "conf"
"""The shipped Hydra recipe (``dflash.yaml``, ``demo.yaml`` and their groups), inside the package."""

AUDIO_LOCATOR_TAG = "<|audio|>"
"""The audio placeholder of a prompt; the only tag NeMo 3.0.0's vLLM plugin serves."""

SAMPLE_RATE = 16000
"""Audio sample rate (Hz) of the demo speech, the tiny target and vLLM serving requests."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
"""File names of a draft export and of a SALM checkpoint directory."""

LLM_BACKBONE_DIR = "llm_backbone"
"""Sub-directory of a SALM checkpoint that holds the LLM backbone's HF config."""

MTP_WEIGHT_PREFIX = "llm.mtp."
"""Where a SpeechLM checkpoint keeps its MTP heads (NeMo's layout: ``llm.mtp.layers.<j>.*``); never target weights."""

SALM_ARCHITECTURE = "DFlashSALMForConditionalGeneration"
"""The architecture name a vLLM-ready target's ``config.json`` carries (our plugin's SALM class)."""


def speculative_tokens(block_size: int) -> int:
    """K, the tokens a draft proposes per round: ``block_size - 1`` (K proposals + the bonus token = one block)."""
    return block_size - 1


PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Signals a scheduler sends before it ends a job (SLURM ``--signal``, time limit, ``scancel``, Kubernetes):
the training process turns them into a checkpoint; its data-loading workers ignore them."""

# DFLASH_VERBOSE=1 in the environment: every notice and every rank's INFO lines (dflash_train/cli/console.py).
VERBOSE_ENV = "DFLASH_VERBOSE"
