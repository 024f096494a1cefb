# `make serve` and `make test` each create the virtualenv first if it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The history of the city begins

.PHONY: install serve complete test quick browser reliability image-test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,ray]"
	touch $@

# The main job: serve every checkpoint in model_store/ over HTTP (TINYSERVE_* variables configure it).
serve: install
	$(PY) -m server

# Complete a prompt on the command line with the shipped GPT checkpoint.
complete: install
	$(PY) -m training complete model_store/gpt-wikitext2 "$(PROMPT)"

# A worker a core, each taking the next test as it frees (docs/ARCHITECTURE.md, "Tests").
test: install browser
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n auto --dist worksteal

# The inner loop: the suite less its slow, browser, compile and GPU tests (docs/ARCHITECTURE.md, "Tests").
quick: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not slow and not browser and not compile and not gpu"

# The demo-page tests drive Debian's chromium through Playwright (no browser download).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
	  { echo "make test needs Debian's chromium for the browser tests: apt-get install chromium" >&2; exit 1; }

# The server image's CPU variant, built with podman on a debootstrapped Debian base (no Docker engine
# needed) and served from inside: /health, a completion, a fill-mask (docs/DEPLOYMENT.md, "Docker").
image-test: install
	$(PY) -m scripts.image_test

# The long reliability runs (docs/RELIABILITY.md): >= 1,000 fuzz cases, then 64 clients of mixed load.
reliability: install
	$(PY) -m scripts.fuzz_api --max-examples 20 --max-time 240
	$(PY) bench/load_test.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
