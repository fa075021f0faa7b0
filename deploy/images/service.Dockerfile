# The buffer, reward and rollout services: slipstream's base install, no torch (pyproject.toml's dependencies).
# Build from the repository root:  docker build -f deploy/images/service.Dockerfile -t slipstream-service .
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY slipstream ./slipstream
COPY services ./services
RUN pip install --no-cache-dir --no-compile . && rm -rf /root/.cache
USER nobody
ENTRYPOINT ["slipstream"]
