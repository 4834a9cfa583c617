# Two entry points: `make demo` (a fault-injection drill on CPU) and `make test`.
# Both build .venv from scratch when it is missing; nothing else on the machine is assumed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdcguard-installed

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0" numpy
	$(PY) -m pip install --quiet -e ".[agent,operator,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sdcguard drill --nodes 3 --ranks-per-node 2 --steps 12 \
		--weight-check-every 2 --inject weight-bitflip:rank=3:step=5 \
		--report demo-report.json

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) demo-report.json .pytest_cache
