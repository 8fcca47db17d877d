# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the pinned torch from that index first
# (the CPU build, where pip's default on Linux is the multi-GB CUDA one).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install -q --index-url $(TORCH_INDEX) "$$(grep '^torch==' requirements-dev.txt)")
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m propagators.demo $(ARGS)

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
