# Fresh machine: `make demo` (set up + run the demo job) and `make test` (set up + run the tests).
VENV := .venv
STAMP := $(VENV)/.setup-complete
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt scripts/setup.sh
	bash scripts/setup.sh

demo: $(STAMP)
	$(PY) -m dflash_train.demo

test: $(STAMP)
	$(PY) -m pytest -q
