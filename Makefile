# `make demo` runs the main job on a shipped example; `make test` runs the whole suite.
# Both create .venv and install what they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e ".[torch,test]"
	touch $(STAMP)

# The editable install runs the package from its sources; compile their bytecode as a
# wheel's install would (Python reads it even under PYTHONDONTWRITEBYTECODE, and skips
# a file whose source changed since): each command then starts 0.1 s sooner.
BYTECODE := $(BIN)/python -m compileall -q mpipe_verified proofs

install: $(STAMP)
	$(BYTECODE)

demo: $(STAMP)
	$(BYTECODE)
	$(BIN)/mpipe-verify show examples/zb-h1.toml
	$(BIN)/mpipe-verify check examples/zb-h1.toml
	$(BIN)/mpipe-verify export examples/zb-h1.toml --to torch-csv -o out/zb-h1.csv
	$(BIN)/mpipe-verify check out/zb-h1.csv --certificate-out out/zb-h1.csv.cert.json
	@echo "lowered plan written to out/zb-h1.csv and verified as written"
	$(BIN)/mpipe-verify recheck out/zb-h1.csv out/zb-h1.csv.cert.json
	$(BIN)/mpipe-run --nproc 4 examples/train_tiny_mllm.py --schedule transpose --steps 20

test: $(STAMP)
	$(BYTECODE)
	$(BIN)/python -m pytest -q

.PHONY: install demo test
