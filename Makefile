# lakeshard — `make run` and `make test` do all set-up on first use:
# a Python 3.11 venv with pinned packages (constraints.txt) and the Delta JARs (Maven).
# The S3A connector JARs (`make jars-s3a`, 12 MB) are fetched only by `make test` and by
# whoever runs with storage on s3:// -- `make run` on local disk never needs them -- and
# headless Chromium (`make browser`) only by `make test`.
SHELL  := /bin/bash
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
JARS   := .jars
STAMP  := $(VENV)/.installed
# Everything a local run and the tests use: Spark + Delta (a platform runtime brings its
# own), the caption/search/report/samples stacks, the test tools (pyproject.toml).
EXTRAS := spark,caption,search,report,samples,test

.PHONY: setup jars jars-s3a jars-spark40 run test test-platforms test-emr8 lint bench clean kernel browser wheel artifacts

## What `make run` needs: the venv and the Delta JARs. The test tools add theirs (`test`).
setup: $(STAMP) $(JARS)/.complete

## Headless Chromium (Debian's package) for the one report test that screenshots the
## report; set up by `make test` only. Installed when missing if apt-get can run as root.
## Another apt process (a first boot's unattended upgrades) may hold apt's locks: the
## install waits for dpkg's lock (DPkg::Lock::Timeout); `apt-get update` does not honour
## that option for its lists lock (apt 2.6), so it is retried while the lock is held.
## If apt still cannot install it, set-up goes on and that one test is skipped.
APT_GET := apt-get -qq -o DPkg::Lock::Timeout=300
BROWSER_HINT := chromium not found: the report screenshot test will be skipped (apt-get install chromium)
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    for i in $$(seq 30); do \
	      out=$$($(APT_GET) update 2>&1) && break; \
	      case "$$out" in *"Could not get lock"*) echo "apt is busy (another process holds its lock): waiting"; sleep 10;; \
	        *) echo "$$out"; break;; esac; \
	    done; \
	    DEBIAN_FRONTEND=noninteractive $(APT_GET) install -y --no-install-recommends chromium \
	      || echo "$(BROWSER_HINT)"; \
	  else echo "$(BROWSER_HINT)"; fi; }

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: lakeshard needs Python 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

$(JARS)/.complete: jars/pom.xml
	@command -v java >/dev/null || { echo "java not found: Spark 4.1 needs Java 17 or 21 (apt-get install -y openjdk-17-jdk-headless)"; exit 1; }
	@command -v mvn >/dev/null || { echo "mvn not found: needed once to fetch the Delta JARs (apt-get install -y maven)"; exit 1; }
	rm -rf $(JARS) && mkdir -p $(JARS)
	mvn -q -B -f jars/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(JARS)
	touch $@

jars: $(JARS)/.complete

## Delta 4.0.0 for Spark 4.0 (emr-spark-8.0.0's Spark 4.0.2; the stand-ins of
## `make test-platforms`): the same pom with Delta's Spark-4.0 artifact, into .jars/spark40/.
$(JARS)/spark40/.complete: jars/pom.xml $(JARS)/.complete
	rm -rf $(JARS)/spark40 && mkdir -p $(JARS)/spark40
	mvn -q -B -f jars/pom.xml dependency:copy-dependencies -Ddelta.artifact=delta-spark_2.13 \
	  -Ddelta.version=4.0.0 -DoutputDirectory=$(CURDIR)/$(JARS)/spark40
	touch $@

jars-spark40: $(JARS)/spark40/.complete

## Hadoop S3A (hadoop-aws + the AWS SDK v2 modules it uses) for storage on s3:// or s3a://,
## into .jars/s3a/; lakeshard adds them to Spark only when a config needs them.
$(JARS)/s3a/.complete: jars/s3a/pom.xml $(JARS)/.complete
	rm -rf $(JARS)/s3a && mkdir -p $(JARS)/s3a
	mvn -q -B -f jars/s3a/pom.xml dependency:copy-dependencies -DoutputDirectory=$(CURDIR)/$(JARS)/s3a
	touch $@

jars-s3a: $(JARS)/s3a/.complete

## The main job on the embedded default (conf/local.yaml): outputs under ./lakeshard-data
run: setup
	$(BIN)/lakeshard run

## The import-layer contracts (pyproject.toml), then the test suite (unit + end-to-end;
## the object-storage tests run Spark with S3A against a local S3 server)
test: setup jars-s3a browser
	$(BIN)/lint-imports --no-logo
	$(BIN)/pytest

## The platform stand-ins (docs/operations.md, "Platforms"; ~14 min, not in `make test`):
## Python 3.12 venvs with the runtime's pyspark installed first, the built wheel as the
## platform installs it, then the deploy files' own entry points and arguments through
## spark-submit on the sample sources -- emr-spark-8.0.0 and DBR 17.3 (Spark 4.0.2,
## Delta 4.0.0), DBR 18 (Spark 4.1.x, Delta 4.4.0) -- and the wheel on Python 3.13.
PLATFORM_PYTEST := LAKESHARD_PLATFORMS=1 $(BIN)/pytest -p no:cacheprovider -m platform
test-platforms: setup $(JARS)/spark40/.complete
	$(PLATFORM_PYTEST) tests/test_platforms.py

## The emr-spark-8.0.0 cell alone (Python 3.12, Spark 4.0.2, Delta 4.0.0; ~4 min, a ~10 GB
## venv removed at the end), which `.ci/run` runs after `make test`: the code both Spark
## lines run is proven on 4.0 as well. A skip (no Python 3.12, no JARs) fails it.
test-emr8: setup $(JARS)/spark40/.complete
	@log=$$(mktemp); \
	$(PLATFORM_PYTEST) -rs tests/test_platforms.py::test_emr_spark_8_standin_runs_the_steps | tee $$log; \
	grep -qE '(^|[^0-9])1 passed' $$log; ok=$$?; rm -f $$log; \
	[ $$ok = 0 ] || { echo "test-emr8: the emr-spark-8.0.0 stand-in did not pass (see above)"; exit 1; }

## A Jupyter kernel "lakeshard" that runs the venv's python (for JupyterLab/VS Code)
kernel: setup
	$(BIN)/python -m ipykernel install --sys-prefix --name lakeshard --display-name "lakeshard (.venv)"
## The wheel a cluster installs (conf/*.yaml inside): dist/lakeshard-<version>-py3-none-any.whl
wheel: $(STAMP)
	rm -rf build dist/lakeshard-*.whl
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation --disable-pip-version-check -w dist .

## Everything a cluster needs, in one folder to upload: wheel, constraints, the JARs
## EMR's steps name (Delta 4.0.0), entrypoints, cluster configs (docs/operations.md)
artifacts: wheel $(JARS)/spark40/.complete
	rm -rf dist/artifacts && mkdir -p dist/artifacts/jars dist/artifacts/entrypoints dist/artifacts/conf
	cp dist/lakeshard-*.whl constraints.txt dist/artifacts/
	cp $(JARS)/spark40/delta-spark_2.13-4.0.0.jar $(JARS)/spark40/delta-storage-4.0.0.jar dist/artifacts/jars/
	cp etl/entrypoints/*.py dist/artifacts/entrypoints/
	cp conf/databricks.yaml conf/emr.yaml dist/artifacts/conf/
	cp deploy/emr-bootstrap.sh dist/artifacts/

lint: setup
	$(BIN)/ruff check etl udfs tests bench

clean:
	rm -rf $(VENV) $(JARS) lakeshard-data .pytest_cache
