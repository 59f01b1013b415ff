# The README's two commands: `make quickstart` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
export UV_LINK_MODE := copy
# Installed packages are compiled to bytecode once, here: uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set Python never writes it, so every process (each test's trainer) would compile
# torch's and transformers' sources again: 12 s of imports instead of 6 on a 2-core machine.
export UV_COMPILE_BYTECODE := 1

.PHONY: quickstart test test-quick install rust-test lint wheel clean container-test container-clean

# The venv and its tools are made once; torch (several GB) comes from uv's cache after the first time.
$(VENV)/bin/maturin:
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv
	$(UV) pip install --python $(PY) 'maturin>=1.8,<2'

# Builds the Rust extension into trainer/ and installs the package (editable) with its dependencies and the dev
# tools. cargo is incremental, so this is quick when nothing changed.
install: $(VENV)/bin/maturin
	@echo "install: the Rust loader (release, LTO) and the package; the first build takes 3-5 minutes on 2 cores"
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release --uv -E dev -q
	$(PY) -m compileall -q -j 0 trainer

# Trains the tiny model, then uses it: a recipe for typed ingredients (JSON on stdout), and the evaluation table on
# the recipes the training held out (--split eval reads the share from the model's recipe_template.json).
quickstart: install
	$(VENV)/bin/trainer train --config configs/quickstart.yaml
	$(VENV)/bin/trainer generate --model outputs/quickstart/final \
		--ingredients "2 eggs; 1 cup all-purpose flour; 1 cup milk; 2 tablespoons butter, melted; 1 pinch salt"
	$(VENV)/bin/trainer evaluate --model outputs/quickstart/final --data data/quickstart/recipes.csv \
		--split eval --output outputs/quickstart/eval_report.json

rust-test:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo test --workspace --release

lint: install
	$(VENV)/bin/ruff check trainer tests bench
	$(VENV)/bin/ruff format --check trainer tests bench
	$(VENV)/bin/lint-imports

# pytest on every core (pytest-xdist); the slowest 15 tests are listed at the end, and the ones that take over
# 20 s without saying why (tests/conftest.py).
test: install rust-test lint
	$(VENV)/bin/pytest -q -n auto --durations=15

# The quick loop while changing Python: lint and every test not marked slow, on every core (a few minutes).
test-quick: install
	$(VENV)/bin/ruff check trainer tests bench
	$(VENV)/bin/pytest -q -n auto -m "not slow and not container"

# The image built by a real Docker engine and used as the README says, on the CPU (docker/test/run.sh says how;
# tests/test_container_engine.py says what). Starts an engine if none answers; stand-in base images where no
# container registry is reachable.
container-test: install
	docker/test/run.sh

# The images and build cache container-test leaves for its next run (and the image a rebuild replaced).
container-clean:
	-docker image rm recipe-t5-trainer:container-test recipe-t5-standin/rust:1.95.0-bookworm \
		recipe-t5-standin/cuda:13.0.2-base
	-docker image prune --force
	-docker builder prune --force

wheel: $(VENV)/bin/maturin
	$(VENV)/bin/maturin build --release --out dist

clean:
	rm -rf target dist $(VENV)
