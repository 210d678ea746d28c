"""Progress of long per-sample work (evaluation, labelling, exposure): a bar on a terminal, a line every N items in a log.

A person at a terminal gets tqdm's bar with the rate and, when the total is known, the ETA. Output
that goes to a file (a SLURM log, ``tee``) gets one INFO line every ``every`` items and one at the
end, instead of a bar's carriage returns or a line per item.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from typing import IO, Iterable, Iterator, Optional, TypeVar

Item = TypeVar("Item")
LOG_EVERY = 25

log = logging.getLogger(__name__)


def progress_line(what: str, done: int, total: Optional[int], unit: str, seconds: float) -> str:
    """``"<what>: 50/200 samples, 2.50 samples/s, ETA 0:01:00"`` (no total: no ETA)."""
    rate = done / seconds if seconds > 0 else 0.0
    units = unit + ("es" if unit.endswith(("s", "ch")) else "s")
    line = f"{what}: {done}" + (f"/{total}" if total is not None else "") + f" {units}, {rate:.2f} {units}/s"
    if total is not None and rate > 0 and done < total:
        line += f", ETA {timedelta(seconds=round((total - done) / rate))}"
    return line


def progress(items: Iterable[Item], what: str, total: Optional[int] = None, unit: str = "sample",
             every: int = LOG_EVERY, stream: Optional[IO[str]] = None, transient: bool = False) -> Iterator[Item]:
    """``items`` unchanged, reporting how many the caller has finished (see the module docstring).

    An item counts as done when the caller asks for the next one. ``stream`` (default stderr)
    decides between the bar (a terminal) and the log lines. ``transient``: a part of larger work
    that reports its own result (serving validation inside training): the bar disappears when done
    and no closing line is logged.
    """
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=what, total=total, unit=unit, file=stream, dynamic_ncols=True, leave=not transient)
        return
    start, done = time.perf_counter(), 0
    for item in items:
        yield item
        done += 1
        if done % every == 0:
            log.info(progress_line(what, done, total, unit, time.perf_counter() - start))
    if done % every and not transient:
        log.info(progress_line(what, done, total, unit, time.perf_counter() - start))
