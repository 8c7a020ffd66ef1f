# Two entry points a newcomer types: `make demo` and `make test`. Both build .venv themselves.
# torch: the CPU build pinned below is installed only when no torch is importable, so a machine
# that already has one (a CUDA build, say) keeps it and nothing multi-GB is ever downloaded.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?= -q
ARGS ?=

.PHONY: install install-dev demo test lint bench mutation mutation-sample clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench,notebooks,dev]"
	@touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m bench.e2e --demo $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

# mutation testing of optim.py, host.py, link.py and schedule.py against the fast optimizer tests
# ([tool.mutmut] in pyproject.toml); incremental: a second run re-tests what changed. ~3 h on 2 cores.
mutation: install
	$(PY) -m pip install -q "mutmut>=3.8,<4"
	$(VENV)/bin/mutmut run --max-children $(or $(JOBS),2)
	$(PY) tools/mutation_score.py

# the same score estimated from a seeded uniform sample of the mutants (SIZE, default 700: ~1 h), with
# its 95% interval; needs the mutants generated (a `make mutation` interrupted once it runs mutants)
mutation-sample: install
	$(PY) -m pip install -q "mutmut>=3.8,<4"
	$(PY) tools/mutation_sample.py --size $(or $(SIZE),700) --jobs $(or $(JOBS),2)

bench: install
	$(PY) -m bench.kernels
	$(PY) -m bench.cpu_adam

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache mutants
