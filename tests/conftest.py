"""Shared test setup. Environment switches are set before any library is imported (Prefect reads
its settings at import time), so no test talks to the network or leaves telemetry daemons."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="apprentice-prefect-home-"))
os.environ.update(
    DO_NOT_TRACK="true",
    MLFLOW_DISABLE_TELEMETRY="true",
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90",
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    TRL_EXPERIMENTAL_SILENCE="1",
)

# ---- fixtures (helpers add theirs below) ---------------------------------------------------------
