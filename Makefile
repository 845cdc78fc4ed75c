# BreezeRT Agent: two commands on a fresh machine.
#   make run   create .venv, install, build the tiny random model on first use, run the main job
#   make test  create .venv, install, run the test suite (CPU)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TINY   ?= .cache/models/tiny
STAMP  := $(VENV)/.installed

.PHONY: run test install clean bench-cpu

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU torch wheel: a bare 'torch' would pull a multi-GB CUDA build.
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[test,serve,agents,bench]"
	touch $(STAMP)

install: $(STAMP)

$(TINY)/config.json: | $(STAMP)
	$(VENV)/bin/breezert init-random --preset tiny --out $(TINY)

run: $(STAMP) $(TINY)/config.json
	$(VENV)/bin/breezert synth --model $(TINY) --text "Hello from BreezeRT, streaming speech in tens of milliseconds." --out .cache/hello.wav

test: $(STAMP)
	$(PY) -m pytest -q

bench-cpu: $(STAMP) $(TINY)/config.json
	$(VENV)/bin/breezert bench --model $(TINY) --device cpu

clean:
	rm -rf $(VENV) .cache
