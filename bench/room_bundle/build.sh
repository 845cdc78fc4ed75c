#!/usr/bin/env bash
# `make room-bundle`: what the room benchmark (bench/room.py) needs on the H200 machine, which
# reaches no package registry, in one git-ignored folder to carry (.roombundle/):
#   livekit-server.xz  livekit-server $LIVEKIT_SERVER_VERSION, static (CGO_ENABLED=0), stripped,
#                      xz with the x86 filter (~12 MB; 53 MB unpacked)
#   site.tar.xz        the Python packages that image lacks, for CPython 3.12 manylinux x86_64,
#                      installed --no-deps from pinned wheels (ROOM_WHEELS below) plus import
#                      stand-ins (bench/room_bundle/shims: av, livekit.local_inference, 35 MB
#                      wheels each that livekit-agents imports and the benchmark never calls;
#                      aiortc and aioice, which breezert's server app imports for the WebRTC
#                      endpoint that bench/room_engine.py never serves);
#                      livekit-agents' background-audio .ogg files, the SDK's Jupyter page and
#                      the type stubs are left out; jiter (openai's, imported lazily) too
#   tokenizer.json.xz  the tokenizer for random weights (../shared/breeze/tokenizer), cut to the
#                      merges the bench texts need (trim_tokenizer.py: same ids; 1.5 MB, not 3.1)
#   texts_en.tsv       the bench texts (../shared/bench), and COMMIT (the commit measured)
# bench/h200_session.sh's phase `room` unpacks it. A device call carries the working tree too
# (64 MiB in all): the script prints the sizes.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${ROOM_BUNDLE:-.roombundle}
work=.cache/room-bundle
py=${PY:-python3}
version=${LIVEKIT_SERVER_VERSION:-v1.13.5}
shared=${SHARED:-../shared}
mkdir -p "$out" "$work"

ROOM_WHEELS=(
  livekit==1.1.21 livekit-agents==1.8.9 livekit-api==1.2.2 livekit-protocol==1.1.29
  livekit-blingfire==1.2.0 protobuf==7.36.2 pyjwt==2.15.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 soxr==1.1.0 prometheus-client==0.26.0
  docstring-parser==0.18.0 eval-type-backport==0.4.0 json-repair==0.63.5 nest-asyncio==1.6.0
  openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 sniffio==1.3.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-http-transport==0.66b2 googleapis-common-protos==1.76.0
)

# 1. livekit-server: static and stripped (the Makefile's own build is dynamic, with debug info)
if [ ! -s "$out/livekit-server.xz" ]; then
  if [ ! -x "$work/bin/server" ]; then
    command -v go >/dev/null || { echo "go not found: install Go >= 1.26" >&2; exit 1; }
    echo "building livekit-server $version (static, stripped; a few minutes)"
    CGO_ENABLED=0 GOBIN="$PWD/$work/bin" GOFLAGS=-trimpath \
      go install -ldflags="-s -w" "github.com/livekit/livekit-server/cmd/server@$version"
  fi
  xz --x86 --lzma2=preset=9e,dict=64MiB -T1 -c "$work/bin/server" > "$out/livekit-server.xz.tmp"
  mv "$out/livekit-server.xz.tmp" "$out/livekit-server.xz"
fi

# 2. the Python packages
rm -rf "$work/site" "$work/wheels" && mkdir -p "$work/wheels" "$work/site"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$work/wheels" "${ROOM_WHEELS[@]}"
for wheel in "$work"/wheels/*.whl; do "$py" -m zipfile -e "$wheel" "$work/site"; done
cp -r bench/room_bundle/shims/. "$work/site/"
rm -rf "$work"/site/livekit/agents/resources/*.ogg "$work"/site/livekit/rtc/resources/jupyter-html \
  "$work"/site/livekit/rtc/resources/livekit_ffi.h
find "$work/site" -name "*.pyi" -delete
find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cf - . | xz --x86 --lzma2=preset=9e,dict=64MiB -T1 > "$out/site.tar.xz.tmp"
mv "$out/site.tar.xz.tmp" "$out/site.tar.xz"

# 3. data
# the merges the bench texts need only (same ids; checked on every text, sentence and word)
"$py" bench/room_bundle/trim_tokenizer.py "$shared/breeze/tokenizer/tokenizer.json" \
  "$shared/bench/texts_en.tsv" "$work/tokenizer.json"
xz -9e -c "$work/tokenizer.json" > "$out/tokenizer.json.xz"
cp "$shared/bench/texts_en.tsv" "$out/"
git rev-parse --short HEAD > "$out/COMMIT"

du -b "$out"/* | awk '{printf "%8.1f MiB  %s\n", $1 / 1048576, $2}'
du -cb "$out"/* | tail -1 | awk '{printf "%8.1f MiB  total\n", $1 / 1048576}'
git ls-files -z | xargs -0 du -cb --apparent-size | tail -1 \
  | awk '{printf "%8.1f MiB  the tracked tree (travels with every call; 64 MiB in all)\n", $1 / 1048576}'
