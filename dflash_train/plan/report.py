"""The plan's result: memory by category against the GPU, FLOPs, collectives and the roofline bound,
as one JSON object and as a readable table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from dflash_train.plan.flops import GPU
from dflash_train.plan.memory import CATEGORIES
from dflash_train.plan.step import PHASES

GIB = 2**30
CONTEXT_BYTES = int(0.75 * GIB)  # CUDA context and cuBLAS/cuDNN workspaces, per process
NCCL_BYTES = int(0.5 * GIB)  # NCCL's communicator buffers, per process
FRAGMENTATION = 0.10  # the caching allocator's reserved-but-unused share, on top of the peak
ALLOWANCE_NOTE = (f"allowance for what fake tensors cannot see: CUDA context {CONTEXT_BYTES / GIB:.2f} GiB + NCCL "
                  f"buffers {NCCL_BYTES / GIB:.2f} GiB + allocator fragmentation {FRAGMENTATION:.0%} of the peak")


@dataclass
class Plan:
    """One plan: the run it describes, its per-rank peak memory, cost and bound on one GPU."""

    gpu: str
    gpu_figures: dict
    world_size: int
    gpus_per_node: int
    variant: str
    num_anchors: int
    batch_rows: int
    row_positions: int
    supervised_tokens: int
    max_steps: Optional[int]
    memory_peak_bytes: dict
    memory_high_water_bytes: dict  # each category's own highest, wherever in the step it was
    flops: dict
    bytes_moved: dict
    roofline_seconds: dict
    collective_bytes: dict
    collective_group_bytes: dict  # the same bytes by the size of the group they ran over ("8": an EP group of 8)
    collective_seconds: float
    knobs: dict = field(default_factory=dict)
    advice: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The step's peak per rank (the counted categories)."""
        return sum(self.memory_peak_bytes.values())

    @property
    def allowance_bytes(self) -> int:
        """What the device holds beside the counted tensors (:data:`ALLOWANCE_NOTE`)."""
        return CONTEXT_BYTES + NCCL_BYTES + int(FRAGMENTATION * self.peak_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.peak_bytes + self.allowance_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.gpu_figures["memory_bytes"]

    @property
    def step_seconds(self) -> float:
        """Lower bound of one step: compute (the sum of per-operator rooflines) or the collectives, whichever is
        longer (perfect overlap assumed)."""
        return max(sum(self.roofline_seconds.values()), self.collective_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Upper bound of LLM positions trained per second over all ranks."""
        return self.batch_rows * self.row_positions * self.world_size / self.step_seconds

    @property
    def mfu(self) -> float:
        """The model-FLOPs utilisation the bound implies (at most 1)."""
        return sum(self.flops.values()) / (self.step_seconds * self.gpu_figures["bf16_flops"])

    def to_json(self) -> dict:
        """Everything, raw figures and the derived ones, as plain JSON values."""
        data = asdict(self)
        data.update(peak_bytes=self.peak_bytes, allowance_bytes=self.allowance_bytes, allowance=ALLOWANCE_NOTE,
                    needed_bytes=self.needed_bytes, fits=self.fits, step_seconds_lower_bound=self.step_seconds,
                    tokens_per_second_upper_bound=self.tokens_per_second, implied_mfu=self.mfu,
                    wall_seconds_lower_bound=None if not self.max_steps else self.max_steps * self.step_seconds)
        return data

    def table(self) -> list[str]:
        """The readable report, one line per figure."""
        g = self.gpu_figures
        lines = [f"dflash-plan: {self.variant}, {self.num_anchors} anchors, {self.batch_rows} rows x "
                 f"{self.row_positions} positions per rank, {self.world_size} ranks ({self.gpus_per_node} per node), "
                 f"{g['name']}",
                 "peak memory per rank (the step's 2nd iteration):"]
        lines += [f"  {name:<20} {self.memory_peak_bytes.get(name, 0) / GIB:9.2f} GiB" for name in CATEGORIES]
        lines += [f"  {'counted peak':<20} {self.peak_bytes / GIB:9.2f} GiB",
                  f"  {'allowance':<20} {self.allowance_bytes / GIB:9.2f} GiB ({ALLOWANCE_NOTE})",
                  f"  {'needed':<20} {self.needed_bytes / GIB:9.2f} GiB of {g['memory_bytes'] / GIB:.1f} GiB: "
                  + ("fits" if self.fits else "DOES NOT FIT")]
        lines += [f"  to fit: {hint}" for hint in self.advice]
        lines.append(f"cost per rank per step (roofline bound: {g['bf16_flops'] / 1e12:.0f} TFLOP/s dense BF16, "
                     f"{g['hbm_bytes_per_s'] / 1e12:.2f} TB/s HBM):")
        for phase in PHASES:
            lines.append(f"  {phase:<14} {self.flops.get(phase, 0) / 1e12:10.3f} TFLOP  "
                         f"{self.bytes_moved.get(phase, 0) / 1e9:9.2f} GB  >= {self.roofline_seconds.get(phase, 0) * 1e3:9.2f} ms")
        kinds = ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sorted(self.collective_bytes.items())) or "none"
        groups = ", ".join(f"{v / 1e9:.3f} GB over {k} ranks" for k, v in self.collective_group_bytes.items())
        lines.append(f"  collectives    {kinds} ({groups or 'none'})  >= {self.collective_seconds * 1e3:.2f} ms")
        wall = f"; {self.max_steps} steps >= {self.max_steps * self.step_seconds / 3600:.2f} h" if self.max_steps else ""
        lines.append(f"bound (not a measurement): step >= {self.step_seconds * 1e3:.1f} ms, implied MFU <= "
                     f"{self.mfu:.0%}, <= {self.tokens_per_second:,.0f} tokens/s{wall}")
        return lines


def gpu_figures(gpu: GPU) -> dict:
    """The GPU's figures as written into the plan."""
    return asdict(gpu)
