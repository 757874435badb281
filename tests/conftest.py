"""Shared test setup. Environment switches are set before any library is imported (Prefect reads
its settings at import time), so no test talks to the network or leaves telemetry daemons."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "PREFECT_HOME" not in os.environ:
    # A private Prefect home per test session, removed when the session ends (otherwise every
    # run leaves one in /tmp).
    _prefect_home = tempfile.mkdtemp(prefix="apprentice-prefect-home-")
    atexit.register(shutil.rmtree, _prefect_home, ignore_errors=True)
    os.environ["PREFECT_HOME"] = _prefect_home
os.environ.update(
    DO_NOT_TRACK="true",
    MLFLOW_DISABLE_TELEMETRY="true",
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90",
    HF_HUB_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    TRL_EXPERIMENTAL_SILENCE="1",
)

# ---- models ---------------------------------------------------------------------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol_tokenizer_dir(request) -> str:
    """SmolLM2 tokenizer folder (compact tool template), extracted from the GGUF once and kept in
    pytest's cache dir, so only the first session pays for the extraction."""
    from apprentice.lm.modeling import smol_tokenizer_dir as _extract

    return str(_extract(request.config.cache.mkdir("apprentice-models")))


@pytest.fixture(scope="session")
def tiny_model_dir(smol_tokenizer_dir, tmp_path_factory) -> str:
    """A random 2-layer, hidden-64 LlamaForCausalLM with the SmolLM vocabulary + tokenizer (seed 0)."""
    from apprentice.lm.modeling import load_tokenizer, make_tiny_model

    tok = load_tokenizer(smol_tokenizer_dir)
    return str(make_tiny_model(tok, tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, seed=0))


# ---- orchestration -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API for the session (``prefect_test_harness``: temp sqlite, subprocess server,
    started once). Not autouse: only flow tests pay for it. Yields the API URL so subprocesses can join."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):  # a loaded 2-core box needs minutes
        yield PREFECT_API_URL.value()


# ---- scaling out ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray instance for the session (``ray.init(num_cpus=2)``, started once); the Ray
    rollout engine and prefect-ray join it instead of starting their own."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (make setup installs it)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")  # Ray's default 30 s fails on a loaded box
    for attempt in range(3):  # Ray waits a fixed 30 s for its raylet; a loaded CI box can miss that once
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()


# ---- scheduling on pytest-xdist (`make test`: -n 2 --dist loadscope --no-loadscope-reorder) -------
#: Test files that run the whole pipeline, in the order they start: each holds a worker for minutes, so
#: they go first and every other file packs in beside them. Files sharing a session fixture (the slow
#: suite's deployed run, the Ray cluster) form one scope, so the fixture is built once, on one worker.
_FIRST = ("tests/integration/test_pipeline.py", "tests/slow/", "tests/newcomer/")
_SCOPES = {"tests/slow/": "deployed-run", "tests/integration/test_ray_": "ray-cluster"}


def _scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((g for prefix, g in _SCOPES.items() if path.startswith(prefix)), path)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the scopes above (a file, or a shared-fixture group of files).

    xdist's own ``loadgroup`` would do this with ``xdist_group`` marks, but with pytest 9.2 and
    xdist 3.8 it splits marked tests across workers, so the scope
    function is given to xdist's scheduler through its documented hook instead."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    return Scopes(config, log)


def pytest_collection_modifyitems(config, items):
    """The long files first (stable: files stay contiguous, tests keep their order). xdist's default
    reorder (most tests first) would start them last; ``make test`` turns it off."""

    def rank(item) -> int:
        return next((i for i, prefix in enumerate(_FIRST) if item.nodeid.startswith(prefix)), len(_FIRST))

    items.sort(key=rank)


@pytest.fixture
def echo_env(monkeypatch):
    """The two-word ``echo`` environment (tests/echokit.py), registered for this test only."""
    from echokit import EchoEnv

    from apprentice.envs import FAMILIES

    monkeypatch.setitem(FAMILIES, "echo", EchoEnv)
    return EchoEnv
