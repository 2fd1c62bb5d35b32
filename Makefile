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

.PHONY: run chat test bench bench-peers bench-peers-avx2 bench-peers-tables bench-serving eval-serving gpu-check gpu-wheels gpu-versions load-peak soak fuzz-api asan kill-loop raw-http screenshots \
        package venv dev clean

# With no display, `infersight` says how to run headless or under Xvfb instead of failing.
# The app pulls and converts the default model itself on a first start, with its progress in
# the window (`infersight models pull` does the same in a terminal).
run: $(VENV)/.stamp-run
	$(BIN)/infersight

chat: $(VENV)/.stamp-run
	$(BIN)/infersight chat --model default

# The soak's short version closes the run (docs/reliability.md): two servers under mixed traffic
# with faults for SOAK_CI_MINUTES, nothing accepted lost, no block leaked, threads and files
# back; a timed job after the suite, not a test (`make soak` runs the hour).
SOAK_CI_MINUTES ?= 2

# mypy (about a minute on one core, cold) type-checks in the background at the lowest
# priority while the default model is pulled and the tests run, filling the cores they leave
# idle; its verdict is awaited before the timing tests, which run alone. Our Triton kernels
# are built for sm_75…sm_90 in the background too, at the same priority
# (engine/kernels/triton_aot.py: about 240 builds, seconds each); its failures and total
# print at the end.
test: $(VENV)/.stamp-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@mkdir -p build; \
	env -u TRITON_INTERPRET nice -n 19 $(BIN)/python -m engine.kernels.triton_aot --quiet \
	  --jobs 2 --json build/triton-aot.json > build/triton-aot.txt 2>&1 & aot=$$!; \
	nice -n 19 $(BIN)/mypy engine app widgets checks > build/mypy.txt 2>&1 & typing=$$!; \
	trap 'kill $$aot $$typing 2>/dev/null' EXIT; \
	$(BIN)/infersight models pull || exit 1; \
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
	wait $$typing; typed=$$?; cat build/mypy.txt; [ $$typed = 0 ] || exit 1; \
	QT_QPA_PLATFORM=offscreen $(PYTEST) -m timing --durations=5 $(TIMING_FILES) || exit 1; \
	wait $$aot; built=$$?; cat build/triton-aot.txt; [ $$built = 0 ] || exit 1; \
	$(BIN)/python -m checks.soak --minutes $(SOAK_CI_MINUTES) --out build/soak-ci

# The main window mid-reply with the plots populated, speculative decoding marked, the A/B lab
# and the batching tuner, rendered offscreen into docs/screenshots.
screenshots: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	QT_QPA_PLATFORM=offscreen INFERSIGHT_SCREENSHOTS=docs/screenshots \
	  $(BIN)/python -m pytest -q tests/test_app.py tests/test_tuner_app.py tests/test_app_start.py \
	  tests/test_hub.py tests/test_lab_endpoint.py tests/test_tuner_endpoint.py \
	  -k "screenshot or speculation"

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
# llama-cpp-python is built from source for this CPU into $(PEERS) (several minutes, once;
# without llava/mtmd, which the bench never loads); it never enters $(VENV). DECODE_GRAPH=on
# adds compiled rows (minutes of compiling per precision). BENCH_THREADS=1 pins both sides to
# one thread (else each side's own choice).
#
# `make bench-peers-avx2` measures the AVX2 machine kind on any machine: a second peer built
# with GGML_NATIVE off (AVX2, FMA, F16C; no AVX-512, no AVX-VNNI) in $(PEERS_AVX2), and our
# kernels and torch's forced to AVX2 (INFERSIGHT_CPU_CAPABILITY, ATEN_CPU_CAPABILITY).
PEERS        ?= .peers/venv
PEERS_AVX2   ?= .peers/venv-avx2
PEER_SPEC    ?= llama-cpp-python==0.3.36
PEER_CMAKE   ?= -DLLAVA_BUILD=OFF
PEER_AVX2    ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF
DECODE_GRAPH ?= auto
BENCH_THREADS ?=
BENCH_PEERS  = $(if $(BENCH_THREADS),INFERSIGHT_THREADS=$(BENCH_THREADS) )$(BIN)/infersight bench \
	  $(if $(BENCH_THREADS),--threads $(BENCH_THREADS) )--decode-graph $(DECODE_GRAPH)
bench-peers: $(VENV)/.stamp-dev $(PEERS)/.stamp
	$(MAKE) --no-print-directory bench-peers-tables PEER=$(PEERS)

bench-peers-avx2: $(VENV)/.stamp-dev $(PEERS_AVX2)/.stamp
	INFERSIGHT_CPU_CAPABILITY=AVX2 ATEN_CPU_CAPABILITY=avx2 \
	  $(MAKE) --no-print-directory bench-peers-tables PEER=$(PEERS_AVX2)

# (the 1B table leaves out fp32: llama.cpp's peer reads the synthetic model as F16)
bench-peers-tables:
	$(if $(PEER),,$(error bench-peers-tables needs PEER=<a peer venv>: run make bench-peers))
	$(BIN)/infersight models pull
	$(BENCH_PEERS) --model default --table fp32 int8+head int4-g32+head int4-g32+head8 \
	  --llama-cpp $(PEER)/bin/python --gguf-types Q4_1 Q8_0 F32
	$(BIN)/infersight models synth llama-3.2-1b
	$(BENCH_PEERS) --model "$$($(BIN)/infersight models synth llama-3.2-1b)" \
	  --table bf16 int8+head int4-g32+head int4-g32+head8 \
	  --llama-cpp $(PEER)/bin/python --gguf-types Q4_1 Q8_0 F16

# GuideLLM (its own venv, a client only) against `infersight serve` at each precision: both
# routes, synchronous and concurrent (4 and 16 streams), 256 prompt / 64 output tokens with
# ignore_eos; fails unless every request got exactly the tokens asked and /metrics agrees.
GUIDELLM      ?= .peers/guidellm
GUIDELLM_SPEC ?= guidellm==0.8.1
bench-serving: $(VENV)/.stamp-dev $(GUIDELLM)/.stamp $(PEERS)/.stamp-server
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.bench_serving --guidellm $(GUIDELLM)/bin/guidellm
	$(BIN)/python -m checks.bench_serving_peer --peer-python $(PEERS)/bin/python \
	  --gguf $$($(BIN)/python -c "from engine.store.model_store import default_gguf_path as p; print(p())")

# llama.cpp's server for bench-serving: llama-cpp-python's [server] extras beside its build
$(PEERS)/.stamp-server: $(PEERS)/.stamp
	$(PEERS)/bin/python -m pip --disable-pip-version-check -q install "$(PEER_SPEC)[server]"
	touch $@

# lm-evaluation-harness (dev extras) through `infersight serve` at fp32, int8+head and
# int4-g32+head on two tasks of our own: accuracy and the loglikelihood shift against fp32.
eval-serving: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.eval_serving

$(GUIDELLM)/.stamp:
	$(PYTHON) -m venv $(GUIDELLM)
	$(GUIDELLM)/bin/python -m pip --disable-pip-version-check -q install "$(GUIDELLM_SPEC)"
	touch $@

$(PEERS)/.stamp:
	$(PYTHON) -m venv $(PEERS)
	CMAKE_ARGS="$(PEER_CMAKE)" $(PEERS)/bin/python -m pip --disable-pip-version-check -q \
	  install --no-cache-dir "$(PEER_SPEC)"
	touch $@

$(PEERS_AVX2)/.stamp:
	$(PYTHON) -m venv $(PEERS_AVX2)
	CMAKE_ARGS="$(PEER_CMAKE) $(PEER_AVX2)" $(PEERS_AVX2)/bin/python -m pip \
	  --disable-pip-version-check -q install --no-cache-dir "$(PEER_SPEC)"
	touch $@

# -- the lent GPU machine (docs/gpu-check.md) ---------------------------------------------------
# `make gpu-check` runs on the GPU machine with that machine's own python3 and packages (Python
# 3.12, torch 2.11 + cu130, Triton 3.6, transformers 5.17; no registry there): it never builds a
# venv. The device tool's one call, the tree carrying gpu-wheels/:
#   bash checks/gpu/run.sh --quick        (timeout_s 360: within 5 minutes)
#   bash checks/gpu/run.sh                (timeout_s 560: the whole run, 8 minutes)
# Checks in the order of what they tell, each under its own limit, the JSON in $$OUT as each ends.
# Without a CUDA device it says so and succeeds; `make test` runs its CPU dry run.
# On your own GPU machine with the project's venv: make gpu-check GPU_PYTHON=.venv/bin/python
GPU_PYTHON ?= python3
gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash checks/gpu/run.sh $(GPU_CHECK_ARGS)

# What gpu-check needs beyond the lent image: wheels for cp312/manylinux, fetched here into
# gpu-wheels/ (git-ignored; carried with the tree, which stays far under its 64 MiB).
GPU_WHEELS := platformdirs==4.14.9
gpu-wheels:
	rm -rf gpu-wheels && mkdir -p gpu-wheels
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d gpu-wheels $(GPU_WHEELS)
	@ls -l gpu-wheels | tail -n +2; du -sh gpu-wheels

# The lent machine's versions here: torch 2.11 (its CUDA build, run on the CPU), Triton 3.6 and
# transformers 5.17 in a venv of their own with the image's other packages that we use, none of
# ours. In a clean checkout of HEAD with only the carried wheels on the path, as on the GPU
# machine: the dry run through checks/gpu/run.sh (our kernels in Triton's interpreter), the
# kernel tests under the interpreter, and the ahead-of-time build for sm_80 and sm_90.
GPU_IMAGE      ?= .venv-gpu-image
GPU_IMAGE_PKGS := torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy safetensors tokenizers \
                  jinja2 psutil filelock nvidia-ml-py huggingface_hub prometheus-client pyyaml \
                  tqdm pytest hypothesis
$(GPU_IMAGE)/.stamp:
	$(PYTHON) -m venv $(GPU_IMAGE)
	$(GPU_IMAGE)/bin/python -m pip --disable-pip-version-check -q install $(GPU_IMAGE_PKGS)
	touch $@

GPU_KERNEL_TESTS := tests/test_triton_decode.py tests/test_triton_prefill.py tests/test_triton_fused.py \
                    tests/test_triton_grouped.py \
                    tests/test_triton_gemm.py tests/test_triton_check.py tests/test_triton_engine.py
gpu-versions: $(GPU_IMAGE)/.stamp gpu-wheels
	rm -rf build/gpu-versions && mkdir -p build/gpu-versions
	git clone -q . build/gpu-versions/tree && cp -r gpu-wheels build/gpu-versions/tree/
	cd build/gpu-versions/tree && TRITON_INTERPRET=1 GPU_PYTHON=$(abspath $(GPU_IMAGE))/bin/python \
	  OUT=$(abspath build/gpu-versions) bash checks/gpu/run.sh --dry-run
	$(GPU_IMAGE)/bin/python -m pip --disable-pip-version-check -q install --no-index --no-deps \
	  --target build/gpu-versions/site gpu-wheels/*.whl
	cd build/gpu-versions/tree && TRITON_INTERPRET=1 PYTHONPATH=.:../site \
	  $(abspath $(GPU_IMAGE))/bin/python -m pytest -q -p no:cacheprovider $(GPU_KERNEL_TESTS)
	cd build/gpu-versions/tree && env -u TRITON_INTERPRET PYTHONPATH=.:../site \
	  $(abspath $(GPU_IMAGE))/bin/python -m engine.kernels.triton_aot --quiet --targets 80 90

# The load's peak memory against the memory plan's bound, on a synthetic checkpoint with
# Llama-3.2-3B's shapes (6.4 GB of random bf16, written once under build/load-peak; needs
# ~7 GB of disk and ~10 GB of RAM), at int8, int4-g32 and int4-g32+head. Not part of `make
# test` (minutes). LOAD_PEAK_DEVICE=cuda measures max_memory_allocated on a GPU instead.
LOAD_PEAK_DEVICE ?= cpu
load-peak: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.load_peak --device $(LOAD_PEAK_DEVICE)

# Held under load, faults and hostile input (docs/reliability.md): `make soak` runs two servers
# (INT4 with speculation, W8A8) under mixed traffic with faults for SOAK_MINUTES and checks what
# comes back (exit 1 if a check fails), its figures and plots in SOAK_OUT; `make fuzz-api`
# fuzzes serve's OpenAPI document with schemathesis (FUZZ_EXAMPLES cases an operation).
SOAK_MINUTES ?= 60
SOAK_OUT ?= build/soak
soak: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.soak --minutes $(SOAK_MINUTES) --out $(SOAK_OUT)
	QT_QPA_PLATFORM=offscreen $(BIN)/python -m checks.soak_plot $(SOAK_OUT)/soak.json $(SOAK_OUT)

# Our C kernels under AddressSanitizer (their own builds, libasan preloaded): a canary that reads
# past a buffer on purpose must be caught, then hypothesis over their entry points.
ASAN_ENV = INFERSIGHT_KERNEL_SANITIZE=address ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 \
  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)"
KERNEL_FUZZ_EXAMPLES ?= 5000
asan: $(VENV)/.stamp-dev
	mkdir -p build
	if $(ASAN_ENV) $(BIN)/python -m checks.kernel_fuzz --canary 2> build/asan-canary.log; then \
	  echo "the canary went unseen: the kernels did not run under ASan"; exit 1; fi
	grep -m1 "ERROR: AddressSanitizer: heap-buffer-overflow" build/asan-canary.log
	$(ASAN_ENV) $(BIN)/python -m checks.kernel_fuzz --examples $(KERNEL_FUZZ_EXAMPLES)

# kill -9 at random moments while conversations are written (the app, the app while it serves,
# and serve): the store's integrity and every acknowledged message after each; and the raw-HTTP
# cases a schema does not reach.
KILL_RUNS ?= 30
kill-loop: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.kill_loop --runs $(KILL_RUNS) --out build/kill-loop

raw-http: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.raw_http --out build/raw-http

FUZZ_EXAMPLES ?= 1000
fuzz-api: $(VENV)/.stamp-dev
	$(BIN)/infersight models pull
	$(BIN)/python -m checks.fuzz_api --examples $(FUZZ_EXAMPLES) --out build/fuzz

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

# pip 24.1 on reports a download's bytes (--progress-bar=raw): the first start's pull shows them.
$(VENV)/.stamp-uv: | $(VENV)/bin/python
	$(PIP) install "uv>=0.5" "pip>=24.1"
	touch $@

$(VENV)/.stamp-run: pyproject.toml $(VENV)/.stamp-torch $(VENV)/.stamp-uv
	$(UV) -e .
	touch $@

$(VENV)/.stamp-dev: pyproject.toml $(VENV)/.stamp-torch $(VENV)/.stamp-uv
	$(UV) -e ".[dev,ray]"
	touch $@ $(VENV)/.stamp-run

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
