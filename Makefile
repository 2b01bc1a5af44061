# make run   - create .venv (first time) and run the default experiment
# make test  - create .venv (first time), lint, and run the whole test suite
# make ui    - open the MLflow UI on this directory's runs
# make bench - rollout-overhead benchmark
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run test lint ui bench clean

$(STAMP): scripts/install.sh pyproject.toml
	bash scripts/install.sh
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(PY) -m rlexp.run

lint: $(STAMP)
	$(VENV)/bin/ruff check rlexp tests bench

test: lint
	$(PY) -m pytest

ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000

bench: $(STAMP)
	$(PY) bench/rollout_overhead.py

clean:
	rm -rf $(VENV) .cache outputs/* sweeps/*
