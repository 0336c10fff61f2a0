# The two commands of the README, plus lint. Each keeps a virtualenv in .venv and reinstalls
# only when the packaging files change (a stamp file per set of extras). pip runs with -qq: it
# still prints errors, not the warnings about unreachable extra indexes some machines have.

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP_INSTALL := $(VPY) -m pip install -qq --disable-pip-version-check -c constraints.txt
PACKAGING := setup.cfg setup.py pyproject.toml constraints.txt
PYTEST_ARGS ?=

.PHONY: demo test lint bench clean

demo: $(VENV)/.stamp-base
	$(VPY) examples/demo.py

test: $(VENV)/.stamp-test
	$(VPY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.stamp-bench
	$(VPY) -m benchmarks $(BENCH_ARGS)

lint: $(VENV)/.stamp-dev
	$(VENV)/bin/ruff check .

$(VENV)/.stamp-base: EXTRAS :=
$(VENV)/.stamp-test: EXTRAS := [test]
$(VENV)/.stamp-dev: EXTRAS := [dev]
$(VENV)/.stamp-bench: EXTRAS := [bench,s3,test]

$(VENV)/.stamp-%: $(PACKAGING)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.$(EXTRAS)'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
