# Infersight — the two commands that matter:
#   make run    set up .venv, fetch the default model, open the desktop app
#   make test   set up .venv with the dev extras, lint, check the layers, type-check, run the tests
#
# TORCH_SPEC picks the torch build installed into .venv before anything else. The default pin
# takes a CPU build that lies on the CI machines' disk; for a CUDA build on your own machine use
# e.g. `make run TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124"`.

PYTHON     ?= python3

# Python keeps its bytecode caches in what these targets run, even where the environment turns
# them off (PYTHONDONTWRITEBYTECODE=1, as container images set it). Nothing is compiled at
# install (pip's --no-compile, uv's default): a module is compiled when first imported, and
# without the cache every process would compile it again (the test run's collection: 14.6 s
# a pytest process without, 9.3 s with).
PYTHONDONTWRITEBYTECODE :=
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
PIP        := $(BIN)/python -m pip --disable-pip-version-check -q

# `make test` runs these again as if on an AVX2-only CPU where the CPU has AVX-512: the CPU-path
# probes answer as there (engine/hardware/cpu_paths.py) and torch dispatches its AVX2 kernels. On an AVX2
# machine the main run already took those paths; tests/test_cpu_paths.py forces every level
# in-process on every machine.
# Tests marked `breadth` (more inputs down the same paths) run in the main run only; the
# compiled decode step's code is TorchInductor's for the level, not ours (test_isolation.py
# compiles at both levels side by side).
AVX2_LEG := tests/test_cpu_paths.py tests/test_quant.py tests/test_exactness_tiny.py \
            tests/test_generation.py tests/test_eval.py tests/test_real_model.py \
            tests/test_compare.py tests/test_sensitivity.py \
            tests/test_paged_attention.py tests/test_speculative.py tests/test_loading.py \
            tests/test_linear_layout.py tests/test_profile.py tests/test_bench_table.py \
            tests/test_app.py::test_instruments_show_the_engines_figures

# The tests that time nothing run on TEST_WORKERS processes (pytest-xdist; a file's tests on
# one worker, so its module fixtures are built once; tests/conftest.py shares the cores out);
# the tests marked `timing` then run alone, so that no other test's work is in their figures.
TEST_WORKERS ?= 2
PYTEST       := $(BIN)/python -m pytest -q
PARALLEL     := -n $(TEST_WORKERS) --dist loadfile
# The files with a test marked `timing`, so that their run collects only those (every file's
# imports would cost it about 7 s).
TIMING_FILES  = $(shell grep -l -E '(mark\.timing|pytestmark.*timing)' tests/test_*.py)

.PHONY: run chat test bench bench-peers gpu-check load-peak screenshots package venv dev clean

# With no display, `infersight` says how to run headless or under Xvfb instead of failing.
run: $(VENV)/.stamp-run
	$(BIN)/infersight models pull
	$(BIN)/infersight

chat: $(VENV)/.stamp-run
	$(BIN)/infersight chat --model default

# mypy (about 40 s on one core) type-checks while the default model is pulled and converted.
# Our Triton kernels are built for sm_75…sm_90 in the background meanwhile, at the lowest
# priority, filling the cores the tests leave idle (engine/kernels/triton_aot.py: about 150
# builds, a second each); its failures and total print at the end.
test: $(VENV)/.stamp-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@mkdir -p build; \
	env -u TRITON_INTERPRET nice -n 19 $(BIN)/python -m engine.kernels.triton_aot --quiet \
	  --jobs 2 --json build/triton-aot.json > build/triton-aot.txt 2>&1 & aot=$$!; \
	trap 'kill $$aot 2>/dev/null' EXIT; \
	$(BIN)/mypy engine app widgets & typing=$$!; \
	$(BIN)/infersight models pull; pulled=$$?; \
	wait $$typing && [ $$pulled = 0 ] || exit 1; \
	cap=$$($(BIN)/python -c 'from engine.hardware.cpu_paths import native_level; print(native_level())') \
	  || exit 1; \
	if [ "$$cap" = AVX512 ]; then \
	  echo "AVX2 leg: the engine's tests as if on an AVX2-only CPU"; \
	  QT_QPA_PLATFORM=offscreen INFERSIGHT_CPU_CAPABILITY=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	    $(PYTEST) $(PARALLEL) -m "not no_engine_paths and not timing and not breadth" $(AVX2_LEG) \
	    || exit 1; \
	else \
	  echo "AVX2 leg: not needed, this CPU's level is $$cap (the main run takes its paths)"; \
	fi; \
	QT_QPA_PLATFORM=offscreen $(PYTEST) $(PARALLEL) -m "not timing" --durations=15 || exit 1; \
	QT_QPA_PLATFORM=offscreen $(PYTEST) -m timing --durations=5 $(TIMING_FILES) || exit 1; \
	wait $$aot; built=$$?; cat build/triton-aot.txt; exit $$built

# The main window mid-reply with the plots populated, speculative decoding marked, the A/B lab
# and the batching tuner, rendered offscreen into docs/screenshots.
screenshots: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	QT_QPA_PLATFORM=offscreen INFERSIGHT_SCREENSHOTS=docs/screenshots \
	  $(BIN)/python -m pytest -q tests/test_app.py tests/test_tuner_app.py -k "screenshots or speculation"

# A runnable folder, dist/infersight/ (PyInstaller; the model is fetched on first start).
package: $(VENV)/.stamp-run
	$(PIP) install "pyinstaller>=6.10"
	$(BIN)/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller \
	  packaging/infersight.spec

bench: $(VENV)/.stamp-dev
	$(BIN)/infersight bench --model default --compare-hf

# Our precisions next to llama.cpp, back to back in each repeat, as fractions of the
# memory-bandwidth limit measured in the same run, on two models:
# - the default model's own GGUF (Q4_1 as shipped, and llama.cpp's Q8_0/F32 requantizations of
#   it: the very values our fp32 weights hold);
# - a synthetic Llama-3.2-1B (Meta's config, random float16 weights written once as our folder
#   and, with the same values, as an F16 GGUF that llama.cpp requantizes itself):
#   engine/store/synthetic_store.py. About 5 GB in the user cache.
# llama-cpp-python is built from source for this CPU into $(PEERS) (several minutes, once);
# it never enters $(VENV). DECODE_GRAPH=on adds compiled rows (minutes of compiling per
# precision).
PEERS        ?= .peers/venv
PEER_SPEC    ?= llama-cpp-python==0.3.36
DECODE_GRAPH ?= auto
bench-peers: $(VENV)/.stamp-dev $(PEERS)/.stamp
	$(BIN)/infersight models pull
	$(BIN)/infersight bench --model default --table fp32 int8+head int4-g32+head \
	  --decode-graph $(DECODE_GRAPH) --llama-cpp $(PEERS)/bin/python --gguf-types Q4_1 Q8_0 F32
	$(BIN)/infersight models synth llama-3.2-1b
	$(BIN)/infersight bench --model "$$($(BIN)/infersight models synth llama-3.2-1b)" \
	  --table fp32 bf16 int8+head int4-g32+head --decode-graph $(DECODE_GRAPH) \
	  --llama-cpp $(PEERS)/bin/python --gguf-types Q4_1 Q8_0 F16

$(PEERS)/.stamp:
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/python -m pip --disable-pip-version-check -q install "$(PEER_SPEC)"
	touch $@

# On an NVIDIA machine, with a CUDA build of torch in .venv (see TORCH_SPEC); written to fit in
# 8 minutes on an H200 (checks/gpu/). Random weights of Llama-3.1-8B's shapes (no
# download) at every precision the GPU runs natively and the memory plan fits: a 4k-token
# prompt with a batch of 16, the plan's peak against max_memory_allocated, batch-1 decode as a
# fraction of the bandwidth limit, transformers fp16 side by side, a real out-of-memory step
# recovered, the compiled decode step and the app's worker. Prints a table and the JSON, also
# written to build/gpu-check.json. Without a CUDA device it says so and succeeds; `make test`
# runs its CPU dry run (--dry-run, tests/test_gpu_check.py).
gpu-check: $(VENV)/.stamp-dev
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m checks.gpu --json build/gpu-check.json

# The load's peak memory against the memory plan's bound, on a synthetic checkpoint with
# Llama-3.2-3B's shapes (6.4 GB of random bf16, written once under build/load-peak; needs
# ~7 GB of disk and ~10 GB of RAM), at int8, int4-g32 and int4-g32+head. Not part of `make
# test` (minutes). LOAD_PEAK_DEVICE=cuda measures max_memory_allocated on a GPU instead.
LOAD_PEAK_DEVICE ?= cpu
load-peak: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m tests.load_peak --device $(LOAD_PEAK_DEVICE)

venv: $(VENV)/.stamp-run
dev: $(VENV)/.stamp-dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-torch: | $(VENV)/bin/python
	$(PIP) install --no-compile $(TORCH_SPEC)
	touch $@

# Everything but torch goes in with uv (seconds where pip takes about half a minute); it keeps
# the torch already installed, since every requirement on torch is a range that it meets.
UV := $(BIN)/python -m uv pip install --quiet --python $(BIN)/python

$(VENV)/.stamp-uv: | $(VENV)/bin/python
	$(PIP) install "uv>=0.5"
	touch $@

$(VENV)/.stamp-run: pyproject.toml $(VENV)/.stamp-torch $(VENV)/.stamp-uv
	$(UV) -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml $(VENV)/.stamp-torch $(VENV)/.stamp-uv
	$(UV) -e ".[dev,ray]"
	touch $@ $(VENV)/.stamp-run

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
