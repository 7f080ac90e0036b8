# make demo  - the main job on the embedded default (creates .venv when missing)
# make test  - lint + CPU test suite (creates .venv when missing); what CI runs
PY := .venv/bin/python

.PHONY: env demo test gpu-test lint

env:
	@./scripts/setup_env.sh

demo: env
	$(PY) -m vllm_ddtree.cli demo

lint: env
	.venv/bin/ruff check .

test: lint
	$(PY) -m pytest -q --durations=15 tests evals/tests

# On a CUDA machine with vLLM 0.26.0 and this package installed (CONTRIBUTING.md): the GPU
# suites, each in its own pytest process with a time limit (logs in /tmp/gpu-suites).
gpu-test:
	bash scripts/gpu_suites.sh kernels backend ddtree graphs auto schedule tiny oracle pair pairyarn serve
