# The two commands a newcomer needs (see README.md):
#   make demo   set up .venv and run the main job, `hputrain train` on the built-in default
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow bench

# torch is pinned to the CPU build on our machines; a looser requirement would pull CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[plot,tensorboard,hf,trackers,test]'
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/hputrain train

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python bench/trainer_overhead.py
