# The two commands: `make run` and `make test`. Both set themselves up in .venv.
# `make test-fast`: the pure and unit tests alone (no engine processes or in-process model runs, no SGLang envs or wheels).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist processes: one more than the two cores. An engine computes on one core, but the
# end-to-end tests also wait (engine start-up, deadlines, a browser, a database restart), and with
# two workers a core idled through a fifth of the run; a fourth worker only adds contention
# (BENCHMARKS.md, "The test suite")
TEST_WORKERS ?= 3
# pytest and the processes the tests start keep their bytecode and pytest's rewritten test modules
# in the (git-ignored) __pycache__ folders even where PYTHONDONTWRITEBYTECODE is set: otherwise
# every worker rewrites every test module at collection (4 to 5 s each) and every engine, service
# and CLI process compiles what it imports again
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest

.PHONY: run test test-fast lint lint-docker setup clean chromium sglang-cpu

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip uv
	# CPU torch first, pinned, so nothing pulls a CUDA build (pip: it finds the CPU wheel where
	# the machine's pip configuration says; uv then keeps the torch it finds installed)
	$(BIN)/pip install --quiet torch==2.13.0
	# the rest through uv: the same versions as pip resolves, in seconds rather than a minute.
	# Compiled to bytecode as pip does (uv does not by default): with PYTHONDONTWRITEBYTECODE set,
	# every process would compile numpy, FastAPI, pydantic, Ray... from source at each start (an
	# engine's imports: 3.1 s uncompiled, 2.0 s compiled); evalsvc's own sources likewise
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[engine,dev,ray]'
	$(BIN)/python -m compileall -q -j 0 evalsvc > /dev/null
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/evalsvc demo

# the dashboard's browser tests drive Debian's chromium (never `playwright install`)
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; } \
	  || { echo "error: the dashboard's browser tests need Debian's chromium and apt-get could" \
	            "not install it: run 'apt-get install -y chromium' as root" >&2; exit 1; }

# --dist loadgroup: the tests of one xdist_group (the dashboard's browser tests share a job) stay
# on one worker
test: $(STAMP) chromium
	$(BIN)/ruff check evalsvc tests training benchmarks
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup --durations=25

# everything not marked slow (engine processes, services, browsers), model (the engine's model
# run in-process), fuzz (the REST API fuzzed), sglang_contract or wheels: about 2 minutes here;
# `make test` still runs it all
test-fast: $(STAMP)
	$(BIN)/ruff check evalsvc tests training benchmarks
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup \
	  -m "not slow and not model and not fuzz and not sglang_contract and not wheels" \
	  --durations=10

lint: $(STAMP)
	$(BIN)/ruff check evalsvc tests training benchmarks

# the Dockerfiles (hadolint) and docker/compose.yaml (Compose Specification schema), no Docker needed
lint-docker: $(STAMP)
	$(BIN)/hadolint --failure-threshold style docker/Dockerfile.service docker/Dockerfile.worker
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml

# real SGLang 0.5.17 on this CPU, any x86-64 (the reference ops; the kernel path where AVX-512-BF16
# exists), from the kernel wheels of ../shared/sglang-cpu or EVALSVC_SGLANG_CPU_KERNEL; refuses at
# once, naming what is missing, where they are not
sglang-cpu: $(STAMP)
	$(BIN)/python -m evalsvc.builds.sglang_cpu --dest .venv-sglang-cpu

clean:
	rm -rf $(VENV) .pytest_cache
