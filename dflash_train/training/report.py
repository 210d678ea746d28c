"""One readable report per run: ``report.md`` and its PNG figures in the run directory.

Written by rank 0 when training ends (also when it was preempted) and on demand by ``dflash-report
RUN_DIR``. Everything in it comes from what the run already wrote: the logged metrics of every launch
(:mod:`dflash_train.training.history`), ``run_info.json`` and ``resolved_config.yaml`` (the
provenance record), and the export's ``training_info``. Figures:

* ``report/acceptance.png``: teacher-forced ``accept_len`` (training and validation) and serving MAL
  against step on one axis, the train/serve gap at a glance; a dashed line where a launch resumed;
* ``report/training.png``: the loss and its parts (DFlash2: base and selector), validation loss,
  learning rate, tokens/s, and skipped samples and steps by reason (cumulative counts);
* ``report/per_position.png``: the last validation's serving acceptance per draft position.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf.errors import OmegaConfBaseException

from dflash_train.atomic import atomic_write_text
from dflash_train.config import read_resolved_config
from dflash_train.config.schema import RunConfig
from dflash_train.errors import InputFileError
from dflash_train.training.history import MetricsHistory, read_history
from dflash_train.training.provenance import RESOLVED_CONFIG_FILE, RUN_INFO_FILE

log = logging.getLogger(__name__)

REPORT_FILE = "report.md"
FIGURE_DIR = "report"
ACCEPTANCE_FIGURE = "acceptance.png"
TRAINING_FIGURE = "training.png"
PER_POSITION_FIGURE = "per_position.png"

TRAIN_ACCEPT_LEN = "train/accept_len"
VAL_ACCEPT_LEN = "val/accept_len"
SERVING_MAL = "val/serving_mal"
TRAIN_LOSS = "train/dflash_loss"
VAL_LOSS = "val/dflash_loss"
LEARNING_RATE = "train/lr"
TOKENS_PER_SECOND = "train/tokens_per_second"
SKIP_PREFIXES = ("train/skipped/", "data/skipped/")
SERVING_ACCEPTANCE = "val/serving_acceptance@"
SERVING_CONDITIONAL = "val/serving_conditional@"


@dataclass(frozen=True)
class RunRecord:
    """What the report says about a run besides its metrics: its recipe, provenance and export."""

    run_dir: Path
    run: Optional[RunConfig]  # from resolved_config.yaml; None when the run never reached its first step
    info: dict  # run_info.json (empty when missing)
    export_dir: Optional[Path]  # the final export, when it exists
    export_step: Optional[int]  # the global step the export's weights represent
    export_choice: Optional[dict] = None  # training_info.exported_checkpoint: how that step was chosen

    @classmethod
    def read(cls, run_dir: Path) -> "RunRecord":
        """The record of ``run_dir`` as the run left it."""
        run_dir = Path(run_dir)
        run = None
        if (run_dir / RESOLVED_CONFIG_FILE).is_file():
            try:
                run = read_resolved_config(run_dir / RESOLVED_CONFIG_FILE)
            except (OmegaConfBaseException, ValueError) as err:  # written by another version of this project
                log.warning("report: %s cannot be read (%s); the report has no export or serve command",
                            run_dir / RESOLVED_CONFIG_FILE, str(err).splitlines()[0])
        info = json.loads((run_dir / RUN_INFO_FILE).read_text()) if (run_dir / RUN_INFO_FILE).is_file() else {}
        export_dir, export_step, export_choice = None, None, None
        if run is not None:
            configured = Path(run.dflash.output_dir)
            candidate = configured if configured.is_absolute() else run_dir / configured
            if (candidate / "config.json").is_file():
                export_dir = candidate
                training_info = json.loads((candidate / "config.json").read_text()).get("training_info") or {}
                export_step = training_info.get("global_step")
                export_choice = training_info.get("exported_checkpoint")
        return cls(run_dir, run, info, export_dir, export_step, export_choice)

    @property
    def variant(self) -> str:
        return self.run.dflash.variant if self.run is not None else str(self.info.get("variant", "?"))


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _value_at(history: MetricsHistory, name: str, step: int) -> Optional[float]:
    series = history.get(name)
    if series is None or step not in series.steps:
        return None
    return series.values[series.steps.index(step)]


def _mark_launches(ax, history: MetricsHistory) -> None:
    for i, step in enumerate(history.launch_starts):
        ax.axvline(step, color="grey", linestyle="--", linewidth=0.8, label="resumed" if i == 0 else None)


def _plot_series(ax, history: MetricsHistory, name: str, label: str, **style) -> bool:
    series = history.get(name)
    if series is None:
        return False
    ax.plot(series.steps, series.values, label=label, **style)
    return True


def acceptance_figure(history: MetricsHistory, title: str):
    """Teacher-forced accept_len (train and val) and serving MAL against step, on one axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    _plot_series(ax, history, TRAIN_ACCEPT_LEN, "train accept_len (teacher-forced)", alpha=0.35, linewidth=1)
    _plot_series(ax, history, VAL_ACCEPT_LEN, "val accept_len (teacher-forced)", marker="o")
    _plot_series(ax, history, SERVING_MAL, "serving MAL (val, reference decoder)", marker="s")
    _mark_launches(ax, history)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per round")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def training_figure(history: MetricsHistory):
    """Four panels: loss and its parts, learning rate, tokens/s, skipped samples and steps by reason."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    loss, lr, speed, skips = axes.flat
    _plot_series(loss, history, TRAIN_LOSS, "train loss")
    for name in history.named("train/"):
        if name.endswith("_loss") and name != TRAIN_LOSS:
            _plot_series(loss, history, name, name.removeprefix("train/").replace("_", " "), linewidth=1)
    _plot_series(loss, history, VAL_LOSS, "val loss", marker="o")
    loss.set_title("loss")
    _plot_series(lr, history, LEARNING_RATE, "learning rate")
    lr.set_title("learning rate")
    _plot_series(speed, history, TOKENS_PER_SECOND, "tokens/s")
    speed.set_title("throughput (tokens/s over all ranks)")
    reasons = [n for prefix in SKIP_PREFIXES for n in history.named(prefix) if any(history.get(n).values)]
    for name in reasons:
        _plot_series(skips, history, name, name, drawstyle="steps-post")
    skips.set_title("skipped so far, by reason")
    if not reasons:
        skips.text(0.5, 0.5, "nothing skipped", ha="center", va="center", transform=skips.transAxes)
    for ax in axes.flat:
        _mark_launches(ax, history)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def per_position_figure(history: MetricsHistory, step: int):
    """The last validation's serving acceptance per draft position (accepted@k / rounds and conditional)."""
    import matplotlib.pyplot as plt

    acceptance = [_value_at(history, n, step) for n in history.named(SERVING_ACCEPTANCE)]
    conditional = [_value_at(history, n, step) for n in history.named(SERVING_CONDITIONAL)]
    ks = list(range(1, len(acceptance) + 1))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(ks, acceptance, marker="o", label="accepted@k / rounds")
    ax.plot(ks, conditional, marker="o", label="conditional: accepted@k / accepted@k-1")
    ax.set_xticks(ks)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("acceptance")
    ax.set_title(f"serving acceptance per position, validation at step {step}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"{FIGURE_DIR}/{path.name}"


def _validation_table(history: MetricsHistory) -> list[str]:
    steps = sorted(set().union(*(history.get(n).steps for n in (VAL_ACCEPT_LEN, SERVING_MAL) if history.get(n))))
    if not steps:
        return ["No validation ran (no `data.validation_ds`, or training stopped before the first one)."]
    lines = ["| step | val loss | val accept_len (teacher-forced) | serving MAL | serving acceptance@1 | gap |",
             "|---:|---:|---:|---:|---:|---:|"]
    for step in steps:
        forced, served = _value_at(history, VAL_ACCEPT_LEN, step), _value_at(history, SERVING_MAL, step)
        gap = forced - served if forced is not None and served is not None else None
        lines.append(f"| {step} | {_fmt(_value_at(history, VAL_LOSS, step))} | {_fmt(forced)} | {_fmt(served)} | "
                     f"{_fmt(_value_at(history, SERVING_ACCEPTANCE + '1', step))} | {_fmt(gap)} |")
    lines.append("")
    lines.append("*gap*: teacher-forced accept_len minus serving MAL, both tokens per round. Teacher-forced: "
                 "blocks at sampled anchors of the validation batches, scored against the labels; serving: the "
                 "rounds the reference speculative decoder meets on the first validation records, the figure "
                 "vLLM's acceptance counters report.")
    return lines


def _provenance_lines(record: RunRecord) -> list[str]:
    info = record.info
    if not info:
        return [f"No `{RUN_INFO_FILE}` (the run never reached its first step)."]
    target = info.get("target") or {}
    versions = ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items() if v)
    blend = info.get("data") or {}
    lines = [
        f"- dflash_train revision: `{info.get('dflash_train_revision')}`",
        f"- target: `{target.get('path', target)}`" + (f" (weights sha256 `{target['weights_sha256'][:16]}…`)"
                                                        if target.get("weights_sha256") else ""),
        f"- variant: {info.get('variant')}; seed {info.get('seed')}; world size {info.get('world_size')}; "
        f"last launch started at step {info.get('start_step')}",
        f"- warm start: {info.get('warm_start')}",
    ]
    for split, inputs in blend.items():
        lines.append(f"- {split} data: " + "; ".join(f"`{i.get('path')}` ({i.get('type')}, weight {i.get('weight')})"
                                                   for i in inputs))
    lines.append(f"- versions: {versions}")
    return lines


def write_run_report(run_dir: Path, serve_target: Optional[str] = None) -> Path:
    """Write ``report.md`` and its figures into ``run_dir`` (see the module docstring); returns the report's path.

    ``serve_target``: the vLLM-ready target directory, for the serve command (``dflash-export-target`` writes it).
    """
    import matplotlib

    matplotlib.use("Agg")
    from dflash_train.draft.family import serving_lines
    from dflash_train.variants import variant_named

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputFileError(f"run directory {run_dir} does not exist: pass the directory dflash-train wrote")
    history = read_history(run_dir)
    record = RunRecord.read(run_dir)
    figures = run_dir / FIGURE_DIR
    k = None
    if record.run is not None:
        k = variant_named(record.variant).speculative_tokens(record.run.dflash)
    title = f"{record.variant}" + (f", K={k}" if k else "") + ": teacher-forced accept_len vs served MAL"
    last_step = max(max(s.steps) for s in history.series.values())
    launches = history.launches
    lines = [
        f"# Training report: {run_dir.name}",
        "",
        f"{record.variant} draft; last logged step {last_step}; "
        + (f"{launches} launches (resumed at step {', '.join(map(str, history.launch_starts))})" if launches > 1
           else "one launch") + ".",
        "",
        "## Acceptance",
        "",
        f"![acceptance]({_save(acceptance_figure(history, title), figures / ACCEPTANCE_FIGURE)})",
        "",
        *_validation_table(history),
        "",
        "## Training",
        "",
        f"![training]({_save(training_figure(history), figures / TRAINING_FIGURE)})",
        "",
        f"Last logged: train loss {_fmt(history.last(TRAIN_LOSS), 4)}, train accept_len "
        f"{_fmt(history.last(TRAIN_ACCEPT_LEN))}, learning rate {_fmt(history.last(LEARNING_RATE), 6)}, "
        f"{_fmt(history.last(TOKENS_PER_SECOND), 0)} tokens/s.",
        "",
    ]
    skipped = [f"{n.split('/', 1)[1]} {int(history.last(n))}" for prefix in SKIP_PREFIXES for n in history.named(prefix)
               if history.last(n)]
    lines += ["Skipped: " + (", ".join(skipped) if skipped else "nothing") + ".", ""]
    serving = history.get(SERVING_MAL)
    if serving is not None and history.named(SERVING_ACCEPTANCE):
        step = serving.steps[-1]
        lines += ["## Per-position acceptance (last validation)", "",
                  f"![per position]({_save(per_position_figure(history, step), figures / PER_POSITION_FIGURE)})", "",
                  "| k | accepted@k / rounds | conditional |", "|---:|---:|---:|"]
        for k_name, c_name in zip(history.named(SERVING_ACCEPTANCE), history.named(SERVING_CONDITIONAL)):
            lines.append(f"| {k_name.rsplit('@', 1)[1]} | {_fmt(_value_at(history, k_name, step))} | "
                         f"{_fmt(_value_at(history, c_name, step))} |")
        lines.append("")
    lines += ["## Export", ""]
    if record.export_dir is None or record.run is None:
        lines.append("No final export yet (training has not finished; the last checkpoint resumes it).")
    else:
        choice = record.export_choice or {}
        chosen = (f" (the best validated checkpoint by `{choice['monitor']}`, {choice['mode']}: "
                  f"{choice['score']:.4f})" if choice.get("choice") == "best" else "")
        lines.append(f"`{record.export_dir}`: the weights of step {record.export_step}{chosen}.")
        lines.append("")
        commands = serving_lines(variant_named(record.variant), record.run.dflash, record.export_dir, serve_target)
        lines += ["```", *commands, "```"]
    lines += ["", "## Provenance", "", *_provenance_lines(record), "",
              f"Metrics read from: {', '.join(f'`{p.relative_to(run_dir)}`' for p in history.files)}.", ""]
    path = run_dir / REPORT_FILE
    atomic_write_text(path, "\n".join(lines))
    return path
