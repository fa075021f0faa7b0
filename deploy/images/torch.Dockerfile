# The trainer, the compose job (`slipstream train` joining the long-lived services) and the reference engine: the base
# install with every extra. GPU nodes: a CUDA PyTorch base, whose torch is kept. CPU (tests, laptops):
#   docker build -f deploy/images/torch.Dockerfile --build-arg BASE=python:3.11-slim \
#     --build-arg TORCH=torch==2.13.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t slipstream-torch:cpu .
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
FROM ${BASE}
ARG TORCH=""
ARG TORCH_INDEX=""
WORKDIR /app
RUN if [ -n "$TORCH" ]; then pip install --no-cache-dir ${TORCH_INDEX:+--index-url $TORCH_INDEX} "$TORCH"; fi
COPY pyproject.toml README.md ./
COPY slipstream ./slipstream
COPY services ./services
RUN pip install --no-cache-dir --no-compile ".[all]" && rm -rf /root/.cache
ENTRYPOINT ["slipstream"]
