# The cmtune service: REST API, trial queue, config look-ups.  No JAX: the server never runs an op.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY cmtune ./cmtune
COPY collective_matmul ./collective_matmul
COPY tuner ./tuner
COPY workers ./workers
COPY service ./service
COPY migrations ./migrations
RUN pip install --no-cache-dir '.[service,postgres]'
COPY docker/service-entrypoint.sh /usr/local/bin/service-entrypoint.sh
ENV CMTUNE_HOST=0.0.0.0 CMTUNE_PORT=8470
EXPOSE 8470
ENTRYPOINT ["/usr/local/bin/service-entrypoint.sh"]
