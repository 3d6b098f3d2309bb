# The two commands a newcomer needs (see README.md):
#   make demo   set up .venv and run the main job, `hputrain train` on the built-in default
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-oldest test-bf16-both test-bf16-auto bench

# torch is pinned to the CPU build on our machines; a looser requirement would pull CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[plot,tensorboard,hf,trackers,test]'
	touch $@

setup: $(STAMP)

# A rerun continues the run where it stopped (or, once it has finished, shows its results): a
# run without --resume-from-checkpoint refuses a folder that holds checkpoints (docs/reliability.md).
demo: $(STAMP)
	$(BIN)/hputrain train --resume-from-checkpoint latest

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The lowest versions pyproject.toml accepts, in a venv of their own, on the tests that exercise
# them (CI runs this after `make test`): a floor that is promised is a floor that is tested.
OLDEST := .venv-oldest
OLDEST_PINS := transformers==4.56.2 peft==0.17.1 datasets==3.6.0 accelerate==1.10.1
OLDEST_TESTS := tests/recipes/test_recipe_hf.py tests/methods/sft/test_sft_data.py tests/methods/sft/test_sft_recipe.py \
	tests/checkpoint/test_lora_checkpoint.py tests/checkpoint/test_checkpoint_hf.py tests/config/test_hf_vocabulary.py \
	tests/methods/dpo/test_dpo.py tests/recipes/test_adapters.py tests/recipes/test_sharded_loading.py tests/data/test_token_cache.py \
	tests/data/test_streaming.py tests/methods/grpo/test_grpo.py tests/execution/test_generation.py

$(OLDEST)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install --quiet --upgrade pip
	$(OLDEST)/bin/pip install --quiet torch==2.13.0
	$(OLDEST)/bin/pip install --quiet -e '.[plot,tensorboard,hf]' $(OLDEST_PINS) 'pytest>=7.4' 'pytest-timeout>=2.3'
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -q $(OLDEST_TESTS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# precision="auto" picks bf16 on a CPU with native bf16 (AVX512-BF16, AMX, Arm's BF16) and fp32
# elsewhere; a test must hold on both (docs/contributing.md). CI runs the tests that read back what
# "auto" picked (marked bf16_auto, in the files listed here: a test checks the list) with bf16 taken
# as native, then as emulated (the switch HPUTRAIN_CPU_NATIVE_BF16); test-bf16-auto runs the whole
# suite as a CPU of the other kind than this one would.
BF16_AUTO_TESTS := tests/accelerators/test_cpu_bf16.py tests/methods/grpo/test_grpo.py

test-bf16-both: $(STAMP)
	$(BIN)/python -m pytest -q -m bf16_auto $(BF16_AUTO_TESTS) --cpu-bf16=native
	$(BIN)/python -m pytest -q -m bf16_auto $(BF16_AUTO_TESTS) --cpu-bf16=emulated

test-bf16-auto: $(STAMP)
	$(BIN)/python -m pytest -q --cpu-bf16=opposite

bench: $(STAMP)
	$(BIN)/python bench/trainer_overhead.py
