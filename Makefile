# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The CPU wheel of torch next to the project (../shared/wheels), when there is one: PyPI's
# torch==2.13.0 is a multi-GB CUDA build. Without the folder pip resolves torch as usual.
WHEELS := $(wildcard ../shared/wheels)
export PIP_FIND_LINKS := $(if $(WHEELS),$(abspath $(WHEELS)),$(PIP_FIND_LINKS))

.PHONY: demo test test-serial lint docs bench clean image

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[train,k8s,slurm,dev,frameworks]'
	touch $@

## demo: train examples/quickstart.yaml as local processes (gloo on CPU) and print the summary
demo: $(STAMP)
	$(VENV)/bin/ddpkit validate examples/quickstart.yaml
	rm -rf runs/quickstart  # a fresh run each time (a finished job would otherwise not train again)
	$(VENV)/bin/ddpkit run examples/quickstart.yaml --local

## test: the whole test suite (end-to-end tests skip off-CI when root/Slurm/Docker are missing),
##   the Kubernetes testbed's tier as a second pytest session beside the rest (tests/run.py);
##   with PYTEST_ARGS (`make test PYTEST_ARGS="-k lint"`) one plain session
test: $(STAMP)
	$(PY) -m tests.run $(PYTEST_ARGS)

## test-serial: the whole suite as one pytest session, one test after the other (~68 min cold)
test-serial: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

## docs: regenerate the job-file reference (docs/reference.md) from the model's field descriptions
docs: $(STAMP)
	$(PY) -m deploy.docs --write docs/reference.md

## image: the training image; offline from a wheelhouse (air-gapped):
##   make image WHEELHOUSE=wheels BASE_IMAGE=ddpkit-base:bookworm
IMAGE ?= ddpkit:0.1
image: $(STAMP)
	$(VENV)/bin/ddpkit image build --tag $(IMAGE) $(if $(WHEELHOUSE),--offline --wheelhouse $(WHEELHOUSE)) $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE))

## bench: every bench/ script (~20 min), then bench/report/BENCHMARKS.md and its charts.
##   make bench BENCH_UP=1 (root) brings up the Docker testbed for it; BENCH_ARGS="--only NAME" / "--quick"
bench: $(STAMP)
	$(PY) bench/run_all.py $(if $(BENCH_UP),--up) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
