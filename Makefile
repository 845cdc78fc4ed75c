# BreezeRT Agent: two commands on a fresh machine.
#   make run   create .venv, install, serve the embedded tiny model (demo page, HTTP, WS, WebRTC)
#   make test  create .venv, install (plus Chromium for the browser test), run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TINY   ?= .cache/models/tiny
STAMP  := $(VENV)/.installed

.PHONY: run test install chromium synth bench-cpu clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU torch wheel: a bare 'torch' would pull a multi-GB CUDA build.
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[test,serve,agents,bench]"
	touch $(STAMP)

install: $(STAMP)

# The headless-browser test needs Debian's chromium; without it that one test skips.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
	  || echo "warning: chromium could not be installed; the browser test will skip"; }

run: $(STAMP)
	$(VENV)/bin/breezert serve --config cpu-tiny

test: $(STAMP) chromium
	$(PY) -m pytest -q

$(TINY)/config.json: | $(STAMP)
	$(VENV)/bin/breezert init-random --preset tiny --out $(TINY)

# One utterance to a WAV with the CLI, on a tiny random checkpoint folder.
synth: $(STAMP) $(TINY)/config.json
	$(VENV)/bin/breezert synth --model $(TINY) --text "Hello from BreezeRT, streaming speech in tens of milliseconds." --max-frames 60 --out .cache/hello.wav

bench-cpu: $(STAMP)
	$(VENV)/bin/breezert bench --config cpu-tiny --concurrency 1,4,8 --num-requests 24 --variants fixed16-eager,progressive-eager,naive --naive-requests 4

clean:
	rm -rf $(VENV) .cache
