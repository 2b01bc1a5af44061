# make run   - create .venv (first time) and run the default experiment
# make test  - create .venv (first time), check the pins, lint (ruff, mypy), run the whole test suite
# make envs  - the environment libraries' own venvs (.venv-verifiers, -openenv, -tinker; make test needs them)
# make slurm - SLURM and munge from apt, for the one-node SLURM of the launcher tests (make test runs it)
# make lock  - re-resolve the pins (requirements/*.in -> requirements/*.txt)
# make docs  - serve the docs site on http://127.0.0.1:8000 (make test builds it --strict)
# make ui    - open the MLflow UI on this directory's runs
# make bench - rollout-overhead benchmark
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ENVS   := verifiers openenv tinker
ENV_STAMPS := $(foreach e,$(ENVS),.venv-$(e)/.installed)
SLURM_STAMP := .cache/slurm.installed

.PHONY: install envs slurm run test pins lint lock browser docs docs-check ui bench clean

$(STAMP): scripts/install.sh pyproject.toml requirements/cpu.txt requirements/gpu.txt
	bash scripts/install.sh
	touch $@

install: $(STAMP)

# One venv per environment library (scripts/install_envs.sh says why), each from its own lock.
.venv-%/.installed: scripts/install_envs.sh requirements/envs/%.txt $(STAMP)
	bash scripts/install_envs.sh $*
	touch $@

envs: $(ENV_STAMPS)

# The script touches the stamp only once the packages are installed (not as a non-root user:
# then the SLURM tests skip, and the next make asks again). As with `browser`, a failed install
# stops `make test` only under CI.
$(SLURM_STAMP): scripts/install_slurm.sh
	bash scripts/install_slurm.sh $@ || { [ -z "$$CI" ] && echo "SLURM not installed: the SLURM launcher tests will be skipped"; }

slurm: $(SLURM_STAMP)

run: $(STAMP)
	$(PY) -m rlexp.run

lint: $(STAMP)
	$(VENV)/bin/ruff check rlexp tests bench scripts examples
	$(VENV)/bin/mypy rlexp tests/test_protocols.py
	$(VENV)/bin/lint-imports --no-cache   # the layering contracts in pyproject.toml
	$(PY) scripts/check_sizes.py          # no file over 350 lines, no function over 60

# The installed packages must be exactly the pinned ones (scripts/pins.py).
pins: $(STAMP)
	$(PY) scripts/pins.py check

lock:
	bash scripts/lock.sh

# The suite in two parts: the tests that can share the machine on TEST_WORKERS pytest workers,
# each worker taking a whole file at a time (a module's engine is started once), the costliest
# first, and the Ray files one after another (tests/conftest.py); then the "serial" tests alone
# (pyproject.toml: markers). Both parts run; either failing fails make test. The JUnit reports
# feed scripts/test_durations.py.
TEST_WORKERS ?= 2
test: pins lint docs-check browser envs slurm
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" \
	  --junitxml=.cache/tests-shared.xml; shared=$$?; \
	$(PY) -m pytest -m serial --junitxml=.cache/tests-serial.xml && exit $$shared

# Headless Chromium for the MLflow UI test. Without it that test is skipped, except under CI
# (CI set, as .ci/run does), where a failed install stops `make test`.
browser:
	bash scripts/install_chromium.sh || { [ -z "$$CI" ] && echo "chromium not installed: the MLflow UI browser test will be skipped"; }

# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, which rlexp does not use.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .cache/site

ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000

bench: $(STAMP)
	$(PY) bench/rollout_overhead.py

clean:
	rm -rf $(VENV) $(foreach e,$(ENVS),.venv-$(e)) .cache outputs/* sweeps/*
