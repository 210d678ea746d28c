"""Host memory and time of loading a target in BF16: an FP32 build then a cast vs the direct load.

    .venv/bin/python benchmarks/target_load_memory.py [--out benchmarks/target_load_memory.json]

Every rank of a run loads the frozen target. NeMo's ``SALM.from_pretrained`` builds the whole model
in FP32 (random initialisation included) and copies the checkpoint in, and the recipe then casts it
to BF16; ``load_salm(model, torch.bfloat16)`` (dflash_train/target/salm.py) builds the parameters on
the meta device and assigns the checkpoint's tensors cast to BF16 as they are read. The checkpoint
here is a SALM of the tiny builder's layout with a ~170 M-parameter Qwen3 LLM (hidden 1024, 8
layers, a 32k-row embedding table and LM head), stored in FP32 as NeMo's training writes it. Each
load runs in a fresh subprocess, one after another in this one invocation. Figures: the peak of the
process's private memory (``RssAnon``, sampled every 2 ms) above its level after the imports: what
every rank holds on its own; the peak resident memory (``ru_maxrss``), which also counts the pages
of the memory-mapped checkpoint file (the page cache, shared by all ranks of a node and
reclaimable); and the wall time of the load.

The same comparison for a Nemotron-H SpeechLM (``M*-EM*-E`` blocks, the same LLM width and
vocabulary, SALMAutomodel's native names): the FP32 build is what this project's loader did before
(HF ``NemotronHForCausalLM`` and NeMo's perception built with random weights in FP32, the checkpoint
loaded, then the cast); the direct load is ``open_speech_target(model, torch.bfloat16)``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOADERS = {"salm": ("nemo_fp32_then_cast", "direct_bf16"), "nemotron_h": ("fp32_build_then_cast", "direct_bf16")}


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakPrivateMemory(threading.Thread):
    """The highest ``RssAnon`` seen while running (sampled every 2 ms)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._stop_event = _anon_mib(), threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.002):
            self.peak = max(self.peak, _anon_mib())

    def stop(self) -> float:
        self._stop_event.set()
        self.join()
        return max(self.peak, _anon_mib())


def _fp32_nemotron_h_then_cast(checkpoint: str):
    """The Nemotron-H loader as it was: modules built in FP32 with random weights, the checkpoint loaded, a cast."""
    import torch
    from nemo.collections.speechlm2.modules import AudioPerceptionModule
    from omegaconf import DictConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig, NemotronHForCausalLM

    from dflash_train.target.nemotron_h import hf_llm_state

    path = Path(checkpoint)
    weights = load_file(str(path / "model.safetensors"))
    llm = NemotronHForCausalLM(AutoConfig.from_pretrained(path / "llm_backbone")).to(torch.float32)
    perception = AudioPerceptionModule(DictConfig(json.loads((path / "config.json").read_text())["perception"]))
    llm.load_state_dict(hf_llm_state(weights), strict=True)
    perception.load_state_dict({k[len("perception."):]: v for k, v in weights.items() if k.startswith("perception.")})
    del weights
    return torch.nn.ModuleDict({"llm": llm, "perception": perception}).to(torch.bfloat16)


def probe(loader: str, checkpoint: str) -> dict:
    """Subprocess body: one load of ``checkpoint`` in BF16 by ``loader``; peak memory above the imports, time."""
    import torch
    from nemo.collections.speechlm2.models import SALM

    from dflash_train.config import ModelConfig
    from dflash_train.target.load import open_speech_target
    from dflash_train.target.salm import load_salm

    torch.set_num_threads(2)
    before, before_private = _resident_mib(), _anon_mib()
    sampler = PeakPrivateMemory()
    sampler.start()
    start = time.perf_counter()
    if loader == "nemo_fp32_then_cast":
        salm = SALM.from_pretrained(checkpoint).to(torch.bfloat16)
    elif loader == "fp32_build_then_cast":
        salm = _fp32_nemotron_h_then_cast(checkpoint)
    elif Path(checkpoint, "llm_backbone", "config.json").read_text().count('"nemotron_h"'):
        salm = open_speech_target(ModelConfig(pretrained_name=checkpoint), torch.bfloat16)
    else:
        salm = load_salm(ModelConfig(pretrained_name=checkpoint), torch.bfloat16)
    seconds = time.perf_counter() - start
    private = sampler.stop() - before_private
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    params = sum(p.numel() for p in salm.parameters())
    return {"loader": loader, "parameters": params, "peak_private_mib": round(private, 1),
            "peak_resident_mib": round(peak, 1), "load_s": round(seconds, 2),
            "held_mib": round(sum(t.numel() * t.element_size() for t in salm.state_dict().values()) / 2**20, 1),
            "checksum": float(sum(p.float().sum() for p in salm.parameters()))}


def _run(loader: str, checkpoint: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--probe", loader, str(checkpoint)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "target_load_memory.json")
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return 0
    from dflash_train.testing.tiny_mtp_salm import TinyMTPSpec, build_tiny_mtp_salm
    from dflash_train.testing.tiny_salm import TinySALMSpec, build_tiny_salm

    spec = TinySALMSpec(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                        head_dim=128, intermediate_size=3072, spare_embedding_rows=32_000, lm_head_std=None)
    builders = {
        "salm": lambda out: build_tiny_salm(out, spec),
        "nemotron_h": lambda out: build_tiny_mtp_salm(
            out, TinyMTPSpec(backbone_pattern="M*-EM*-E", native_names=True, heads=1, sizes=spec)),
    }
    report = {}
    for family, build in builders.items():
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = build(Path(tmp) / family)
            size = (checkpoint / "model.safetensors").stat().st_size / 2**20
            rows = [_run(loader, checkpoint) for loader in LOADERS[family]]
        before, direct = rows
        assert before["checksum"] == direct["checksum"], f"{family}: the two loads hold different weights"
        print(f"{family}, {before['parameters'] / 1e6:.0f} M parameters, checkpoint {size:.0f} MiB (FP32); load in BF16")
        print(f"{'loader':>22} {'private MiB':>12} {'resident MiB':>13} {'held MiB':>9} {'load s':>7}")
        for row in rows:
            print(f"{row['loader']:>22} {row['peak_private_mib']:12.1f} {row['peak_resident_mib']:13.1f} "
                  f"{row['held_mib']:9.1f} {row['load_s']:7.2f}")
        print(f"private peak ratio {before['peak_private_mib'] / direct['peak_private_mib']:.2f}x, resident peak "
              f"ratio {before['peak_resident_mib'] / direct['peak_resident_mib']:.2f}x, time ratio "
              f"{before['load_s'] / direct['load_s']:.2f}x")
        report[family] = {"checkpoint_mib": round(size, 1), "rows": rows}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
