# mpjobs: `make test` installs everything into .venv, then runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= api,worker,dev,bench
comma := ,
INSTALLED := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: install run test test-fast lint docs bench bench-tools train-example clean redis-server chromium node

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

install: $(INSTALLED)

# The whole stack: a local redis-server unless REDIS_URL is set, the API, one worker.
run: install
	./scripts/run-stack.sh

# Tests start their own redis-server on a free port; install Debian's if missing.
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

# The dashboard test drives Debian's headless Chromium through Debian's chromedriver.
chromium:
	@(command -v chromium >/dev/null && command -v chromedriver >/dev/null) || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

# The dashboard's stream reader (app/static/js/api.js) is also run by Node (18 or later: its fetch).
node:
	@command -v node >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs)

# Two test processes, a file each at a time (module fixtures stay whole), in the order tests/conftest.py sets
# (the minute-long files first; xdist would reorder by test count): the service tests spend much of
# their time waiting on workers in other processes, so the suite takes about 11 minutes here, not 18.
test: install redis-server chromium node bench-tools lint
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The fast loop: what needs no process but a redis-server, and trains for seconds at most (under two minutes here).
test-fast: install redis-server
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow and not processes"

# The module tree in docs/architecture.md, from each module's first docstring line (tests/test_docs.py checks it).
docs: install
	$(PY) -m scripts.module_tree --write

lint: install
	$(VENV)/bin/ruff check app worker tests bench mpjobs scripts
	$(VENV)/bin/mypy

# Load generators for the benchmarks: wrk, and redis-benchmark (Debian's redis-tools).
bench-tools:
	@(command -v wrk >/dev/null && command -v redis-benchmark >/dev/null) || \
		(apt-get update -qq && apt-get install -y -qq wrk redis-tools)

# Every CPU benchmark, one after another, in one table (docs/benchmarks.md records it).
bench: install redis-server bench-tools
	$(PY) -m bench

# Trains the example spec locally, with no Redis: one JSON line per step.
train-example: install
	$(PY) -m worker.train examples/mlp_mixed_float16.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
