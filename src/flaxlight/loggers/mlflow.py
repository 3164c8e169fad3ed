"""MLflow tracking through the ``mlflow`` client (the ``mlflow`` extra: ``mlflow-skinny``).

``mlflow`` is imported when an :class:`MLflowLogger` is built, never by ``import flaxlight``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Mapping

from flaxlight.loggers.base import Logger, as_image, flatten_params, rebound_run_dir

__all__ = ["MLflowLogger"]

_log = logging.getLogger("flaxlight")

RUN_FILE = "mlflow_run.json"
STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")


def _import_mlflow():
    try:
        import mlflow  # noqa: F401
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise ImportError(
            "MLflowLogger needs the mlflow package, which is not installed: pip install 'flaxlight[mlflow]' "
            "(it installs mlflow-skinny; the full mlflow package works too)."
        ) from exc
    return MlflowClient


def _key(name: str) -> str:
    """MLflow accepts letters, digits, ``_ - . / : `` and spaces in keys; anything else becomes ``_``."""
    return _BAD_KEY_CHARS.sub("_", str(name))


class MLflowLogger(Logger):
    """Logs parameters, metrics (with their step) and images to an MLflow run.

    By default the tracking store is a local folder, ``<save_dir>/mlruns`` (MLflow's file store;
    this logger sets ``MLFLOW_ALLOW_FILE_STORE=true`` for it, which MLflow 3 asks for): browse it
    with ``mlflow ui --backend-store-uri <save_dir>/mlruns``. Give ``tracking_uri`` (or set
    ``MLFLOW_TRACKING_URI``) to log elsewhere: ``"sqlite:///runs/mlflow.db"`` (needs the full
    ``mlflow`` package; artifacts then go to ``mlartifacts/`` beside the database) or a server's
    ``http://...`` address. The run starts at the first record.

    Given to a trainer (``loggers=[...]``), the logger belongs to that trainer's run: the MLflow
    run id is kept in the run's folder, ``<log_dir>/mlflow_run.json``, so resuming that run
    reopens its MLflow run and never another's, and without ``save_dir`` the default file store
    is ``<log_dir>/mlruns``. Used on its own, the id file is ``<save_dir>/mlflow_run.json``.

    Hyperparameters become MLflow params with dotted keys (``optimizer_hparams.lr``). MLflow
    params cannot change once set: a value that differs from the one already stored (after a
    resume) is kept as it was, with a warning.

    Resume: :meth:`resume_from_step` reopens the run from ``mlflow_run.json`` (status back to
    RUNNING) and the resumed loop logs from ``step + 1`` on. MLflow cannot delete single metric
    points, so points the interrupted run logged after the checkpoint stay in the history.

    Args:
        experiment_name: MLflow experiment, created when missing (default ``"flaxlight"``).
        run_name: the run's name (default: MLflow picks one).
        tracking_uri: where runs are stored (default ``MLFLOW_TRACKING_URI`` or
            ``file:<save_dir>/mlruns``).
        save_dir: folder for the default file store (default: the trainer's run folder; the
            current directory when used without a trainer).
        tags: run tags.
        run_id: an existing run to continue.
        artifact_location: artifact root for a newly created experiment.

    Attributes:
        experiment: the ``MlflowClient`` (as Lightning's ``MLFlowLogger.experiment``); also ``client``.
        version: the run id (None until the first record, unless given or resumed); also ``run_id``.

    Examples:
        >>> logger = MLflowLogger(experiment_name="digits", run_name="mlp")  # doctest: +SKIP
        >>> trainer = MyTrainer(..., loggers=[logger])                  # doctest: +SKIP
    """

    def __init__(
        self,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        save_dir: str | os.PathLike | None = None,
        *,
        tags: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        artifact_location: str | None = None,
    ):
        _import_mlflow()  # fail now, with the extra to install, rather than at the first log point
        self.experiment_name = experiment_name or "flaxlight"
        self.run_name = run_name
        self._save_dir_given = save_dir is not None
        self.save_dir = os.path.abspath(os.fspath(save_dir if save_dir is not None else "."))
        self._store_in_save_dir = not (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            Path(self.save_dir, "mlruns").as_uri()
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.artifact_location = artifact_location
        if self.artifact_location is None and self.tracking_uri.startswith("sqlite:///"):
            db_path = self.tracking_uri[len("sqlite:///"):]
            self.artifact_location = Path(os.path.abspath(os.path.dirname(db_path) or "."), "mlartifacts").as_uri()
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = None
        self._run_id = run_id
        self._run_dir: str | None = None  # the trainer's run folder, which keeps the run id
        self._resumed_from_file = False
        self._experiment_id: str | None = None
        self._active = False
        self._status_on_end: str | None = None  # a continued run's own status, given back at its end
        self._continuing = False

    # ------------------------------------------------------------------ the run
    @property
    def client(self):
        """The ``mlflow.tracking.MlflowClient`` for ``tracking_uri``."""
        if self._client is None:
            self._client = _import_mlflow()(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (None until the first record creates the run, unless given or resumed)."""
        return self._run_id

    @property
    def version(self) -> str | None:
        """The MLflow run id, as Lightning's ``MLFlowLogger.version`` (same as :attr:`run_id`)."""
        return self._run_id

    @property
    def experiment(self):
        """The ``MlflowClient``, as Lightning's ``MLFlowLogger.experiment`` (same as :attr:`client`)."""
        return self.client

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment id (None until the first record)."""
        return self._experiment_id

    def set_run_dir(self, log_dir: str | os.PathLike) -> None:
        """Keep the run id in the trainer's run folder ``log_dir`` (and the default file store,
        without ``save_dir``)."""
        self._run_dir = rebound_run_dir(self, log_dir, "MLflow")
        if not self._save_dir_given:
            self.save_dir = self._run_dir
            if self._store_in_save_dir and self._client is None:
                self.tracking_uri = Path(self.save_dir, "mlruns").as_uri()

    @property
    def _run_file(self) -> str:
        return os.path.join(self._run_dir or self.save_dir, RUN_FILE)

    def _ensure_run(self) -> None:
        if self._active:
            return
        client = self.client
        if self._run_id is not None and self._resumed_from_file:
            try:
                client.get_run(self._run_id)
            except Exception:  # the store was moved or cleaned: start a new run rather than fail
                _log.warning("MLflow run %s from %s is gone from %s; starting a new run.",
                             self._run_id, RUN_FILE, self.tracking_uri)
                self._run_id = None
        if self._run_id is not None:
            run = client.get_run(self._run_id)
            self._experiment_id = run.info.experiment_id
            if self._continuing:
                self._status_on_end = run.info.status
            client.update_run(self._run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                self._experiment_id = client.create_experiment(self.experiment_name,
                                                               artifact_location=self.artifact_location)
            else:
                self._experiment_id = experiment.experiment_id
            run = client.create_run(self._experiment_id, run_name=self.run_name, tags=self.tags or None)
            self._run_id = run.info.run_id
            os.makedirs(os.path.dirname(self._run_file), exist_ok=True)
            with open(self._run_file, "w") as f:
                json.dump({"run_id": self._run_id, "experiment_id": self._experiment_id,
                           "tracking_uri": self.tracking_uri}, f)
        self._active = True

    # ------------------------------------------------------------------ Logger
    def log_hyperparams(self, params: Mapping) -> None:
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
        except ImportError:  # pragma: no cover - older layouts
            MAX_PARAM_VAL_LENGTH = 500
        self._ensure_run()
        stored = self.client.get_run(self._run_id).data.params
        new, changed = [], []
        for key, value in flatten_params(params).items():
            key, value = _key(key), str(value)[:MAX_PARAM_VAL_LENGTH]
            if key not in stored:
                new.append(Param(key, value))
            elif stored[key] != value:
                changed.append(key)
        if changed:
            _log.warning("MLflow params cannot change; kept the stored values of %s.", ", ".join(changed))
        for start in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self._run_id, params=new[start:start + 100])

    def _metric_key(self, name: str) -> str:
        """MLflow's key for metric ``name``: the name itself when MLflow takes it; else its
        characters replaced by ``_`` and, so that two such names never share a series whatever
        order they come in (another process, a resume), a short hash of the name appended.
        Said once per name."""
        keys = self.__dict__.setdefault("_metric_keys", {})
        if name not in keys:
            key = _key(name)
            if key != name:
                key = f"{key}_{hashlib.sha1(name.encode()).hexdigest()[:6]}"
                _log.warning("MLflow does not take the characters of metric %r: it is logged there as %r.", name, key)
            keys[name] = key
        return keys[name]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self._ensure_run()
        timestamp = int(time.time() * 1000)
        records = [Metric(self._metric_key(key), float(value), timestamp, int(step))
                   for key, value in metrics.items()]
        for start in range(0, len(records), 1000):
            self.client.log_batch(self._run_id, metrics=records[start:start + 1000])

    def log_image(self, tag: str, image: Any, step: int) -> None:
        """An image series under ``tag`` in the run's artifacts (``images/``), shown in MLflow's UI."""
        self._ensure_run()
        self.client.log_image(self._run_id, as_image(image), key=_key(tag), step=int(step))

    def resume_from_step(self, step: int) -> None:
        """Reopen the run saved in ``mlflow_run.json`` (metric points after ``step`` stay)."""
        if self._run_id is not None:
            return
        path = self._run_file
        if not os.path.isfile(path):
            return
        with open(path) as f:
            saved = json.load(f)
        if saved.get("tracking_uri") == self.tracking_uri and saved.get("run_id"):
            self._run_id, self._resumed_from_file = saved["run_id"], True

    def start_run(self) -> None:
        """A training run ends with its own status; a run id whose file ``overwrite=True`` deleted is dropped."""
        self._continuing, self._status_on_end = False, None
        if self._resumed_from_file and not os.path.isfile(self._run_file):
            self._run_id, self._resumed_from_file, self._active = None, False, False

    def continue_run(self) -> None:
        """The next record goes to the run saved in ``mlflow_run.json``, which then
        gets back the status it had (a test of a finished run leaves it FINISHED)."""
        self.resume_from_step(0)
        self._continuing = self._run_id is not None

    def finalize(self, status: str) -> None:
        """Set the run's status: FINISHED (``"success"``), FAILED (``"failed"``), KILLED
        (``"interrupted"``); a continued run's own status when only late records were sent."""
        if self._active:
            if self._status_on_end is not None:
                self.client.update_run(self._run_id, status=self._status_on_end)
            else:
                self.client.set_terminated(self._run_id, status=STATUS.get(status, "FINISHED"))
            self._active = False
