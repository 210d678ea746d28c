"""The run report's metric history: launches joined, re-run steps replaced, one-line errors.

The report of real runs is checked where those runs are: a resumed run in ``test_resume.py`` (its
curves span both launches and equal the uninterrupted run's), serving acceptance in
``test_serving_validation.py`` (the report's per-position table is what ``dflash-eval`` measures).
"""

from __future__ import annotations

import csv

import pytest

from dflash_train.cli.report import main as report_main
from dflash_train.training.history import keep_earlier_launch, read_history

LOSS, VAL = "train/dflash_loss", "val/accept_len"


def _write_launch(run_dir, rows):
    """One launch's ``csv/metrics.csv`` as Lightning writes it: ``step``, ``epoch`` and one column per metric."""
    path = run_dir / "csv" / "metrics.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", "step", LOSS, VAL])
        writer.writeheader()
        for step, loss, val in rows:
            writer.writerow({"epoch": 0, "step": step, LOSS: "" if loss is None else loss, VAL: "" if val is None else val})


def test_a_resumed_launch_replaces_the_steps_it_re_ran_and_keeps_the_rest(tmp_path):
    # launch 1 logged to step 39, its last checkpoint was at step 25; launch 2 resumed there and went on
    _write_launch(tmp_path, [(9, 5.0, None), (19, 4.0, None), (19, None, 1.5), (29, 3.0, None), (39, 2.5, None),
                             (39, None, 2.0)])
    assert keep_earlier_launch(tmp_path, resuming=True) == tmp_path / "csv" / "metrics.launch-1.csv"
    _write_launch(tmp_path, [(29, 3.1, None), (39, 2.6, None), (39, None, 2.1), (49, 2.2, None)])
    history = read_history(tmp_path)
    assert history.launches == 2 and history.launch_starts == (29,)
    assert history.get(LOSS).steps == (9, 19, 29, 39, 49) and history.get(LOSS).values == (5.0, 4.0, 3.1, 2.6, 2.2)
    assert history.get(VAL).steps == (19, 39) and history.get(VAL).values == (1.5, 2.1)


def test_launches_are_kept_in_order_past_nine(tmp_path):
    for launch in range(11):
        _write_launch(tmp_path, [(10 * launch + 9, float(launch), None)])
        if launch < 10:
            keep_earlier_launch(tmp_path, resuming=True)
    history = read_history(tmp_path)
    assert history.launches == 11 and history.get(LOSS).values == tuple(float(i) for i in range(11))


def test_a_fresh_run_keeps_nothing_aside(tmp_path):
    assert keep_earlier_launch(tmp_path, resuming=False) is None and not (tmp_path / "csv").exists()


def test_a_fresh_run_into_an_earlier_runs_directory_starts_its_own_history_and_deletes_nothing(tmp_path):
    _write_launch(tmp_path, [(9, 5.0, None)])  # an earlier run's two launches
    keep_earlier_launch(tmp_path, resuming=True)
    _write_launch(tmp_path, [(19, 4.0, None)])
    assert keep_earlier_launch(tmp_path, resuming=False) == tmp_path / "csv.earlier-1"
    assert sorted(p.name for p in (tmp_path / "csv.earlier-1").iterdir()) == ["metrics.csv", "metrics.launch-1.csv"]
    _write_launch(tmp_path, [(9, 3.0, None)])  # the fresh run's own first log step
    history = read_history(tmp_path)
    assert history.launches == 1 and history.get(LOSS).values == (3.0,)


@pytest.mark.parametrize("make", ["nothing", "empty"])
def test_a_directory_without_metrics_is_one_line(tmp_path, capsys, make):
    run_dir = tmp_path / "run"
    if make == "empty":
        run_dir.mkdir()
    assert report_main([str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"dflash-report: error: run directory {run_dir}" if make ==
                                                         "nothing" else f"dflash-report: error: {run_dir} holds no logged metrics")
    assert make == "nothing" or "exp_manager.create_csv_logger=true" in err


def test_a_position_never_reached_shows_as_nan_and_the_report_is_still_written(tmp_path):
    """conditional@k is undefined (NaN) when no round accepted k-1 tokens: the CSV holds ``nan``."""
    from dflash_train.training.report import write_run_report

    path = tmp_path / "csv" / "metrics.csv"
    path.parent.mkdir(parents=True)
    names = ["val/serving_mal", "val/serving_acceptance@1", "val/serving_acceptance@2", "val/serving_conditional@1",
             "val/serving_conditional@2"]
    path.write_text("epoch,step," + ",".join(names) + "\n0,9,1.0,0.0,0.0,0.0,nan\n")
    report = write_run_report(tmp_path).read_text()
    assert "| 1 | 0.000 | 0.000 |" in report and "| 2 | 0.000 | nan |" in report
    assert "No final export yet" in report and "never reached its first step" in report


def test_a_recipe_this_version_cannot_read_leaves_the_export_out_and_says_so(tmp_path, caplog):
    from dflash_train.training.report import write_run_report

    _write_launch(tmp_path, [(9, 5.0, None)])
    (tmp_path / "resolved_config.yaml").write_text("dflash:\n  variant: dflash\n  a_key_of_another_version: 1\n")
    with caplog.at_level("WARNING", logger="dflash_train.training.report"):
        report = write_run_report(tmp_path).read_text()
    assert "No final export yet" in report and "resolved_config.yaml cannot be read" in caplog.text
