# The two commands of the README: `make run` (the whole service on this machine) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on local disk for this pin; a GPU host brings its own CUDA torch.
TORCH_SPEC ?= torch==2.13.0

# run: the service stays up after the demo batch until Ctrl-C; demo-once: it stops after the batch.
.PHONY: setup run demo-once test test-fast bench-cpu clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (Debian package)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || \
	  { echo "redis-server is missing and could not be installed; install it and rerun" >&2; exit 1; }; }

# Ports of the Redis and S3 servers `make run` starts: `make run REDIS_PORT=6390 S3_PORT=8334` (default: free ones).
RUN_PORTS = $(if $(REDIS_PORT),--redis-port $(REDIS_PORT)) $(if $(S3_PORT),--s3-port $(S3_PORT))

run: setup
	$(PY) -m auk_dev.demo $(RUN_PORTS)

demo-once: setup
	$(PY) -m auk_dev.demo --once $(RUN_PORTS)

# docker-compose (Debian's) only validates docker-compose.yml in tests/test_compose.py, and kubectl only renders
# deploy/ with its built-in kustomize (v5, kubectl 1.27 or newer) in tests/test_k8s.py; where either cannot be
# installed those tests skip and say so.
test: setup
	@command -v docker-compose >/dev/null || { \
	  echo "installing docker-compose (Debian package) to validate docker-compose.yml"; \
	  (apt-get update -qq && apt-get install -y -qq docker-compose) >/dev/null 2>&1 || \
	  echo "docker-compose could not be installed: tests/test_compose.py will skip" >&2; }
	@command -v kubectl >/dev/null || { \
	  echo "installing kubectl (package kubectl) to render deploy/"; \
	  (apt-get update -qq && apt-get install -y -qq kubectl) >/dev/null 2>&1 || \
	  echo "kubectl could not be installed: tests/test_k8s.py will skip" >&2; }
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not service"

bench-cpu: setup
	$(PY) -m bench.pipeline --tiny --device cpu

clean:
	rm -rf $(VENV) run/
