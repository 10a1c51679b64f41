# The Homefleet image for compose.yaml: the server's API, its worker, Flower, and Linux workers.
# torch is installed FIRST and pinned, from the index given by TORCH_INDEX_URL: the CPU wheels
# by default (an unpinned torch pulls a multi-GB CUDA build, docs/operations.md);
# a CUDA worker's image is built with a CUDA index, e.g.
#   docker compose --profile cuda build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 cuda-worker
# Apple-Silicon Macs run `homefleet worker` natively: a Linux container has no MPS.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/homefleet
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY app app
COPY tasks tasks
COPY routing routing
COPY residency residency
RUN pip install .

RUN useradd --create-home --uid 1000 homefleet && mkdir -p /data /models && chown homefleet /data /models
USER homefleet
WORKDIR /home/homefleet
CMD ["homefleet", "--help"]
