# The two commands:  make demo   (built-in dataset end to end)   and   make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= data/demo
RECORDS ?= records/demo
DEMO_SIZE ?= 64
RUN ?= runs/demo
# TensorFlow's caching (BFC) allocator for CPU tensors, as it uses on GPUs: without it CPU training spends much of
# its time in the kernel, mapping and clearing fresh pages for every step's activations (an epoch of 8 virtual
# replicas took 15-19 s with it, 20-27 s without, docs/project/tests.md). Set for the processes make starts (the
# demo, the tests, CI), never by tfpipe itself; `make test TF_CPU_ALLOCATOR_USE_BFC=false` compares.
export TF_CPU_ALLOCATOR_USE_BFC ?= true
# Python writes the bytecode of what it imports (into the venv and __pycache__/), once per module: `make setup`
# installs with --no-compile, and a shell that sets PYTHONDONTWRITEBYTECODE (many Docker images do, this project's
# CI machines too) would otherwise compile TensorFlow's modules anew in every process: importing TensorFlow and
# tf-keras took 22 s each time instead of 9 s (docs/project/tests.md, sixth round).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-slow test-bench test-install test-slow-install test-xla lint docs bench clean

setup: $(VENV)/.installed

# The lock (requirements.txt) and the package itself, editable, resolved together: pip refuses a lock that does
# not satisfy pyproject.toml's declared ranges, so the two cannot drift apart. --no-compile (uv's default): Python
# compiles a module's bytecode when it is first imported, once, instead of pip compiling every module of
# TensorFlow and torch up front (118 s instead of 175 s; the first import of everything then takes 13 s longer).
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt -e ".[dev,tensorflow]"
	touch $@

demo: setup
	$(PY) -m tfpipe.demo $(DEMO_DIR)
	$(PY) -m tfpipe.write --csv $(DEMO_DIR)/train.csv --images $(DEMO_DIR)/images --out $(RECORDS)/train \
		--image-size $(DEMO_SIZE) --num-folds 5 --overwrite
	$(PY) -m tfpipe.write --csv $(DEMO_DIR)/test.csv --images $(DEMO_DIR)/images --out $(RECORDS)/test \
		--split test --unlabeled --image-size $(DEMO_SIZE) --overwrite
	rm -f $(RECORDS)/contact_sheet.png  # the demo's own sheet (one written before sheets carried their mark)
	$(PY) -m tfpipe.inspect $(RECORDS)/train --sheet $(RECORDS)/contact_sheet.png
	rm -rf $(RUN)
	$(PY) -m train.fit --records $(RECORDS)/train --run $(RUN) --strategy cpu --replicas 8 \
		--steps-per-execution 5 --model small-cnn --batch-size 8 --epochs 12 --lr 5e-4 --swa-epochs 3 --seed 0
	$(PY) -m train.predict --run $(RUN) --records $(RECORDS)/test --out $(RUN)/submission.csv \
		--strategy cpu --replicas 8 --tta 2

# pytest on both cores (pytest-xdist): tests that share an expensive session fixture (one trained run, one slow
# source) run on one worker (conftest.py groups them), so each is built once; the 15 slowest tests are printed.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadgroup --durations 15
# The tests that must run alone, after the parallel ones: the silence test times gaps on 2 cores; XLA compiles the
# EfficientNet-B0 preflight on every core (115 s alone, up to 515 s beside the others); the two-worker test's
# resumed job lost TensorFlow's coordination heartbeat once beside the others.
SERIAL := $(PY) -m pytest -q --durations 15 -m "serial and not install and not xla"

# The default run (goal: under 6 minutes on 2 cores; 3.2 on a clean clone on 2026-11-26, 6.2 on a slow hour: docs/project/tests.md); the slow tests (each over
# ~20 s: whole chains, the notebook, learning, kills and resumes; the rest of the model and optimizer tables) and the
# benchmark smoke test run in `make test-slow`, which CI runs right after it. The tests marked `backends` run a second
# time on Keras 3 + JAX (TFPIPE_TEST_BACKEND=jax: a process has one Keras), fast and slow alike, in `make test-slow`
# (in `make test` its start-up alone took 66 s of the 6 minutes: issue #64).
test: setup
	$(PYTEST) -m "not slow and not bench and not install"

test-slow: setup
	$(PYTEST) -m "(slow or bench) and not serial and not install and not xla"
	TFPIPE_TEST_BACKEND=jax $(PYTEST) -m "backends and not bench and not serial and not install and not xla"
	$(SERIAL)

test-bench: setup
	$(PY) -m pytest -q -m bench

# The built wheel installed into fresh venvs that already hold a user's TensorFlow (oldest supported, 2.19, newest
# pinned): versions kept, write -> fit (8 replicas) -> predict from outside the repo, the notebook cells of docs/guides/notebook.md, Beam workers.
test-install: setup
	$(PYTEST) -m "install and not xla"

# What CI runs after `make test`: test-slow and test-install in one parallel run (apart, each stage's last long test
# left a core idle until it ended), then the serial tests alone.
test-slow-install: setup
	$(PYTEST) -m "(slow or bench or install) and not serial and not xla"
	TFPIPE_TEST_BACKEND=jax $(PYTEST) -m "backends and not bench and not serial and not install and not xla"
	$(SERIAL)

# The wheel next to torch 2.9 + torch_xla 2.9 + timm (a TPU image's PyTorch; several GB of downloads, about 8
# minutes): examples/torch_ddp.py --xla on an XLA CPU device and a timm model. Not in .ci/run (its time budget).
test-xla: setup
	$(PY) -m pytest -q -m xla

# ruff (lint and format check) and mypy (every function typed, configured in pyproject.toml): zero findings.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The docs site (mkdocs-material) with the API reference generated from the docstrings, into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(PY) -m bench

clean:
	rm -rf $(DEMO_DIR) $(RECORDS) $(RUN)
