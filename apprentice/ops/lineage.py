"""MLflow lineage: where every model came from. The only module that imports ``mlflow``.

Layout of the store (one MLflow experiment, ``lineage.experiment``):

* one **parent run per iteration** (``iter-<k>``; tags: iteration, profile, git commit);
* one **nested run per stage** (tags ``dvc.stage``, ``dvc.executed``; the stage's params; per-step
  metrics read from the stage's DVCLive files (``apprentice.training.curves``, the same files DVC plots); its DVC inputs and outputs as ``mlflow.data``
  datasets whose digest is the DVC md5 from ``dvc.lock``);
* the **registry**: each iteration's candidate model registered **by reference** (a tiny pyfunc
  whose ``model_config`` holds the weights path, DVC md5 and git commit; the weights stay in DVC,
  not copied), with the aliases ``challenger`` (every evaluated candidate) and ``champion`` (moved
  only by :func:`apprentice.stages.promote.run` after a paired test).

Stage processes never need MLflow: the flow logs what they wrote after they exit. The exception is
``promote``, which attaches to the run named by ``MLFLOW_RUN_ID`` when the flow set one, or opens
its own run under plain ``dvc repro``.

Safety switches applied on import of this module's :func:`configure`: telemetry off
(``MLFLOW_DISABLE_TELEMETRY=true``; MLflow ignores ``DO_NOT_TRACK=1``), and a dead tracking server
fails in seconds with a message instead of MLflow's default ~4 minutes of retries.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from apprentice.training import curves

# Set before mlflow is imported anywhere in this process (its env vars are read lazily, but early is safe).
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
warnings.filterwarnings("ignore", message=".*noload.*")  # SQLAlchemy 2.1 deprecation inside mlflow

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

# mlflow.data infers a schema when a dataset input is logged and warns about every integer column
# (a hint for model signatures, irrelevant to dataset lineage), once per dataset: it floods the log.
warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer", category=UserWarning)

CHAMPION, CHALLENGER = "champion", "challenger"
TAG_ITER, TAG_PROFILE, TAG_KIND = "apprentice.iteration", "apprentice.profile", "apprentice.kind"


class LineageError(RuntimeError):
    """The tracking store cannot be used; the message says how to fix it."""


# ---- store -------------------------------------------------------------------------------------

def resolve_uri(uri: str, root: str | os.PathLike[str]) -> str:
    """``MLFLOW_TRACKING_URI`` wins; a relative sqlite path resolves against ``root`` (absolute URI)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str((Path(root) / uri[len("sqlite:///"):]).resolve())
    return uri


def _check_server(uri: str) -> None:
    import httpx

    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=5).raise_for_status()
    except httpx.HTTPError as e:
        raise LineageError(
            f"MLflow tracking server {uri} is not reachable ({e.__class__.__name__}: {e}). Start it "
            f"(`mlflow server --backend-store-uri sqlite:///mlruns.db --workers 1 --port 5000`) or set "
            f"lineage.tracking_uri to a local store such as sqlite:///mlruns.db") from None


def configure(tracking_uri: str, experiment: str, root: str | os.PathLike[str]) -> str:
    """Point MLflow at the store, create the experiment (artifacts under ``root/mlartifacts``)."""
    uri = resolve_uri(tracking_uri, root)
    if uri.startswith(("http://", "https://")):
        _check_server(uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        with _store_init_lock(uri):
            if mlflow.get_experiment_by_name(experiment) is None:
                if uri.startswith(("http://", "https://")):  # a shared server: its own (proxied) artifact root,
                    mlflow.create_experiment(experiment)       # reachable from every machine, not a local path
                else:
                    art = Path(root).resolve() / "mlartifacts"
                    mlflow.create_experiment(experiment, artifact_location=art.as_uri())
    except mlflow.exceptions.MlflowException as e:
        raise LineageError(f"cannot use MLflow store {uri}: {e}") from None
    mlflow.set_experiment(experiment)
    os.environ["MLFLOW_TRACKING_URI"] = uri  # stage subprocesses inherit the resolved store
    return uri


@contextlib.contextmanager
def _store_init_lock(uri: str) -> Iterator[None]:
    """Serialise the first use of a sqlite store across processes.

    Opening a fresh sqlite store runs MLflow's alembic migrations; two processes doing it at once
    (two flows, or a flow and ``dvc repro`` started together) crash one of them with "Online
    migration expected to match one row ... 0 found", and both may try to create the experiment.
    An exclusive ``flock`` on ``<db>.init.lock`` makes the second wait until the first is done; the
    kernel drops the lock when a holder dies, so a killed process never blocks the next one.
    """
    if not uri.startswith("sqlite:///"):
        yield  # a tracking server serialises its own store
        return
    import fcntl

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".init.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def git_commit(repo: str | os.PathLike[str]) -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


# ---- runs --------------------------------------------------------------------------------------

TAG_PID, TAG_HOST = "apprentice.pid", "apprentice.host"
TAG_KILLED = "apprentice.killed_reason"


def _owner_tags() -> dict[str, str]:
    """Who owns a run: the flow process (pid + host), so a later run can tell a live run from a dead one."""
    import socket

    return {TAG_PID: str(os.getpid()), TAG_HOST: socket.gethostname()}


def _process_gone(tags: Mapping[str, str]) -> bool:
    """True when the run's owner process is known to be dead (or unknown: runs from before the tag)."""
    import socket

    pid, host = tags.get(TAG_PID), tags.get(TAG_HOST)
    if not pid or not pid.isdigit():
        return True
    if host and host != socket.gethostname():
        return False  # another machine's run: we cannot tell, so leave it alone
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def close_stale_runs(iteration: int, profile: str) -> int:
    """Mark runs of an interrupted earlier attempt of this iteration KILLED; returns how many.

    Only runs whose owner process is gone are touched (a live flow's runs are not), and each gets
    the reason (:data:`TAG_KILLED`) and, as its end time, the last moment it is known to have been
    alive (its newest child run's start/end or its own start), not the time of this cleanup.
    """
    client = MlflowClient()
    exp = [str(mlflow.tracking.fluent._get_experiment_id())]
    runs = client.search_runs(
        exp, f"tags.`{TAG_ITER}` = '{iteration}' and tags.`{TAG_PROFILE}` = '{profile}' and attributes.status = 'RUNNING'")
    closed = 0
    for r in runs:
        parent_id = r.data.tags.get("mlflow.parentRunId")
        owner = r if parent_id is None else next((p for p in runs if p.info.run_id == parent_id), None)
        owner_tags = (owner or r).data.tags
        if owner is None and parent_id:  # the parent is already closed: look at its tags
            with contextlib.suppress(mlflow.exceptions.MlflowException):
                owner_tags = client.get_run(parent_id).data.tags
        if not _process_gone(owner_tags):
            continue
        children = client.search_runs(exp, f"tags.`mlflow.parentRunId` = '{r.info.run_id}'")
        seen = [r.info.start_time] + [c.info.end_time or c.info.start_time for c in children]
        last_alive = max(t for t in seen if t)
        client.set_tag(r.info.run_id, TAG_KILLED,
                       f"process {owner_tags.get(TAG_PID, '?')} on {owner_tags.get(TAG_HOST, '?')} ended without "
                       f"closing this run (found by a later run, pid {os.getpid()}); end time = last sign of life")
        client.set_terminated(r.info.run_id, status="KILLED", end_time=last_alive)
        closed += 1
    return closed


@contextlib.contextmanager
def iteration_run(iteration: int, profile: str, repo: Path, params_file: Path) -> Iterator[str]:
    """The parent run of one iteration; yields its id. Fails the run if the block raises."""
    close_stale_runs(iteration, profile)
    tags = {TAG_ITER: str(iteration), TAG_PROFILE: profile, "git.commit": git_commit(repo), **_owner_tags(),
            "mlflow.source.git.commit": git_commit(repo).removesuffix("-dirty")}
    with mlflow.start_run(run_name=f"iter-{iteration}", tags=tags) as run:
        mlflow.log_artifact(str(params_file), artifact_path="params")
        yield run.info.run_id


@contextlib.contextmanager
def stage_run(parent_id: str, stage: str, iteration: int, profile: str) -> Iterator[str]:
    """A nested run for one stage; marked FAILED when the block raises."""
    client = MlflowClient()
    parent = client.get_run(parent_id)
    run = client.create_run(parent.info.experiment_id, run_name=stage,
                            tags={"mlflow.parentRunId": parent_id, TAG_ITER: str(iteration),
                                  TAG_PROFILE: profile, "dvc.stage": stage, **_owner_tags()})
    try:
        yield run.info.run_id
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")


@contextlib.contextmanager
def attach_or_start(run_name: str, tags: Mapping[str, str] | None = None) -> Iterator[str]:
    """For stage code: the run the flow opened (``MLFLOW_RUN_ID``) or a fresh one (plain ``dvc repro``)."""
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        yield run_id  # the flow owns its lifecycle
        return
    with mlflow.start_run(run_name=run_name, tags=dict(tags or {})) as run:
        yield run.info.run_id


# ---- what a stage produced ---------------------------------------------------------------------

def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def dvc_lock_entry(workdir: Path, stage: str | Sequence[str]) -> dict[str, Any]:
    """``dvc.lock``'s entry for ``stage``; for several stages, their deps and outs merged (by path)."""
    lock = Path(workdir) / "dvc.lock"
    if not lock.exists():
        return {}
    entries = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    if isinstance(stage, str):
        return entries.get(stage, {})
    merged: dict[str, dict[str, Any]] = {"deps": {}, "outs": {}}
    for name in stage:
        for kind in merged:
            merged[kind].update({item["path"]: item for item in entries.get(name, {}).get(kind, [])})
    return {kind: list(items.values()) for kind, items in merged.items()}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if line.strip():
                with contextlib.suppress(json.JSONDecodeError):
                    rows.append(json.loads(line))
    return rows


def log_step_metrics(run_id: str, rows: list[dict[str, Any]], prefix: str = "") -> int:
    """Per-step metrics: every numeric field of every JSONL row at its ``step`` (or row index)."""
    import time

    from mlflow.entities import Metric

    now, metrics = int(time.time() * 1000), []
    for i, row in enumerate(rows):
        step = int(row.get("step", row.get("global_step", i)))
        for k, v in row.items():
            if k not in ("step", "global_step") and isinstance(v, int | float) and not isinstance(v, bool):
                metrics.append(Metric(f"{prefix}{k}", float(v), now, step))
    for i in range(0, len(metrics), 1000):
        MlflowClient().log_batch(run_id, metrics=metrics[i:i + 1000])
    return len(metrics)


def _dataset(path: str, workdir: Path, md5: str) -> Any:
    """A dataset reference: schema + profile for Parquet tables, a pure reference for model folders."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    source = HTTPDatasetSource(f"dvc://{path}?md5={md5}")
    full = Path(workdir) / path
    if full.suffix == ".parquet" and full.is_file():
        import pandas as pd

        with contextlib.suppress(Exception), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # schema hints about integer columns
            df = pd.read_parquet(full)
            return mlflow.data.from_pandas(df, source=source, name=path, digest=md5[:32])  # type: ignore[attr-defined]
    return MetaDataset(source, name=path, digest=md5[:32])  # type: ignore[abstract]


def log_stage(run_id: str, stage: str | Sequence[str], workdir: Path, executed: bool, params: Mapping[str, Any],
              metrics_files: Sequence[Path] = (), result: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Log one stage (or the DVC stages behind it) into its nested run: params, DVC hashes and
    datasets, per-step metrics."""
    client = MlflowClient()
    entry = dvc_lock_entry(workdir, stage)
    client.set_tag(run_id, "dvc.executed", str(executed))
    client.log_batch(run_id, params=[mlflow.entities.Param(k, str(v)[:6000]) for k, v in flatten(params).items()])
    hashes: dict[str, str] = {}
    inputs = []
    for kind, items in (("input", entry.get("deps", [])), ("output", entry.get("outs", []))):
        for item in items:
            md5 = item.get("md5") or item.get("hash") or ""
            path = item["path"]
            if path.startswith("../"):  # code deps of a profile work dir: name them from the repo root
                path = path[path.index("apprentice/"):] if "apprentice/" in path else path.lstrip("./")
            if "apprentice/" in path or path.rstrip("/").endswith("expectations"):
                hashes[f"code:{path}"] = md5
                continue
            hashes[f"{kind}:{path}"] = md5
            ds = _dataset(path, workdir, md5)
            inputs.append(mlflow.entities.DatasetInput(ds._to_mlflow_entity(),
                                                       [mlflow.entities.InputTag("mlflow.data.context", kind)]))
    if inputs:
        client.log_inputs(run_id, datasets=inputs)
    _log_tags(client, run_id, {f"dvc.md5.{k}"[:250]: v for k, v in hashes.items()})
    n = 0
    for f in metrics_files:  # a DVCLive folder (training curves) or a JSONL file (wall-clock rows)
        n += log_step_metrics(run_id, curves.read_dvclive(f) if Path(f).is_dir() else read_jsonl(f))
    if result:
        scalars = {k: float(v) for k, v in flatten(result).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        if scalars:
            client.log_batch(run_id, metrics=[mlflow.entities.Metric(k, v, 0, 0) for k, v in scalars.items()])
    return {"hashes": hashes, "step_metrics": n}


def log_artifacts(run_id: str, files: list[Path], artifact_path: str | None = None) -> None:
    client = MlflowClient()
    for f in files:
        if Path(f).is_file():
            client.log_artifact(run_id, str(f), artifact_path)


def set_tags(run_id: str, tags: Mapping[str, Any]) -> None:
    _log_tags(MlflowClient(), run_id, tags)


def _log_tags(client: MlflowClient, run_id: str, tags: Mapping[str, Any]) -> None:
    """Tags in batches (MLflow takes at most 100 per ``log_batch``): one store transaction per batch
    instead of one per tag. A stage has a tag per DVC dep and its code deps run to dozens."""
    items = [mlflow.entities.RunTag(k, str(v)) for k, v in tags.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, tags=items[i:i + 100])


# ---- registry ----------------------------------------------------------------------------------

_POLICY_REF = '''"""A registered policy that references DVC-tracked weights instead of copying them."""
import mlflow
from mlflow.models import set_model


class PolicyRef(mlflow.pyfunc.PythonModel):
    """model_config: weights_path (absolute or relative to root), root, dvc_md5, git_commit."""

    def load_context(self, context):
        import os
        self.cfg = dict(context.model_config)
        path = self.cfg["weights_path"]
        self.path = path if os.path.isabs(path) else os.path.join(self.cfg.get("root", "."), path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(
                f"weights {self.path} (DVC md5 {self.cfg.get('dvc_md5')}) are not on this machine; "
                "run `dvc pull` (or `dvc repro`) at git commit " + str(self.cfg.get("git_commit")))
        self._pipe = None

    def predict(self, context, model_input, params=None):
        """model_input: a list of prompts (or a DataFrame with a 'prompt' column) -> generated texts."""
        if self._pipe is None:
            from transformers import pipeline
            self._pipe = pipeline("text-generation", model=self.path)
        prompts = list(model_input["prompt"]) if hasattr(model_input, "columns") else list(model_input)
        n = int((params or {}).get("max_new_tokens", 64))
        return [o[0]["generated_text"] for o in self._pipe(prompts, max_new_tokens=n, return_full_text=False)]


set_model(PolicyRef())
'''


def register_reference(run_id: str, model_name: str, weights_path: str, root: Path, dvc_md5: str,
                       git_rev: str, tags: Mapping[str, Any]) -> str:
    """Register a model version pointing at DVC-tracked weights (nothing copied); returns the version."""
    config = {"weights_path": weights_path, "root": str(Path(root).resolve()), "dvc_md5": dvc_md5,
              "git_commit": git_rev}
    with tempfile.TemporaryDirectory() as td:
        code = Path(td) / "policy_ref.py"
        code.write_text(_POLICY_REF)
        with _active(run_id):
            info = mlflow.pyfunc.log_model(name="policy", python_model=str(code), model_config=config,
                                           pip_requirements=["mlflow", "transformers", "torch"])
    client = MlflowClient()
    with contextlib.suppress(mlflow.exceptions.MlflowException):
        client.create_registered_model(model_name, description="Apprentice agents; weights referenced in DVC")
    # model_id: a tracking *server* (MLflow 3) refuses a `models:/m-...` source without it; sqlite accepts both
    mv = client.create_model_version(model_name, info.model_uri, run_id=run_id, model_id=info.model_id,
                                     tags={k: str(v) for k, v in {**tags, "dvc_md5": dvc_md5,
                                                                  "weights_path": weights_path}.items()})
    return str(mv.version)


@contextlib.contextmanager
def _active(run_id: str) -> Iterator[None]:
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:
        yield
        return
    before = MlflowClient().get_run(run_id).info.status
    with mlflow.start_run(run_id=run_id, nested=active is not None):
        yield
    if before == "RUNNING":
        # Leaving ``start_run`` ends the run as FINISHED, but this run belongs to its owner (the flow's
        # stage run, handed over in MLFLOW_RUN_ID): it ends with what really happens to the stage.
        MlflowClient().update_run(run_id, status="RUNNING")


def find_version(model_name: str, weights_path: str, digest: str) -> dict[str, Any] | None:
    """The registered version of these weights (same path and content digest), or None.

    Makes registering idempotent: a promote killed after its registry write finds its version (and
    the decision recorded on it) on the rerun instead of registering the same weights again.
    """
    client = MlflowClient()
    try:
        versions = client.search_model_versions(f"name='{model_name}'")
    except mlflow.exceptions.MlflowException:
        return None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        tags = dict(mv.tags)
        if tags.get("weights_path") == weights_path and tags.get("weights_digest") == digest:
            return {"version": str(mv.version), "run_id": mv.run_id, "tags": tags}
    return None


def alias_version(model_name: str, alias: str) -> dict[str, Any] | None:
    """The version behind an alias with its tags, or None."""
    client = MlflowClient()
    try:
        mv = client.get_model_version_by_alias(model_name, alias)
    except mlflow.exceptions.MlflowException:
        return None
    return {"version": str(mv.version), "run_id": mv.run_id, "tags": dict(mv.tags)}


def set_alias(model_name: str, alias: str, version: str) -> None:
    MlflowClient().set_registered_model_alias(model_name, alias, str(version))


def tag_version(model_name: str, version: str, tags: Mapping[str, Any]) -> None:
    client = MlflowClient()
    for k, v in tags.items():
        client.set_model_version_tag(model_name, str(version), k, str(v))


def rewind(model_name: str, iteration: int, champion: str | int | None) -> list[str]:
    """Forget what iterations after ``iteration`` registered; returns the deleted versions.

    Deletes every version tagged with a later iteration and points ``champion`` and ``challenger``
    back at ``champion`` (None: both aliases removed). Why: ``dvc exp run`` re-runs iterations in the
    same workspace and so against the same registry; comparing loop rules (experiments/loop_rules.py) needs
    each rule's promote-k to meet the champion iteration k-1 left, not the one the previous rule's
    experiment promoted (whose evaluation table the next experiment overwrites). Destructive: meant
    for a throwaway clone, never for a registry others read.
    """
    client = MlflowClient()
    try:
        versions = client.search_model_versions(f"name='{model_name}'")
    except mlflow.exceptions.MlflowException:
        return []
    gone = []
    for mv in versions:
        if int(dict(mv.tags).get(TAG_ITER, "0") or 0) > iteration:
            client.delete_model_version(model_name, str(mv.version))
            gone.append(str(mv.version))
    for alias in (CHAMPION, CHALLENGER):
        if champion is None:
            with contextlib.suppress(mlflow.exceptions.MlflowException):
                client.delete_registered_model_alias(model_name, alias)
        else:
            client.set_registered_model_alias(model_name, alias, str(champion))
    return sorted(gone, key=int)


def aliases(model_name: str) -> dict[str, str]:
    """``{alias: version}`` as strings (sqlite returns ints, REST strings)."""
    try:
        rm = MlflowClient().get_registered_model(model_name)
    except mlflow.exceptions.MlflowException:
        return {}
    return {a: str(v) for a, v in (rm.aliases or {}).items()}


def store_summary(experiment: str, model_name: str) -> str:
    """One line on what the store holds: runs, nested runs, datasets, versions, aliases."""
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return f"experiment '{experiment}' is empty"
    runs = client.search_runs([exp.experiment_id], max_results=5000)
    nested = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    datasets = sum(len(r.inputs.dataset_inputs) for r in runs if r.inputs)
    try:
        n_versions = len(client.search_model_versions(f"name='{model_name}'"))
    except mlflow.exceptions.MlflowException:
        n_versions = 0
    return (f"{len(runs) - len(nested)} iteration runs, {len(nested)} stage runs, {datasets} dataset inputs, "
            f"{n_versions} versions of '{model_name}', aliases {aliases(model_name) or '{}'}")



def iteration_runs(run_id: str) -> dict[str, Any]:
    """For the iteration report: the parent run of ``run_id`` (a stage run) and its stage runs.

    Returns ``{"tracking_uri", "experiment_id", "parent": {"run_id", "name"}, "stages": {name: run_id}}``;
    an empty dict when the store or the run cannot be read (the report then says so)."""
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
        parent_id = run.data.tags.get("mlflow.parentRunId", run_id)
        parent = client.get_run(parent_id)
        children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                      max_results=500)
    except mlflow.exceptions.MlflowException:
        return {}
    return {"tracking_uri": mlflow.get_tracking_uri(), "experiment_id": parent.info.experiment_id,
            "parent": {"run_id": parent_id, "name": parent.info.run_name},
            "stages": {r.info.run_name: r.info.run_id for r in sorted(children, key=lambda r: r.info.start_time)}}
