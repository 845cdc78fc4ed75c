# BreezeRT Agent: two commands on a fresh machine.
#   make run   create .venv, install the runtime and the plugin, serve the embedded tiny model
#              (demo page, HTTP, WS, WebRTC)
#   make test  create .venv, install (plus the training and benchmark distributions, Chromium for the browser
#              test, the LiveKit server and livekit-client for the real-room tests, LiveKit SIP,
#              Redis and baresip for the SIP test), run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TINY   ?= .cache/models/tiny
STAMP  := $(VENV)/.installed

.PHONY: run test test-gpu test-stall install chromium livekit-server livekit-web telephony-deps \
        livekit-sip synth \
        bench-cpu bench-livekit-room room-bundle train-texts train-wheels clean

# Four distributions: runtime/pyproject.toml is `breezert` (torch only in its `engine` extra),
# pyproject.toml is `breezert-agent` (the LiveKit plugin; `local` = in-process engine), and
# training/pyproject.toml is `breezert-train` (the voice's training code) and bench/pyproject.toml
# `breezert-bench` (the benchmark harness, `breezert-bench` and `breezert-bench soak`): `make test`
# installs both, `make run` neither.
TRAIN_STAMP := $(VENV)/.installed-train
BENCH_STAMP := $(VENV)/.installed-bench

$(STAMP): pyproject.toml runtime/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU wheel where pip's find-links has one, else PyPI's CUDA build
	# (which brings its own triton).
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e "./runtime[engine,serve]" -e ".[local,test]"
	# The fused-kernel CPU tests run Triton's interpreter: add triton only where torch brought
	# none (the CPU wheel), on Linux x86_64 only (no other wheels).
	if [ "$$(uname -s)-$$(uname -m)" = "Linux-x86_64" ]; then \
	  $(PY) -c "import triton" 2>/dev/null || $(PIP) install "triton==3.6.0"; fi
	touch $(STAMP)

# Issue 19's teacher (hibari-tts + onnxruntime, ~42 MB of wheels) and the quality gate's
# pocketsphinx (29 MB) come with it, so that the teacher and ASR gate tests run instead of skipping.
# The training code records where it ran with the harness's provenance, so the harness comes first.
$(TRAIN_STAMP): training/pyproject.toml $(BENCH_STAMP)
	$(PIP) install -e ./training
	touch $(TRAIN_STAMP)

# The benchmark harness (and matplotlib for its PNGs): the tests of the harness, the soak check,
# and the real-room and server tests' free ports (breezert_bench.ports) need it.
$(BENCH_STAMP): bench/pyproject.toml $(STAMP)
	$(PIP) install -e ./bench
	touch $(BENCH_STAMP)

install: $(STAMP) $(BENCH_STAMP) $(TRAIN_STAMP)

# The headless-browser tests need Debian's chromium: without it they fail under CI=true (with
# the last lines of .cache/chromium-install.log), and skip elsewhere.
chromium:
	@command -v chromium >/dev/null 2>&1 || { mkdir -p .cache; \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
	    >.cache/chromium-install.log 2>&1 \
	  || echo "warning: chromium could not be installed (.cache/chromium-install.log); the browser tests will fail under CI=true, skip elsewhere"; }

# The real-room tests (tests/livekit): livekit-server at a pinned release, built from its Go module
# through the Go module proxy (v1.13.5's go.mod has no replace directives, so `go install
# pkg@version` works; it needs Go >= 1.26); ~5 min on two cores the first time, then cached.
# Without Go, or when the build fails, `make test` still runs and those tests fail under CI=true
# (skip elsewhere) with the last lines of .cache/livekit/build.log.
LIVEKIT_SERVER_VERSION ?= v1.13.5
LIVEKIT_DIR            := .cache/livekit
LIVEKIT_WEB            := bench/web

livekit-server:
	@mkdir -p $(LIVEKIT_DIR)
	@if [ -x $(LIVEKIT_DIR)/livekit-server ]; then :; \
	elif ! command -v go >/dev/null 2>&1; then \
	  echo "go not found on PATH: install Go >= 1.26 to build livekit-server" | tee $(LIVEKIT_DIR)/build.log; \
	else \
	  echo "building livekit-server $(LIVEKIT_SERVER_VERSION) (go install, a few minutes the first time)"; \
	  if GOBIN="$(abspath $(LIVEKIT_DIR))/bin" go install \
	       github.com/livekit/livekit-server/cmd/server@$(LIVEKIT_SERVER_VERSION) >$(LIVEKIT_DIR)/build.log 2>&1; then \
	    mv $(LIVEKIT_DIR)/bin/server $(LIVEKIT_DIR)/livekit-server && rm -rf $(LIVEKIT_DIR)/bin; \
	  else echo "warning: livekit-server build failed (see $(LIVEKIT_DIR)/build.log); tests/livekit will fail under CI=true"; fi; \
	fi

# The SIP test (tests/livekit/test_sip.py): LiveKit SIP at a pinned release from its Go module
# through the Go module proxy, plus Debian's Redis (SIP and the server talk through it), baresip
# (the caller) and the C libraries SIP's cgo media code links (opus, opusfile, soxr).
# v1.8.0 is the newest release the proxy serves here; its protocol and psrpc (v0.7.2) match what
# livekit-server v1.13.5 speaks. `go install pkg@version` refuses it (the proxy has no version
# list for the deprecation check), so the module is downloaded and built inside a copy of it;
# ~3 min on two cores the first time, then cached. A missing tool or a failed build makes the
# SIP test fail under CI=true (skip elsewhere) with the last lines of .cache/livekit/sip-build.log
# or .cache/livekit/telephony-deps.log.
LIVEKIT_SIP_VERSION ?= v1.8.0
TELEPHONY_DEBS      := redis-server baresip-core pkg-config libopus-dev libopusfile-dev libsoxr-dev

telephony-deps:
	@missing=""; for p in $(TELEPHONY_DEBS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then mkdir -p $(LIVEKIT_DIR); \
	  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing) \
	    >$(LIVEKIT_DIR)/telephony-deps.log 2>&1 \
	  || echo "warning: could not install$$missing ($(LIVEKIT_DIR)/telephony-deps.log); the SIP test will fail under CI=true"; fi

livekit-sip: telephony-deps
	@mkdir -p $(LIVEKIT_DIR)
	@if [ -x $(LIVEKIT_DIR)/livekit-sip ]; then :; \
	elif ! command -v go >/dev/null 2>&1; then \
	  echo "go not found on PATH: install Go >= 1.26 to build livekit-sip" | tee $(LIVEKIT_DIR)/sip-build.log; \
	else \
	  echo "building livekit-sip $(LIVEKIT_SIP_VERSION) (go build, a few minutes the first time)"; \
	  src="$(abspath $(LIVEKIT_DIR))/sip-src"; rm -rf "$$src"; \
	  info=$$(go mod download -json github.com/livekit/sip@$(LIVEKIT_SIP_VERSION) 2>&1); \
	  echo "$$info" >$(LIVEKIT_DIR)/sip-build.log; \
	  if dir=$$(echo "$$info" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p') && [ -n "$$dir" ] \
	     && cp -r "$$dir" "$$src" && chmod -R u+w "$$src" \
	     && (cd "$$src" && CGO_ENABLED=1 go build -buildvcs=false -o ../livekit-sip.tmp ./cmd/livekit-sip) \
	          >>$(LIVEKIT_DIR)/sip-build.log 2>&1; then \
	    mv $(LIVEKIT_DIR)/livekit-sip.tmp $(LIVEKIT_DIR)/livekit-sip; \
	  else echo "warning: livekit-sip build failed (see $(LIVEKIT_DIR)/sip-build.log); the SIP test will fail under CI=true"; fi; \
	  rm -rf "$$src"; \
	fi

# livekit-client for the browser listener page (the real-room tests, bench/room.py
# --browser-listeners), pinned in bench/web/package-lock.json and served on loopback (no CDN).
livekit-web:
	@test -f $(LIVEKIT_WEB)/node_modules/livekit-client/dist/livekit-client.esm.mjs || \
	  npm ci --prefix $(LIVEKIT_WEB) --no-audit --no-fund --loglevel=error || \
	  echo "warning: npm ci failed; the real-room browser tests will fail"

# Issue 19's training text (python -m breezert_train.teacher_data reads them): the KJV Bible
# (decoded by bible-kjv's `bible`), fortunes and WordNet, all Debian main.
TRAIN_TEXT_DEBS := bible-kjv bible-kjv-text fortunes wordnet-base

train-texts:
	@missing=""; for p in $(TRAIN_TEXT_DEBS); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi

# The teacher's wheel for a GPU machine that reaches no index (Python 3.12 there): carry
# .whl-train/ (14 MB; the GPU image's own onnxruntime 1.30 runs it) apart from .whl/, so that the
# voice calls' carry (tree, wheels, corpus, the codec's snapshot) stays under its 64 MiB.
# The GPU call's training wheels (cp312): the teacher in .whl-train (14 MB; codec calls), the
# in-run scorer's pocketsphinx in .whl-asr without its 23.5 MB word model (5.7 MB; every voice
# call; run_wer builds its own model). 5.0.4: pocketsphinx 5.1.1 has no cp312 wheel.
train-wheels: $(STAMP) $(TRAIN_STAMP)
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl-train \
	  "hibari-tts==0.2.1"
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .cache/asr-wheel \
	  "pocketsphinx==5.0.4"
	$(PY) -m breezert_train.slim_wheel .cache/asr-wheel/pocketsphinx-5.0.4-*.whl .whl-asr \
	  --drop pocketsphinx/model/en-us/en-us.lm.bin

# Issue 34's room benchmark on the H200 machine (no registry there): a static, stripped
# livekit-server (xz), the Python packages that image lacks for CPython 3.12 (livekit,
# livekit-agents, pydantic, ...; two import stand-ins for wheels too big to carry), the
# tokenizer cut to the bench texts' merges and the texts, in .roombundle/ (git-ignored; ~25 MiB,
# which with the tree's ~39 MiB fits one call's 64 MiB). Carry only .roombundle to phase `room`
# of bench/h200_session.sh. A few minutes the first time (the server's Go build).
room-bundle: $(STAMP)
	PY=$(abspath $(PY)) LIVEKIT_SERVER_VERSION=$(LIVEKIT_SERVER_VERSION) bash bench/room_bundle/build.sh

run: $(STAMP)
	$(VENV)/bin/breezert serve --config cpu-tiny

# Two runs: the CPU-bound tests without real-time bounds (unit, golden) two at a time with
# pytest-xdist, then those with real-time bounds (servers, rooms, SIP, soak: integration,
# livekit) and the GPU ones (one GPU; they skip without CUDA) one at a time. Both run; either
# failing fails the target. Skip reasons are listed (-rs), real-time retries in the summary and,
# with every test's outcome, in .cache/junit-*.xml (property realtime_retry).
PYTEST_PARALLEL ?= 2

test: $(STAMP) $(BENCH_STAMP) $(TRAIN_STAMP) chromium livekit-server livekit-web livekit-sip
	@mkdir -p .cache
	status=0; \
	$(PY) -m pytest -q -rs -n $(PYTEST_PARALLEL) --durations=15 -m "unit or golden" \
	  --junitxml=.cache/junit-unit-golden.xml || status=$$?; \
	$(PY) -m pytest -q -rs --durations=25 -m "integration or livekit or gpu" \
	  --junitxml=.cache/junit-realtime.xml || status=$$?; \
	exit $$status

# The GPU tier in one command on a CUDA machine: every gpu-marked test (tests/gpu and any other),
# with CUDA required (BREEZERT_REQUIRE_CUDA=1: no CUDA is a usage error, not 74 skips). Run it
# before a change to kernels, stages or graphs lands and quote its count. Where the venv cannot
# be built (the H200 image has no index), `make test-gpu STAMP= BENCH_STAMP= TRAIN_STAMP=
# PY=python3` with PYTHONPATH=runtime:bench:training:. (every test file is collected).
test-gpu: $(STAMP) $(BENCH_STAMP) $(TRAIN_STAMP)
	BREEZERT_REQUIRE_CUDA=1 $(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 -m gpu tests

# Proof that the real-time checks can fail: the room, SIP and WebRTC checks run once each with a
# 150 ms stall injected after each engine request's first chunk (BREEZERT_INJECT_STALL_MS) and
# must each go red on a real-time miss (tests/stall_proof.py; about 3 minutes, not in `make test`).
test-stall: $(STAMP) $(BENCH_STAMP) chromium livekit-server livekit-web livekit-sip
	$(PY) -m tests.stall_proof

$(TINY)/config.json: | $(STAMP)
	$(VENV)/bin/breezert init-random --preset tiny --out $(TINY)

# One utterance to a WAV with the CLI, on a tiny random checkpoint folder.
synth: $(STAMP) $(TINY)/config.json
	$(VENV)/bin/breezert synth --model $(TINY) --text "Hello from BreezeRT, streaming speech in tens of milliseconds." --max-frames 60 --out .cache/hello.wav

# Issue 15, item 5: 20 turns in a real room (CPU tiny model), first audio at the livekit.rtc and
# the browser participant against the agent's TTFB, as JSON (docs/livekit-plugin.md's table).
bench-livekit-room: $(STAMP) $(BENCH_STAMP) chromium livekit-server livekit-web
	BREEZERT_ROOM_TURNS=20 \
	BREEZERT_ROOM_RESULTS=bench/results/livekit-room-cpu-tiny-$$(date -u +%Y%m%d).json \
	  $(PY) -m pytest -q -s tests/livekit/test_room_latency.py

bench-cpu: $(BENCH_STAMP)
	$(VENV)/bin/breezert-bench --config cpu-tiny --concurrency 1,4,8 --num-requests 24 --variants fixed16-eager,progressive-eager,naive --naive-requests 4

clean:
	rm -rf $(VENV) .cache
