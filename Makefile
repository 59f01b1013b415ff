# The README's two commands: `make quickstart` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
export UV_LINK_MODE := copy

.PHONY: quickstart test install rust-test lint wheel clean

# Dependencies (torch is several GB) are installed once per venv; uv's cache makes a fresh venv cheap.
$(VENV)/.deps-installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check uv
	$(UV) pip install --python $(PY) -e '.[dev]'
	touch $@

# Rebuilds the Rust extension in place (cargo is incremental, so this is quick when nothing changed).
install: $(VENV)/.deps-installed
	PATH=$(abspath $(VENV))/bin:$$PATH VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --uv -q

quickstart: install
	$(VENV)/bin/trainer train --config configs/quickstart.yaml

rust-test:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --release -- -D warnings
	cargo test -p recipe_core --release

lint: $(VENV)/.deps-installed
	$(VENV)/bin/ruff check trainer tests bench
	$(VENV)/bin/ruff format --check trainer tests bench

test: install rust-test lint
	$(VENV)/bin/pytest -q

wheel: $(VENV)/.deps-installed
	$(VENV)/bin/maturin build --release --out dist

clean:
	rm -rf target dist $(VENV)
