# The README's two commands: `make quickstart` and `make test`.
# Everything installs into .venv with pinned versions (constraints.txt pins torch==2.13.0 so
# pip takes the local CPU build instead of a multi-GB CUDA one).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# one busy thread per process: two are 2-10x slower on 2-core machines
export OMP_WAIT_POLICY := PASSIVE

.PHONY: install quickstart test test-slow bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt -e '.[dev,sd,quant]'
	touch $(STAMP)

quickstart: install
	$(VENV)/bin/steadydiff train configs/digits_cond.yaml --out runs/quickstart
	$(VENV)/bin/steadydiff eval runs/quickstart --out runs/quickstart/eval.json

# one pytest worker per core (pytest-xdist), whole test files to a worker: a file's
# module-scoped fixtures (tiny SD folders, trained runs) are built once
test: install
	$(PY) -m pytest -q -n auto --dist loadfile

test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
