"""Weights & Biases through the ``wandb`` package (the ``wandb`` extra).

``wandb`` is imported when a :class:`WandbLogger` is built, never by ``import flaxlight``.
"""

from __future__ import annotations

import atexit
import json
import os
from typing import Any, Mapping, Sequence

from flaxlight.loggers.base import Logger, as_image

__all__ = ["WandbLogger"]

STEP_KEY = "trainer/global_step"
RUN_FILE = "wandb_run.json"


def _import_wandb():
    try:
        import wandb
    except ImportError as exc:
        raise ImportError(
            "WandbLogger needs the wandb package, which is not installed: pip install 'flaxlight[wandb]'."
        ) from exc
    return wandb


class WandbLogger(Logger):
    """Logs metrics, hyperparameters (as the run's config) and images to a W&B run.

    The run starts at the first record (so building a trainer creates no run) and its files go to
    ``<save_dir>/wandb/``. Without network or account, set ``WANDB_MODE=offline`` (or pass
    ``offline=True``): the run is written to ``<save_dir>/wandb/offline-run-*/`` and can be
    uploaded later with ``wandb sync``. Metrics are plotted against ``trainer/global_step``
    (optimizer updates), logged with each record, so records may arrive in any step order.

    Resume: W&B cannot delete history. :meth:`resume_from_step` reopens the same run (its id is
    kept in ``<save_dir>/wandb_run.json``) and the resumed loop logs from ``step + 1`` on; points
    the interrupted run logged after the checkpoint stay in the history, so a chart may show two
    values at those steps. In offline mode the resumed part is a second ``offline-run-*`` folder
    with the same run id; ``wandb sync`` merges them into one run.

    End: a successful run stays open after ``train_model`` (as in Lightning), so records sent
    later (``trainer.log_image``, ``trainer.test``) land in the same run; it is finished with
    exit code 0 by :meth:`close` (``trainer.logger.close()``) or at the interpreter's exit.
    A failed or interrupted run is finished at once with exit code 1.

    Args:
        project: W&B project (default ``"flaxlight"``).
        name: the run's display name (default: W&B picks one).
        save_dir: folder for W&B's files (``<save_dir>/wandb``) and ``wandb_run.json``.
        offline: write locally only (same as ``WANDB_MODE=offline``).
        id: an existing run's id to continue (default: a new run).
        entity, tags, group: passed to ``wandb.init``.
        **init_kwargs: any other ``wandb.init`` argument.

    Examples:
        >>> logger = WandbLogger(project="digits", name="mlp-lr1e-3", save_dir="runs/mlp", offline=True)  # doctest: +SKIP
        >>> trainer = MyTrainer(..., loggers=[logger])                                                     # doctest: +SKIP
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike = ".",
        *,
        offline: bool = False,
        id: str | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        group: str | None = None,
        **init_kwargs: Any,
    ):
        _import_wandb()  # fail now, with the extra to install, rather than at the first log point
        self.project = project or "flaxlight"
        self.name = name
        self.save_dir = os.path.abspath(os.fspath(save_dir))
        self.offline = offline
        self.entity, self.tags, self.group = entity, list(tags) if tags else None, group
        self.init_kwargs = init_kwargs
        self._run = None
        self._run_id = id
        self._closes_at_exit = False

    # ------------------------------------------------------------------ the run
    @property
    def run_id(self) -> str | None:
        """The W&B run id (None until the run starts, unless given or resumed)."""
        return self._run_id

    @property
    def experiment(self):
        """The ``wandb`` Run object, started on first use (e.g. to call ``.watch`` or ``.log`` directly)."""
        if self._run is None:
            self._start()
        return self._run

    def _start(self, config: Mapping | None = None) -> None:
        wandb = _import_wandb()
        os.makedirs(self.save_dir, exist_ok=True)
        kwargs: dict[str, Any] = dict(
            project=self.project, name=self.name, dir=self.save_dir, entity=self.entity, tags=self.tags,
            group=self.group, reinit="create_new",
        )
        extra = dict(self.init_kwargs)
        kwargs["config"] = {**dict(config or {}), **dict(extra.pop("config", None) or {})} or None
        if self._run_id is not None:
            kwargs.update(id=self._run_id, resume="allow")
        if self.offline:
            kwargs["mode"] = "offline"
        kwargs.update(extra)
        run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        self._run, self._run_id = run, run.id
        with open(os.path.join(self.save_dir, RUN_FILE), "w") as f:
            json.dump({"id": run.id, "project": self.project, "name": run.name}, f)

    # ------------------------------------------------------------------ Logger
    def log_hyperparams(self, params: Mapping) -> None:
        """Store ``params`` as the run's config (nested dicts stay nested)."""
        if self._run is None:
            self._start(config=params)
        else:
            self._run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        record = {key: float(value) for key, value in metrics.items()}
        record[STEP_KEY] = int(step)
        self.experiment.log(record)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        wandb = _import_wandb()
        self.experiment.log({tag: wandb.Image(as_image(image)), STEP_KEY: int(step)})

    def resume_from_step(self, step: int) -> None:
        """Continue the run saved in ``<save_dir>/wandb_run.json`` (history after ``step`` stays)."""
        if self._run is not None or self._run_id is not None:
            return  # same process, or an id given explicitly: keep logging to that run
        path = os.path.join(self.save_dir, RUN_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                self._run_id = json.load(f).get("id")

    def continue_run(self) -> None:
        """The next record goes to the run saved in ``<save_dir>/wandb_run.json``."""
        self.resume_from_step(0)

    def finalize(self, status: str) -> None:
        """A failed or interrupted run is finished now (exit code 1: W&B marks it failed); a
        successful one stays open for late records until :meth:`close` or the interpreter's exit."""
        if self._run is None:
            return
        if status != "success":
            self._finish(exit_code=1)
        elif not self._closes_at_exit:
            atexit.register(self.close)
            self._closes_at_exit = True

    def close(self) -> None:
        """Finish the run with exit code 0 (a later record resumes the same run id in a new run folder)."""
        if self._run is not None:
            self._finish(exit_code=0)

    def _finish(self, exit_code: int) -> None:
        run, self._run = self._run, None  # a later record resumes the same run id
        if self._closes_at_exit:
            atexit.unregister(self.close)
            self._closes_at_exit = False
        run.finish(exit_code=exit_code)
