# Two entry points a newcomer types: `make demo` and `make test`. Both build .venv themselves.
# torch: TORCH_PIN below is installed only when no torch is importable, so a machine that already has one
# (a CUDA build, say) keeps it. Where pip has a local CPU wheel (this project's machines) that is the CPU
# build; from PyPI on Linux x86 it is the multi-GB CUDA build: install the CPU one first where you want it
# (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu).
# `make test-min` (not part of `make test` or CI) checks the dependency floors in its own .venv-min.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# the suite runs on two pytest workers (pytest-xdist), whole files each so a module's shared rank launches run once
PYTEST_JOBS ?= 2
PYTEST_ARGS ?= -q -n $(PYTEST_JOBS) --dist loadfile
ARGS ?=

# test-min: triton, numba and numpy at exactly pyproject.toml's floors (tests/test_versions.py fails if
# MIN_PINS and those floors differ). torch: a torch from PyPI is a multi-GB CUDA build, so .venv-min
# gets the same CPU torch as .venv (TORCH_MIN; where pip has no local CPU wheel of it, point TORCH_MIN
# at one); torch's own floor is not run here. Where a wheel of the floor torch is at hand:
#   make test-min TORCH_MIN=torch==2.8.0 MIN_AT_FLOORS="triton numba numpy torch"
MIN_VENV ?= .venv-min
MIN_PINS ?= triton==3.4.0 numba==0.59.0 numpy==1.24.0
MIN_AT_FLOORS ?= triton numba numpy
TORCH_MIN ?= $(TORCH_PIN)
MIN_TESTS ?= tests/test_versions.py tests/test_triton_compile.py tests/test_cpu_ops.py \
	tests/test_cpu_ops_convert.py tests/test_cpu_ops_cores.py tests/test_cpu_selective_adamw.py \
	tests/test_numba_cache.py

.PHONY: install install-dev demo bench-results test test-fast test-min lint bench mutation mutation-sample clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench,notebooks,dev]"
	@touch $@

install: $(VENV)/.installed

# the demo writes to the untracked out/demo/; bench-results makes every committed result under bench/results/ again
# (bench/refresh.py: hours on 2 cores; ARGS="--only e2e.json" for one; a clean tree, so each records its commit)
demo: install
	$(PY) -m bench.e2e --demo --out out/demo $(ARGS)

bench-results: install
	$(PY) -m bench.refresh $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# the edit-test loop (docs/testing.md): every single-process case. The tiers are pytest markers (pyproject.toml):
# ranks (starts rank processes), subprocess (runs examples, studies, tools or a launcher), notebook, bench; all are
# left out here (CI runs them all with `make test`); tests/test_markers.py checks that a test needing one has it
FAST_SELECT ?= -m "not ranks and not subprocess and not notebook and not bench"
test-fast: install
	$(PY) -m pytest $(PYTEST_ARGS) $(FAST_SELECT)

# the floors: version checks, every Triton kernel compiled for sm_90 with the floor triton, the numba
# kernel tests with the floor numba and numpy (~30 s once installed; the first run, ~1.5 min, downloads
# ~220 MB). At the floor a register spill is a warning, not a failure (test_triton_compile.py). The
# project runs from the source tree (not installed); numba's cache goes to .venv-min, apart from .venv's.
test-min:
	@test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q "$(TORCH_MIN)" $(MIN_PINS) "pytest>=7" "pytest-xdist>=3" "hypothesis>=6"
	$(MIN_VENV)/bin/python -c "import sys, torch, triton, numba, numpy; print('python', sys.version.split()[0], \
	'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"
	PYTHONPATH=$(CURDIR) NUMBA_CACHE_DIR=$(abspath $(MIN_VENV))/numba-cache ZENFLOW_AT_FLOORS="$(MIN_AT_FLOORS)" \
	$(MIN_VENV)/bin/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) $(MIN_TESTS)

lint: install
	$(VENV)/bin/ruff check .

# mutation testing of optim.py, host.py, link/ and schedule.py against the fast optimizer tests
# ([tool.mutmut] in pyproject.toml); incremental: a second run re-tests what changed. Hours on 2 cores.
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
	rm -rf $(VENV) $(MIN_VENV) *.egg-info .pytest_cache .ruff_cache mutants
