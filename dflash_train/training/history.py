"""A run's logged metrics across all its launches: one series per metric, from Lightning's CSV log.

Lightning's ``CSVLogger`` starts ``csv/metrics.csv`` afresh in every launch (it deletes the file it
finds), so a resumed run would keep only its last launch's lines. Before a launch's loggers exist,
:func:`keep_earlier_launch` moves the previous launch's file aside as ``csv/metrics.launch-<n>.csv``
(rank 0 only; Lightning writes the CSV on rank 0 alone); a fresh run into a directory holding
another run's log moves that log aside whole (``csv.earlier-<n>``). :func:`read_history` joins the launches:
a resume goes back to the last checkpoint, so a later launch re-runs steps an earlier one may have
logged; for each metric the later launch's values replace the earlier's from the first step the
later launch logged that metric at. Every launch logs the step it starts from (``launch/start_step``: 0, or the
step of the checkpoint it resumed), which marks the resumes. The report (:mod:`dflash_train.training.report`) reads nothing
else: no second bookkeeping next to the logger's.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash_train.errors import InputFileError

METRICS_DIR = "csv"  # the CSV logger's directory under the run directory
METRICS_FILE = "metrics.csv"
EARLIER_LAUNCH = re.compile(r"metrics\.launch-(\d+)\.csv")
NOT_METRICS = ("step", "epoch")  # Lightning's own columns
LAUNCH_START_METRIC = "launch/start_step"  # logged once by every launch, at the step it starts from


def metrics_directory(run_dir: Path) -> Path:
    """Where the CSV logger of ``run_dir`` writes."""
    return Path(run_dir) / METRICS_DIR


def earlier_launch_files(run_dir: Path) -> list[Path]:
    """The CSV files kept from earlier launches, oldest first."""
    directory = metrics_directory(run_dir)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := EARLIER_LAUNCH.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def keep_earlier_launch(run_dir: Path, resuming: bool) -> Optional[Path]:
    """Before a launch's CSV logger starts (it deletes the ``metrics.csv`` it finds): when ``resuming``, move the
    previous launch's ``metrics.csv`` aside as the next ``metrics.launch-<n>.csv``; for a fresh run into a
    directory holding an earlier run's CSV log, move that whole log aside as ``csv.earlier-<n>``, so the new
    run's history starts empty and nothing is deleted. Returns what was moved (``None``: nothing was there)."""
    directory = metrics_directory(run_dir)
    current = directory / METRICS_FILE
    if resuming:
        if not current.is_file():
            return None
        kept = current.with_name(f"metrics.launch-{len(earlier_launch_files(run_dir)) + 1}.csv")
        os.replace(current, kept)
        return kept
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    n = 1
    while directory.with_name(f"{METRICS_DIR}.earlier-{n}").exists():
        n += 1
    kept = directory.with_name(f"{METRICS_DIR}.earlier-{n}")
    os.replace(directory, kept)
    return kept


@dataclass(frozen=True)
class Series:
    """One metric's logged values in step order."""

    steps: tuple[int, ...]
    values: tuple[float, ...]

    def last(self) -> float:
        """The latest value."""
        return self.values[-1]


@dataclass(frozen=True)
class MetricsHistory:
    """Every metric a run logged, joined across launches (see the module docstring)."""

    series: dict[str, Series]
    files: tuple[Path, ...]  # the CSV files read, oldest launch first
    launch_starts: tuple[int, ...] = ()  # the step each later launch resumed from

    @property
    def launches(self) -> int:
        """How many launches logged metrics (1 for a run never resumed)."""
        return len(self.files)

    def get(self, name: str) -> Optional[Series]:
        """The series of ``name``; ``None`` when it was never logged."""
        return self.series.get(name)

    def last(self, name: str) -> Optional[float]:
        """The latest value of ``name``; ``None`` when it was never logged."""
        found = self.series.get(name)
        return found.last() if found is not None else None

    def named(self, prefix: str) -> list[str]:
        """The logged metric names starting with ``prefix``, sorted (``@k`` suffixes by ``k``)."""

        def order(name: str):
            head, _, k = name.partition("@")
            return (head, int(k) if k.isdigit() else 0)

        return sorted((n for n in self.series if n.startswith(prefix)), key=order)


def _read_launch(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``metric -> [(step, value), ...]`` of one launch's CSV file (empty cells are metrics not logged in that row)."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step_text = row.get("step")
            if not step_text:
                continue
            step = int(float(step_text))
            for name, text in row.items():
                if name in NOT_METRICS or name is None or text in (None, ""):
                    continue
                out.setdefault(name, []).append((step, float(text)))  # NaN too: a logged "undefined"
    return out


def read_history(run_dir: Path) -> MetricsHistory:
    """The metrics of every launch of ``run_dir``, joined; :class:`InputFileError` (one line) when it has none."""
    run_dir = Path(run_dir)
    current = metrics_directory(run_dir) / METRICS_FILE
    files = earlier_launch_files(run_dir) + ([current] if current.is_file() else [])
    if not files:
        raise InputFileError(
            f"{run_dir} holds no logged metrics ({METRICS_DIR}/{METRICS_FILE}): point at a run directory of "
            "dflash-train with exp_manager.create_csv_logger=true (the default) that has trained at least one log step"
        )
    joined: dict[str, list[tuple[int, float]]] = {}
    starts: list[int] = []
    for i, path in enumerate(files):
        launch = _read_launch(path)
        start = launch.pop(LAUNCH_START_METRIC, None)
        if i > 0 and (start or launch):  # a launch logged before launch/start_step existed: its first step
            starts.append(int(start[0][1]) if start else min(points[0][0] for points in launch.values()))
        for name, points in launch.items():
            first = points[0][0]
            joined[name] = [p for p in joined.get(name, []) if p[0] < first] + points
    series = {name: Series(tuple(s for s, _ in points), tuple(v for _, v in points)) for name, points in joined.items()}
    return MetricsHistory(series, tuple(files), tuple(starts))
