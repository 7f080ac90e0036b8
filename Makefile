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

# On the accelerator machine (kit installed, see README): GPU tests only.
gpu-test:
	python3 -m pytest -q tests/gpu
