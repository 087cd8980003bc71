# Two commands on a fresh machine: `make demo` and `make test`. Both create the venv, install the pinned
# CPU torch, the package with its dev and trl extras (tests/test_trl.py runs TRL's GRPOTrainer) and build
# the C++ extension; both are cheap once done.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
EXT_SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu') CMakeLists.txt pyproject.toml

.PHONY: demo test test-fast bench lint cuda-compile clean sim

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	# Pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q "scikit-build-core>=0.10" cmake ninja
	touch $@

$(VENV)/.installed: $(VENV)/.torch $(EXT_SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e ".[dev,trl]" "torch==$(TORCH_VERSION)"
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
	$(VENV)/bin/ruff check oppo_engine kernels tests bench

# Compile-only check of the torch-free CUDA sources (what CI runs where nvcc exists).
cuda-compile:
	@for f in $$(find csrc -name '*.cu'); do \
		echo "nvcc -arch=sm_90 -c $$f"; \
		nvcc -arch=sm_90 -std=c++17 -Icsrc -c $$f -o /dev/null || exit 1; \
	done

clean:
	rm -rf build $(VENV) *.egg-info
