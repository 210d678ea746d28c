"""Progress of long per-sample work: tqdm's bar on a terminal, a line every N items and one at the end in a log."""

import io
import logging

from dflash_train.progress import progress, progress_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_every_n_items_and_one_at_the_end(caplog):
    seen = []
    with caplog.at_level(logging.INFO, logger="dflash_train.progress"):
        for item in progress(range(10), "dflash-eval", total=10, every=4, stream=io.StringIO()):
            seen.append(item)
    assert seen == list(range(10))
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines] == [
        "dflash-eval: 4/10 samples", "dflash-eval: 8/10 samples", "dflash-eval: 10/10 samples"]
    assert "ETA" in lines[0] and "ETA" not in lines[-1]


def test_an_item_counts_when_the_caller_is_done_with_it(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_train.progress"):
        items = progress(range(5), "dflash-labels", every=2, stream=io.StringIO())
        next(items), next(items)
        assert caplog.records == []  # the second item is still being worked on
        next(items)
        assert [r.getMessage().split(",")[0] for r in caplog.records] == ["dflash-labels: 2 samples"]


def test_a_terminal_gets_a_bar_with_the_count():
    terminal = Terminal()
    assert list(progress(range(7), "dflash-eval", total=7, stream=terminal)) == list(range(7))
    assert "dflash-eval" in terminal.getvalue() and "7/7" in terminal.getvalue()


def test_the_line_gives_the_rate_and_the_time_left():
    assert progress_line("dflash-eval", 50, 200, "sample", 20.0) == \
        "dflash-eval: 50/200 samples, 2.50 samples/s, ETA 0:01:00"
    assert progress_line("dflash-labels", 3, None, "sample", 2.0) == "dflash-labels: 3 samples, 1.50 samples/s"
    assert progress_line("dflash-exposure", 2, 4, "batch", 1.0) == "dflash-exposure: 2/4 batches, 2.00 batches/s, ETA 0:00:01"


def test_a_transient_part_logs_no_closing_line_and_leaves_no_bar(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_train.progress"):
        assert list(progress(range(5), "serving validation", every=2, stream=io.StringIO(), transient=True)) == [0, 1, 2, 3, 4]
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["serving validation: 2 samples",
                                                                      "serving validation: 4 samples"]
    terminal = Terminal()
    list(progress(range(3), "serving validation", total=3, stream=terminal, transient=True))
    assert terminal.getvalue().endswith("\r") and "\n" not in terminal.getvalue()  # the bar cleared its line
