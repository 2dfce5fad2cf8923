# Two commands a newcomer needs: `make demo` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV ?= .venv
# Override for a GPU build, e.g. TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>".
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed

.PHONY: demo test lint unit setup clean

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

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test: lint unit

demo: $(STAMP)
	$(BIN)/tandem demo

clean:
	rm -rf .tandem .pytest_cache .ruff_cache
