# Two entry points (README): `make demo` and `make test`. Both bootstrap .venv the first time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast memory clean

venv: $(STAMP)

# CPU environment with the real SGLang 0.5.14 (requirements/cpu.txt explains the three steps).
$(STAMP): requirements/cpu.txt requirements/cpu-deps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements/cpu.txt
	$(BIN)/pip install --quiet --no-deps sglang==0.5.14
	$(BIN)/pip install --quiet -r requirements/cpu-deps.txt
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import sglang, sglang_ssm_modes; assert sglang.__version__ == '0.5.14', sglang.__version__"
	touch $(STAMP)

demo: venv
	$(BIN)/python -m sglang_ssm_modes demo

memory: venv
	$(BIN)/python -m sglang_ssm_modes memory

# Upstream SGLang's ReplaySSM decode kernel, taken out of the sglang 0.5.23 wheel (never committed):
# tests/test_upstream_replayssm.py checks the benchmark's calls to it against the reference.
UPSTREAM := .gpu/upstream-sglang-0.5.23/fused_recurrent_linear_replayssm.py

$(UPSTREAM): | venv
	$(BIN)/python scripts/upstream_replayssm.py extract --out $(dir $(UPSTREAM))

# flash-linear-attention (fla-core 0.6.0 + einops, pure Python) for the replay benchmark's fla rows:
# tests/test_fla_kernels.py checks the benchmark's calls to it against the reference.
FLA := .gpu/fla-core-0.6.0/fla/__init__.py

$(FLA): | venv
	$(BIN)/python scripts/fla_kernels.py extract --out .gpu/fla-core-0.6.0

test: venv $(UPSTREAM) $(FLA)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Skip tests marked slow (interpreter-heavy); CI runs everything.
test-fast: venv $(UPSTREAM) $(FLA)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info
