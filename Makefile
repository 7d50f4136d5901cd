# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The install is keyed on pyproject.toml's content, so both are quick once installed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev,hf,data,llm]"
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	$(BIN)/steptune demo

lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy src/steptune/core

# Two passes (tests/conftest.py marks which tests are `serial`): pure computation on 2 xdist workers, then the
# tests that start processes or read a clock, alone. Both passes always run; the target fails if either did.
test: lint
	@status=0; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not serial" -n 2 --dist loadfile || status=$$?; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m serial || status=$$?; \
	exit $$status

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
