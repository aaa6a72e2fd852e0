# One image for every Overture service: `overture <command>` (scheduler, nodemgr, engine,
# kvstore, s3-server, init, probe). CPU build by default; the CUDA build:
#   docker build --build-arg VARIANT=cuda -t overture:cuda .
# Dependencies are installed in layers of their own before the source is copied, so a
# code change rebuilds in seconds.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG VARIANT=cpu
# CPU wheels of torch from PyTorch's CPU index (the default index pulls the CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 overture \
    && mkdir -p /models /var/lib/overture /run/overture \
    && chown overture:overture /models /var/lib/overture /run/overture

WORKDIR /app

# 1. torch alone (the largest layer; changes only with its pin).
COPY pyproject.toml ./
# (the pin is pyproject.toml's, read into $TORCH: hadolint cannot see it)
# hadolint ignore=DL3013
RUN TORCH=$(python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
print(next(x for x in d['project']['dependencies'] if x.startswith('torch==')))") \
    && if [ "$VARIANT" = "cuda" ]; then INDEX="$CUDA_TORCH_INDEX_URL"; else INDEX="$TORCH_INDEX_URL"; fi \
    && pip install --index-url "$INDEX" --extra-index-url https://pypi.org/simple "$TORCH"

# 2. The other pinned dependencies (and cuda-python for the CUDA build).
RUN python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); \
deps = d['project']['dependencies'] + (d['project']['optional-dependencies']['cuda'] \
if '$VARIANT' == 'cuda' else []); open('/tmp/requirements.txt', 'w').write('\n'.join(deps))" \
    && pip install -r /tmp/requirements.txt

# 3. The source, its generated gRPC code, and the `overture` command.
COPY shared ./shared
COPY services ./services
COPY clients/js ./clients/js
RUN python -m shared.proto.build && pip install --no-deps -e .

USER 10001
VOLUME ["/models", "/var/lib/overture"]
EXPOSE 8000
ENTRYPOINT ["overture"]
CMD ["--help"]
