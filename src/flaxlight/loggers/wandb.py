"""Weights & Biases through the ``wandb`` package (the ``wandb`` extra).

``wandb`` is imported when a :class:`WandbLogger` is built, never by ``import flaxlight``.
"""

from __future__ import annotations

import atexit
import difflib
import inspect
import json
import os
from typing import Any, Mapping, Sequence

from flaxlight.loggers.base import Logger, as_image, rebound_run_dir

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



# PyTorch Lightning's WandbLogger arguments that this one does not have, and what to do instead.
_LIGHTNING_ONLY = {
    "log_model": "flaxlight does not upload checkpoints to W&B; they stay in <log_dir>/checkpoints/ "
                 "(upload one yourself with logger.experiment.log_artifact)",
    "checkpoint_name": "flaxlight does not upload checkpoints to W&B",
    "prefix": "metric names are logged as they are (train/loss, val/acc)",
    "experiment": "the logger starts its own run; pass id=... to continue an existing one",
}
_OWN_ARGS = ("project", "name", "save_dir", "offline", "id", "version", "entity", "tags", "group")


def _check_init_kwargs(wandb: Any, init_kwargs: Mapping[str, Any]) -> None:
    """Refuse, when the logger is built, an argument ``wandb.init`` would refuse at the first record."""
    for key in init_kwargs:
        if key in _LIGHTNING_ONLY:
            raise TypeError(f"WandbLogger({key}=...) is an argument of PyTorch Lightning's WandbLogger that "
                            f"flaxlight's does not have: {_LIGHTNING_ONLY[key]}.")
    params = inspect.signature(wandb.init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # this wandb takes any keyword: it checks them itself
    for key in init_kwargs:
        if key not in params:
            close = difflib.get_close_matches(key, list(_OWN_ARGS) + list(params), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"WandbLogger got an unknown argument {key!r}.{hint} It takes {', '.join(_OWN_ARGS)} "
                            f"and the other arguments of wandb.init: "
                            f"{', '.join(p for p in params if p not in _OWN_ARGS)}.")


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or ``alias_value`` (another name for the same argument); both given must agree."""
    if value is not None and alias_value is not None and value != alias_value:
        raise ValueError(f"WandbLogger got {name}={value!r} and {alias}={alias_value!r}, which name the same "
                         f"setting: give one of them.")
    return value if value is not None else alias_value


class WandbLogger(Logger):
    """Logs metrics, hyperparameters (as the run's config) and images to a W&B run.

    The run starts at the first record (so building a trainer creates no run) and its files go to
    ``<save_dir>/wandb/``. Without network or account, set ``WANDB_MODE=offline`` (or pass
    ``offline=True``): the run is written to ``<save_dir>/wandb/offline-run-*/`` and can be
    uploaded later with ``wandb sync``. Metrics are plotted against ``trainer/global_step``
    (optimizer updates), logged with each record, so records may arrive in any step order.

    Given to a trainer (``loggers=[...]``), the logger belongs to that trainer's run: the W&B run
    id is kept in the run's folder, ``<log_dir>/wandb_run.json``, so resuming that run reopens
    its W&B run and never another's, and without ``save_dir`` W&B's files go to the run's folder
    too. Used on its own, the id file is ``<save_dir>/wandb_run.json``.

    Resume: W&B cannot delete history. :meth:`resume_from_step` reopens the same run and the
    resumed loop logs from ``step + 1`` on; points the interrupted run logged after the checkpoint
    stay in the history, so a chart may show two values at those steps. In offline mode the
    resumed part is a second ``offline-run-*`` folder with the same run id; ``wandb sync`` merges
    them into one run.

    End: a successful run stays open after ``train_model`` (as in Lightning), so records sent
    later (``trainer.log_image``, ``trainer.test``) land in the same run; it is finished with
    exit code 0 by :meth:`close` (``trainer.logger.close()``) or at the interpreter's exit.
    A failed or interrupted run is finished at once with exit code 1. Records sent after that
    (a ``test()`` after the failure, or of a failed run loaded with ``load_from_checkpoint``)
    reopen it once, in one more run folder, which stays open for the records that follow and
    ends with exit code 1 again, as the run ended (MLflow keeps its FAILED / KILLED status too).

    Args:
        project: W&B project (default ``"flaxlight"``).
        name: the run's display name (default: W&B picks one).
        save_dir: folder for W&B's files (``<save_dir>/wandb``); default: the trainer's run
            folder (the current directory when used without a trainer). ``dir`` is the same.
        offline: write locally only (same as ``WANDB_MODE=offline``).
        id: an existing run's id to continue (default: a new run). ``version`` is the same.
        entity, tags, group: passed to ``wandb.init``.
        **init_kwargs: any other ``wandb.init`` argument (checked here: an unknown one fails now).

    Attributes:
        experiment: the ``wandb`` Run (started on first use).
        version: the run id (None until the run starts, unless given or resumed); also ``run_id``.

    Examples:
        >>> logger = WandbLogger(project="digits", name="mlp-lr1e-3", offline=True)  # doctest: +SKIP
        >>> trainer = MyTrainer(..., loggers=[logger])                                # doctest: +SKIP
    """

    def __init__(
        self,
        project: str | None = None,
        name: str | None = None,
        save_dir: str | os.PathLike | None = None,
        *,
        offline: bool = False,
        id: str | None = None,
        version: str | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        group: str | None = None,
        **init_kwargs: Any,
    ):
        wandb = _import_wandb()  # fail now, with the extra to install, rather than at the first log point
        _check_init_kwargs(wandb, init_kwargs)
        init_kwargs = dict(init_kwargs)
        save_dir = _one_of("save_dir", save_dir, "dir", init_kwargs.pop("dir", None))
        self.project = project or "flaxlight"
        self.name = name
        self._save_dir_given = save_dir is not None
        self.save_dir = os.path.abspath(os.fspath(save_dir if save_dir is not None else "."))
        self.offline = offline
        self.entity, self.tags, self.group = entity, list(tags) if tags else None, group
        self.init_kwargs = init_kwargs
        self._run = None
        self._run_id = _one_of("id", id, "version", version)
        self._run_dir: str | None = None  # the trainer's run folder, which keeps the run id
        self._end_status: str | None = None  # how the run ended (None: not ended); late records keep it
        self._closes_at_exit = False

    # ------------------------------------------------------------------ the run
    @property
    def run_id(self) -> str | None:
        """The W&B run id (None until the run starts, unless given or resumed)."""
        return self._run_id

    @property
    def version(self) -> str | None:
        """The W&B run id, as Lightning's ``WandbLogger.version`` (same as :attr:`run_id`)."""
        return self._run_id

    @property
    def experiment(self):
        """The ``wandb`` Run object, started on first use (e.g. to call ``.watch`` or ``.log`` directly)."""
        if self._run is None:
            self._start()
        return self._run

    def set_run_dir(self, log_dir: str | os.PathLike) -> None:
        """Keep the run id in the trainer's run folder ``log_dir`` (and W&B's files, without ``save_dir``)."""
        self._run_dir = rebound_run_dir(self, log_dir, "W&B")
        if not self._save_dir_given:
            self.save_dir = self._run_dir

    @property
    def _run_file(self) -> str:
        return os.path.join(self._run_dir or self.save_dir, RUN_FILE)

    def _saved(self) -> dict:
        """What ``wandb_run.json`` holds (empty without the file)."""
        if not os.path.isfile(self._run_file):
            return {}
        with open(self._run_file) as f:
            return json.load(f)

    def _write_run_file(self) -> None:
        os.makedirs(os.path.dirname(self._run_file), exist_ok=True)
        with open(self._run_file, "w") as f:
            json.dump({"id": self._run_id, "project": self.project, "name": self._run.name if self._run else self.name,
                       "status": self._end_status}, f)

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
        self._write_run_file()

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
        """Continue the run saved in ``wandb_run.json`` (history after ``step`` stays)."""
        if self._run is None and self._run_id is None:  # else: same process, or an id given: keep that run
            self._run_id = self._saved().get("id")

    def continue_run(self) -> None:
        """The next record goes to the run saved in ``wandb_run.json``; the run ends as it ended
        before (exit code 1 for a failed or interrupted run)."""
        saved = self._saved()
        self.resume_from_step(0)
        if self._end_status is None and self._run_id is not None:
            self._end_status = saved.get("status") or "success"

    def start_run(self) -> None:
        """A training run starts: it ends with its own status."""
        self._end_status = None

    def finalize(self, status: str) -> None:
        """End of a training run: a failed or interrupted run is finished now (exit code 1: W&B
        marks it failed); a successful one stays open for late records until :meth:`close` or the
        interpreter's exit. After that, late records' runs stay open too and end as the run did."""
        if self._end_status is not None:  # late records of an ended run: keep it open for more
            if self._run is not None:
                self._close_at_exit()
            return
        self._end_status = status
        if self._run is None:
            return
        self._write_run_file()  # a continued run (load_from_checkpoint) ends with this status again
        if status == "success":
            self._close_at_exit()
        else:
            self._finish()

    def close(self) -> None:
        """Finish the run (exit code 0, or 1 when it failed or was interrupted); a later record
        resumes the same run id in a new run folder."""
        if self._run is not None:
            self._finish()

    def _close_at_exit(self) -> None:
        if not self._closes_at_exit:
            atexit.register(self.close)
            self._closes_at_exit = True

    def _finish(self) -> None:
        run, self._run = self._run, None  # a later record resumes the same run id
        if self._closes_at_exit:
            atexit.unregister(self.close)
            self._closes_at_exit = False
        run.finish(exit_code=0 if self._end_status in (None, "success") else 1)
