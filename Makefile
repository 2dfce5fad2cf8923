# Two commands a newcomer needs: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
# Override for a GPU build, e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed

.PHONY: demo test lint unit setup clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: a loose requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# The dashboard test drives Debian's chromium (headless). Installed here when missing and
# we are root with apt-get; otherwise that test fails saying how to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium for the dashboard test (apt-get install -y chromium)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "note: chromium is missing; run 'apt-get install -y chromium' as root"; fi; }

# Two workers, one test file each at a time (module fixtures stay within a worker); the
# slowest tests are printed at the end. See docs/testing.md.
PYTEST_WORKERS ?= 2
unit: $(STAMP) browser
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile \
	  --durations=25 $(PYTEST_ARGS)

test: lint unit

demo: $(STAMP)
	$(BIN)/tandem demo

clean:
	rm -rf .tandem .pytest_cache .ruff_cache
