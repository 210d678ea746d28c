"""Driver for the bad-input tests: ``python tests/train_cli_rows.py ROWS.json RESULTS.json``.

Runs ``dflash-train``'s real entry point (Hydra's ``@hydra.main``, the same ``main`` the console
script calls) once per row in this one process, with that row's command-line arguments, and
writes each row's exit code and everything it printed on stderr and stdout (``--cfg``: the config).
One interpreter start for the whole matrix instead of one per row.
"""

import contextlib
import io
import json
import sys
from pathlib import Path


def main() -> None:
    rows_file, results_file = map(Path, sys.argv[1:3])
    rows = json.loads(rows_file.read_text())
    from hydra.core.global_hydra import GlobalHydra

    from dflash_train.cli.train import main as train_main

    results = {}
    for name, argv in rows:
        GlobalHydra.instance().clear()
        sys.argv = ["dflash-train", *argv]
        stderr, stdout, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            try:
                train_main()
            except SystemExit as exit:  # what the interpreter would print and return at exit
                code = exit.code
        if isinstance(code, str):
            stderr.write(code + "\n")
            code = 1
        results[name] = {"code": code or 0, "stderr": stderr.getvalue(), "stdout": stdout.getvalue()}
    results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
