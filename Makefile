# Two commands on a fresh Debian or Ubuntu machine: `make run` and `make test`.
# Both create or update the virtual environment at .venv from requirements.txt.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.requirements-installed

.PHONY: run test venv test-deps lint bench clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@sh scripts/ensure-python.sh
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	@touch $@

run: venv
	$(PY) manage.py up

# Redis, Chromium and the llama.cpp engine, installed if missing; the tests start them.
test-deps: venv
	@sh scripts/test-deps.sh $(PIP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: test-deps lint
	$(PY) manage.py check
	$(PY) manage.py makemigrations --check --dry-run
	$(PY) -m pytest

bench: venv
	$(PY) bench/bytes.py

clean:
	rm -rf var/test* .pytest_cache
