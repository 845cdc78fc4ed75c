# BreezeRT on an NVIDIA GPU. Build: docker build -t breezert .
# Run:   docker run --gpus all -p 8080:8080 -v /path/to/Breeze-TTS-2:/model breezert \
#          breezert synth --model /model --text "Hello" --out /tmp/out.wav
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-pip libsndfile1 ffmpeg \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/breezert
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# CUDA build of torch (the default PyPI wheel); the CPU wheel is only for laptops and CI.
RUN pip install "torch>=2.8"
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY breezert_agent ./breezert_agent
COPY configs ./configs
# The runtime (breezert, with its engine and server) and the LiveKit plugin beside it. The
# benchmark harness (bench/, `breezert-bench`) is the lab's and stays out of the image.
RUN pip install "./runtime[engine,serve]" ".[local]"

EXPOSE 8080
CMD ["breezert", "--help"]
