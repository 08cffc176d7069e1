# StreamBP harness: `make demo` and `make test` set up everything they need (Debian packages, the torch venv, the
# CMake build) and are safe to repeat. Caches live outside the clone, under $(CACHE).
SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/streambp
TORCH_VERSION := 2.14.1
VENV ?= $(CACHE)/venv-torch-$(TORCH_VERSION)
PYTHON ?= python3.11
BUILD ?= build
JOBS ?= 2
NVCC ?= /usr/local/cuda/bin/nvcc
export CCACHE_DIR ?= $(CACHE)/ccache
# Hits across clones (CI builds a fresh one): paths relative to the clone, and no working directory in the hash of
# the line tables the sanitized tree compiles with.
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1
# Every translation unit uses a precompiled header, which ccache refuses without these (measured: 132 of 145 calls
# uncacheable, every build a full one); with them (and gcc's -fpch-preprocess, CMakeLists.txt) the calls are cacheable.
# They let ccache ignore only the header's time stamps and macros.
export CCACHE_SLOPPINESS ?= pch_defines,time_macros,include_file_mtime,include_file_ctime
# ...and hash the precompiled header's .sum (core/CMakeLists.txt) instead of its bytes, which differ on every build:
# without it a fresh clone hit 112 of 256 calls (9.5 min for both trees); with it 252 of 258 (the misses: the two
# files that read the clone's path (experiments/CMakeLists.txt) in both trees, clang's header and two more).
export CCACHE_PCH_EXTSUM ?= 1
# The sanitized tree (ASan + UBSan, the fuzz targets): clang, the CPU half only (issue #22).
SANITIZE_BUILD ?= $(BUILD)-sanitize
CLANG ?= clang++
# `make fuzz`: every fuzz target this long (seconds), two at a time.
FUZZ_SECONDS ?= 600
FUZZ_TARGETS := safetensors safetensors_dir checkpoint adapter spec batch results_csv train_resume

APT_PACKAGES := cmake g++ make catch2 nlohmann-json3-dev libcli11-dev ccache libeigen3-dev libbenchmark-dev binutils \
  libgloo-dev clang libfuzzer-14-dev libdnnl-dev
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
# Bump the stamp name when APT_PACKAGES changes, so existing machines install the new packages.
DEPS_STAMP := $(CACHE)/apt-packages-4.stamp
# Bump the stamp name when the venv's package list changes, so existing venvs get the new packages. The venv is made in
# two steps: torch (all the C++ build needs), then the oracles' packages, which `make test` installs beside the build.
VENV_TORCH_STAMP := $(VENV)/.streambp-torch.stamp
VENV_STAMP := $(VENV)/.streambp-venv-4.stamp
CUDA_FLAGS := $(if $(wildcard $(NVCC)),-DCMAKE_CUDA_COMPILER=$(NVCC),-DSTREAMBP_WITH_CUDA=OFF)

.PHONY: demo test check bench build configure sanitize-build fuzz setup deps venv venv-torch plots survey clean

# Extra demo flags, e.g. make demo DEMO_ARGS="--objective dpo --batch 2" (see build/streambp demo --help).
DEMO_ARGS ?=
DEMO_LOG ?= $(CACHE)/make-demo.log
# The demo's own output first: the setup's and the build's go to a log, shown only when they fail.
demo:
	@echo "make demo: installing what is missing and building (the first time ~15 min; log: $(DEMO_LOG))"
	@mkdir -p $(dir $(DEMO_LOG)) && $(MAKE) --no-print-directory setup build >$(DEMO_LOG) 2>&1 || \
	  { tail -n 40 $(DEMO_LOG); echo "make demo: the build failed; the whole log: $(DEMO_LOG)"; exit 1; }
	@$(BUILD)/streambp demo $(DEMO_ARGS)

# The main tree's suite, then the sanitized tree's (unit tests under ASan + UBSan, a bounded run of every fuzz target).
# Both trees always run: a failure in one (its build or its tests) never hides the other's; make fails after both,
# and the last lines summarise both trees (each tree's ctest output is kept in <tree>/ctest.log).
# What the build needs first (the Debian packages and torch, at once); the rest of the venv (~30 CPU-s, half a minute of
# a cold run) installs beside the build (run_suite.sh).
test:
	@$(MAKE) --no-print-directory -s -j 2 --output-sync=line deps venv-torch
	@bash tests/support/run_suite.sh "$(MAKE) --no-print-directory" $(JOBS) $(BUILD) $(SANITIZE_BUILD)

# The edit-compile-test loop: build/ alone and its unit tests that take seconds (the label `check`,
# tests/CMakeLists.txt). `make test` stays the whole suite, in both trees.
check: build
	ctest --test-dir $(BUILD) -L check -j $(JOBS) --output-on-failure

# The micro-benchmarks of StreamBP's pieces into a new results/bench/bench-<UTC time>.json (never overwritten).
# Extra flags, e.g. make bench BENCH_ARGS="--preset qwen3-small --benchmark_filter=head" (build/streambp_bench --help).
BENCH_ARGS ?=
# OpenMP workers that spin while waiting lose their cores to whatever else runs on a shared machine: kv_chunk/c:256
# took 91 ms instead of 1.2 ms with the default policy at load 6 on 2 cores. The JSON records the policy used.
bench: export OMP_WAIT_POLICY ?= PASSIVE
bench: build
	@mkdir -p results/bench
	out=results/bench/bench-$$(date -u +%Y-%m-%dT%H-%M-%SZ).json; \
	if [ -e "$$out" ]; then echo "error: $$out exists; run again in a second"; exit 1; fi; \
	$(BUILD)/streambp_bench --benchmark_out=$$out --benchmark_out_format=json $(BENCH_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

configure: $(BUILD)/CMakeCache.txt

$(BUILD)/CMakeCache.txt: $(DEPS_STAMP) $(VENV_TORCH_STAMP)
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache $(CUDA_FLAGS) \
	  -DSTREAMBP_PYTHON=$(VENV)/bin/python \
	  -DCMAKE_PREFIX_PATH="$$($(VENV)/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"

sanitize-build: $(SANITIZE_BUILD)/CMakeCache.txt
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)

$(SANITIZE_BUILD)/CMakeCache.txt: $(DEPS_STAMP) $(VENV_TORCH_STAMP)
	cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=$(CLANG) \
	  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DSTREAMBP_WITH_CUDA=OFF -DSTREAMBP_SANITIZE=ON \
	  -DCMAKE_PREFIX_PATH="$$($(VENV)/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"

# Long fuzz runs (CI runs a fixed sequence of STREAMBP_FUZZ_RUNS inputs each): statistics per target, findings under
# $(SANITIZE_BUILD)/fuzz/findings, the grown corpus kept for the next run. Extra: make fuzz FUZZ_TARGETS="spec batch".
fuzz: sanitize-build
	$(SANITIZE_BUILD)/fuzz_seeds $(SANITIZE_BUILD)/fuzz/seeds
	printf '%s\n' $(FUZZ_TARGETS) | xargs -P $(JOBS) -I{} bash tests/fuzz/run_fuzz.sh $(SANITIZE_BUILD) {} $(FUZZ_SECONDS)

# What a new machine lacks, the Debian packages and the venv at once: apt and pip wait on the network and the disk, not
# on each other (a fresh machine, one after the other: apt 65 s, then the venv 136 s). Each line is printed whole.
setup:
	@$(MAKE) --no-print-directory -s -j 2 --output-sync=line deps venv

deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:" $$missing; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@mkdir -p $(dir $@) && touch $@

# The torch wheel (a CUDA 13 build, ~5.5 GB installed) is on this machine's disk: pip takes it without a download.
venv-torch: $(VENV_TORCH_STAMP)
$(VENV_TORCH_STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (the torch $(TORCH_VERSION) wheel here is for CPython 3.11)"; exit 1; }
	@echo "making the venv $(VENV): torch $(TORCH_VERSION) (a minute or two), then the oracles' packages"
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet torch==$(TORCH_VERSION)
	@touch $@
venv: $(VENV_STAMP)
# torch named again: pip may not move it to satisfy another package's requirement.
$(VENV_STAMP): $(VENV_TORCH_STAMP)
	$(VENV)/bin/pip install --quiet torch==$(TORCH_VERSION) matplotlib transformers==5.23.0 peft==0.21.2 trl==1.16.0
	@touch $@

# Every results CSV's figure, into figures/<kind>/ (ignored by git): a read-only step adds nothing to results/.
plots: $(VENV_STAMP)
	$(VENV)/bin/python plots/plot_results.py results

# The conformance survey (docs/survey.md): every public implementation of
# experiments/survey/implementations.json through `streambp conform`, each library in a venv of its own (pinned, from
# PyPI; under $(CACHE)/survey) -> results/survey/. Two libraries are not on PyPI: give their checkouts as
# STREAMBP_OFFICIAL_SRC (Ledzy/StreamBP) and MST_SRC (wdlctc/mini-s), else their rows say so. SURVEY_ARGS: e.g.
# --only deepspeed-tiled mst.
SURVEY_ARGS ?=
survey: setup
	@$(MAKE) --no-print-directory build
	STREAMBP_PYTHON=$(VENV)/bin/python STREAMBP_CACHE=$(CACHE) $(VENV)/bin/python experiments/survey/survey.py \
	  --streambp $(BUILD)/streambp $(SURVEY_ARGS)
	$(VENV)/bin/python experiments/survey/known_bugs.py; bugs=$$?; \
	  $(VENV)/bin/python experiments/survey/survey_table.py && exit $$bugs  # known-bugs.{csv,md}, survey.md (issue #45)

clean:
	rm -rf $(BUILD) $(SANITIZE_BUILD)
