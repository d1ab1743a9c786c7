# A cmtune worker.  ACCELERATOR=cpu (default), tpu (JAX's TPU build) or cuda (CUDA 12 GPUs).
# It installs JAX and the worker's HTTP client, not the service's web and database stack.
FROM python:3.11-slim
ARG ACCELERATOR=cpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY cmtune ./cmtune
COPY collective_matmul ./collective_matmul
COPY tuner ./tuner
COPY workers ./workers
COPY service ./service
COPY migrations ./migrations
RUN pip install --no-cache-dir '.[jax]' && \
    case "$ACCELERATOR" in \
      cpu) ;; \
      tpu) pip install --no-cache-dir 'jax[tpu]' ;; \
      cuda) pip install --no-cache-dir 'jax[cuda12]' ;; \
      *) echo "ACCELERATOR must be cpu, tpu or cuda, not $ACCELERATOR" >&2; exit 1 ;; \
    esac
ENV CMTUNE_SERVER=http://service:8470
# --devices auto uses the accelerators JAX finds; the compose file runs 8 virtual CPU devices.
ENTRYPOINT ["cmtune", "worker"]
CMD ["--devices", "auto"]
