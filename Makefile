# lakeshard — `make run` and `make test` do all set-up on first use:
# a Python 3.11 venv with pinned packages (constraints.txt) and the Delta JARs (Maven).
SHELL  := /bin/bash
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
JARS   := .jars
STAMP  := $(VENV)/.installed

.PHONY: setup jars run test lint bench clean kernel

setup: $(STAMP) $(JARS)/.complete

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: lakeshard needs Python 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $@

$(JARS)/.complete: jars/pom.xml
	@command -v java >/dev/null || { echo "java not found: Spark 4.1 needs Java 17 or 21 (apt-get install -y openjdk-17-jdk-headless)"; exit 1; }
	@command -v mvn >/dev/null || { echo "mvn not found: needed once to fetch the Delta JARs (apt-get install -y maven)"; exit 1; }
	rm -rf $(JARS) && mkdir -p $(JARS)
	mvn -q -B -f jars/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(JARS)
	touch $@

jars: $(JARS)/.complete

## The main job on the embedded default (conf/local.yaml): outputs under ./lakeshard-data
run: setup
	$(BIN)/lakeshard run

## The test suite (unit + end-to-end), same bootstrap
test: setup
	$(BIN)/pytest

## A Jupyter kernel "lakeshard" that runs the venv's python (for JupyterLab/VS Code)
kernel: setup
	$(BIN)/python -m ipykernel install --sys-prefix --name lakeshard --display-name "lakeshard (.venv)"

lint: setup
	$(BIN)/ruff check etl udfs tests bench

clean:
	rm -rf $(VENV) $(JARS) lakeshard-data .pytest_cache
