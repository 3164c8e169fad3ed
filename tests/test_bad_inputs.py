"""What a careless or hostile user types, one table row each (promises 3, 7, 8 and 9 of DESIGN.md).

Each row gives a bad input and asserts the exception type and a message that names the offending
key or value (and, where there is one, the fix). Rows marked ``on_run`` act on a copy of an
earlier run's folder: afterwards its ``hparams.yaml`` and ``metrics.csv`` are byte for byte the
same and its checkpoints the same steps with the same bytes. A row whose intended behaviour is
not there yet can be marked ``xfail="issue N: ..."`` (strict), so that its fix shows as XPASS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml
from conftest import RegressTrainer, TinyMLP, linear_data

from flaxlight import ArrayLoader, ModelCheckpoint
from flaxlight.runfiles import read_hparams, write_hparams
from flaxlight.zoo import ClassificationTrainer

X0 = np.zeros((1, 4), np.float32)
ADAM = {"optimizer": "adam", "lr": 1e-2}
SGD_MOMENTUM = {"optimizer": "sgd", "lr": 1e-2, "momentum": 0.9}
SINE_CONFIG = {"trainer": {"name": "regression", "max_epochs": 1},
               "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [8], "output_dim": 1}},
               "data": {"name": "sine", "kwargs": {"num_train": 64, "num_val": 32, "num_test": 32}}}


def _loaders():
    """The earlier run's data: 2 train batches, 1 validation batch."""
    return (ArrayLoader(*linear_data(64, 0), batch_size=32, shuffle=True, seed=0),
            ArrayLoader(*linear_data(32, 1), batch_size=32))


def _trainer_kwargs(log_dir, **kwargs) -> dict:
    args = dict(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=ADAM, exmp_input=X0,
                logger_params={"log_dir": str(log_dir)}, enable_progress_bar=False, enable_model_summary=False)
    args.update(kwargs)
    return args


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """One finished run (3 epochs, checkpoints at two steps), trained once for the module."""
    run = tmp_path_factory.mktemp("earlier") / "run"
    train, val = _loaders()
    trainer = RegressTrainer(**_trainer_kwargs(run, callbacks=[ModelCheckpoint(monitor="val/loss", save_top_k=2)]))
    trainer.train_model(train, val, num_epochs=3)
    assert len(_steps(run)) >= 2
    return run


def _steps(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if folder.is_dir() else []


def _snapshot(run: Path) -> dict[str, Any]:
    """What must not change: the two run files' bytes, the checkpoint steps and their files' bytes."""
    files = {name: (run / name).read_bytes() for name in ("hparams.yaml", "metrics.csv")}
    checkpoints = {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
                   for step in _steps(run) for p in sorted((run / "checkpoints" / str(step)).rglob("*")) if p.is_file()}
    return {"files": files, "steps": _steps(run), "checkpoint_files": checkpoints}


@dataclasses.dataclass
class Ctx:
    """What a row's action may use: a fresh folder, the earlier run (a copy of it) and its data."""

    tmp: Path
    run: Path
    capsys: Any

    def __post_init__(self):
        self.train, self.val = _loaders()

    def trainer(self, cls: type = RegressTrainer, *, on_run: bool = False, **kwargs):
        return cls(**_trainer_kwargs(self.run if on_run else self.tmp / "new", **kwargs))

    def fit(self, train=None, val=None, *, on_run=False, trainer_kwargs=None, **fit_kwargs):
        train = self.train if train is None else train
        fit_kwargs.setdefault("num_epochs", 1)
        return self.trainer(on_run=on_run, **(trainer_kwargs or {})).train_model(train, val, **fit_kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    """``act(ctx)`` must raise ``error`` (or warn, for a Warning) with a message matching ``match``
    (a regex searched in it); ``on_run``: it acts on the earlier run, whose files stay untouched;
    ``prepare(run)``: done to that copy of the run first; ``check(ctx, outcome)``: further
    assertions (outcome: the ExceptionInfo, or act's result)."""

    act: Callable[[Ctx], Any]
    error: type | tuple[type, ...]
    match: str
    on_run: bool = False
    prepare: Callable[[Path], None] | None = None
    check: Callable[[Ctx, Any], None] | None = None


def row(case_id: str, *args, xfail: str | None = None, marks=(), **kwargs):
    marks = [*marks, *([pytest.mark.xfail(strict=True, reason=xfail)] if xfail else [])]
    return pytest.param(Case(*args, **kwargs), id=case_id, marks=marks)


# ------------------------------------------------------------------------------------------ actions
class NotAModule:
    """A plain class: not a flax Module."""


def _batches(*batches):
    return list(batches)


def _generator(ctx):
    yield from ctx.train


def _labels(bad):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = np.zeros(16, np.int32) if not isinstance(bad, float) else np.zeros(16, np.float32)
    y[5] = bad
    return ArrayLoader(x, y, batch_size=8)


def _classify(ctx, bad):
    trainer = ctx.trainer(ClassificationTrainer, model_hparams={"hidden_dims": [8], "output_dim": 3})
    return trainer.train_model(_labels(bad), None, num_epochs=1)


def _classify_weighted(ctx, where: str):
    """Keras-style (x, y, sample_weight) arrays given to the zoo's classifier, for training or validation."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y, w = np.zeros(16, np.int32), np.ones(16, np.float32)
    trainer = ctx.trainer(ClassificationTrainer, model_hparams={"hidden_dims": [8], "output_dim": 3})
    train, val = ((x, y, w), None) if where == "train" else ((x, y), (x, y, w))
    return trainer.train_model(train, val, num_epochs=1, batch_size=8)


def _nothing_written(ctx, outcome):
    assert not (ctx.tmp / "new" / "hparams.yaml").exists()


def _damage_newest(run: Path) -> None:
    """Truncate every array file of the newest checkpoint (as tests/test_checkpoint_faults.py does)."""
    newest = run / "checkpoints" / str(_steps(run)[-1])
    for path in (newest / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _load_damaged(ctx):
    return RegressTrainer.load_from_checkpoint(ctx.run, exmp_input=X0, which="last")


def _loaded_the_previous_checkpoint(ctx, trainer):
    assert int(trainer.state.step) == _steps(ctx.run)[-2]


def _checkpoints_a_file(ctx) -> Path:
    folder = ctx.tmp / "odd"
    folder.mkdir()
    (folder / "checkpoints").write_text("not a folder")
    return folder


class BatchDrawn(Exception):
    """Raised by a loader whose batches should not have been needed yet."""


class NoBatchBeforeChecks:
    """Two batches by len(); iterating means training started before the set-up was checked."""

    def __len__(self):
        return 2

    def __iter__(self):
        raise BatchDrawn("training started before the log dir was checked")


def _train_with_checkpoints_a_file(ctx):
    folder = _checkpoints_a_file(ctx)
    trainer = RegressTrainer(**_trainer_kwargs(folder))
    return trainer.train_model(NoBatchBeforeChecks(), None, num_epochs=1)


def _load_with_checkpoints_a_file(ctx):
    run = ctx.tmp / "copy"
    shutil.copytree(ctx.run, run)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")
    return RegressTrainer.load_from_checkpoint(run, exmp_input=X0)


def _load_without_checkpoints(ctx):
    run = ctx.tmp / "copy"
    shutil.copytree(ctx.run, run)
    shutil.rmtree(run / "checkpoints")
    return RegressTrainer.load_from_checkpoint(run, exmp_input=X0)


def _log_dir_a_file(ctx):
    (ctx.tmp / "a_file").write_text("x")
    return ctx.trainer(logger_params={"log_dir": str(ctx.tmp / "a_file")})


def _load_config(*overrides, **sections):
    from flaxlight.config import load_config

    return load_config({**SINE_CONFIG, **sections}, list(overrides))


class CliExit(Exception):
    """``flaxlight ...`` ended with a non-zero status (``code``); the message is its stderr."""

    def __init__(self, code: int, err: str):
        super().__init__(err)
        self.code = code


def _cli(ctx, *argv, **sections):
    from flaxlight import cli

    config = ctx.tmp / "config.yaml"
    config.write_text(yaml.safe_dump({**SINE_CONFIG, **sections}))
    ctx.capsys.readouterr()
    code = cli.main([argv[0], "-c", str(config), *map(str, argv[1:]), "--log-dir", str(ctx.tmp / "cli-run")])
    if code:
        raise CliExit(code, ctx.capsys.readouterr().err)


def _cli_refused(ctx, info):
    assert info.value.code == 2
    assert not (ctx.tmp / "cli-run").exists()  # refused before anything was built or written


def _tune_outside_base_dir(ctx):
    from flaxlight.tune import Float, tune

    return tune(RegressTrainer, {"optimizer_hparams.lr": Float(1e-3, 1e-1, log=True)},
                hparams=_trainer_kwargs(ctx.tmp / "unused"), train_loader=ctx.train, val_loader=ctx.val,
                num_epochs=1, n_trials=1, study_name="../x", base_dir=ctx.tmp / "studies")


def _nothing_written_outside(ctx, info):
    assert sorted(os.listdir(ctx.tmp)) == []  # neither tmp/studies nor tmp/x


# ------------------------------------------------------------------------------------------ the table
CASES = [
    # --- the trainer's constructor
    row("ctor-misspelt-keyword-max_step",
        lambda c: c.trainer(max_step=3), TypeError, r"unknown keyword argument 'max_step'\. Did you mean 'max_steps'\?"),
    row("ctor-seed-a-string",
        lambda c: c.trainer(seed="42"), TypeError, r"seed must be an int, got '42' \(str\); e\.g\. seed=42"),
    row("ctor-model_class-an-instance",
        lambda c: c.trainer(model_class=TinyMLP()), TypeError,
        r"model_class must be a class, got an instance of TinyMLP: pass model_class=TinyMLP"),
    row("ctor-model_class-not-a-Module",
        lambda c: c.trainer(model_class=NotAModule), TypeError,
        r"flax\.linen\.Module or flax\.nnx\.Module subclass; got the class 'NotAModule'.*pass the class itself"),
    row("ctor-model_hparams-unknown-field",
        lambda c: c.trainer(model_hparams={"hiden_dims": [8]}), TypeError,
        r"\['hiden_dims'\] are not accepted by TinyMLP\. Did you mean 'hidden_dims'\?.*accepts"),
    row("ctor-model_hparams-a-list",
        lambda c: c.trainer(model_hparams=[8]), TypeError, r"model_hparams must be a dict.*\[8\]"),
    row("ctor-optimizer-unknown",
        lambda c: c.trainer(optimizer_hparams={"optimizer": "adamm"}, on_run=True), ValueError,
        r"Unknown optimizer 'adamm'.*Did you mean 'adam'\?", on_run=True),
    row("ctor-optimizer-negative-lr",
        lambda c: c.trainer(optimizer_hparams={"optimizer": "adam", "lr": -1.0}, on_run=True), ValueError,
        r"optimizer_hparams\['lr'\] must be > 0.*got -1\.0", on_run=True),
    row("ctor-optimizer-unknown-schedule",
        lambda c: c.trainer(optimizer_hparams={"optimizer": "adam", "schedule": "cosin"}), ValueError,
        r"Unknown schedule 'cosin'.*Valid: constant, warmup_cosine"),
    row("ctor-optimizer-unknown-key",
        lambda c: c.trainer(optimizer_hparams={"optimizer": "adam", "lrr": 0.1}), ValueError,
        r"Unknown key 'lrr' in optimizer_hparams.*Did you mean 'lr'\?"),
    row("ctor-optimizer_hparams-a-string",
        lambda c: c.trainer(optimizer_hparams="adam"), TypeError, r"optimizer_hparams must be a dict.*got str"),
    row("ctor-steps_per_execution-0",
        lambda c: c.trainer(steps_per_execution=0), ValueError, r"steps_per_execution must be a positive int, or .auto. \(measured in the first epoch\); got 0"),
    row("ctor-prefetch-negative",
        lambda c: c.trainer(prefetch=-1), ValueError, r"prefetch must be an int >= 0.*got -1"),
    row("ctor-log_every_n_steps-0",
        lambda c: c.trainer(log_every_n_steps=0), ValueError, r"log_every_n_steps must be a positive int; got 0"),
    row("ctor-max_steps-0",
        lambda c: c.trainer(max_steps=0), ValueError, r"max_steps must be a positive int \(or None\); got 0"),
    row("ctor-limit_train_batches-1.5",
        lambda c: c.trainer(limit_train_batches=1.5), ValueError,
        r"limit_train_batches must be a number of batches \(int >= 1\) or a fraction in \(0, 1\]; got 1\.5"),
    row("ctor-mode-maximum",
        lambda c: c.trainer(mode="maximum"), ValueError, r"mode must be 'min' or 'max'; got 'maximum'"),
    row("ctor-distributed-bogus",
        lambda c: c.trainer(distributed="bogus"), ValueError, r"distributed must be one of .*'data_parallel'.*'bogus'"),
    row("ctor-check_val_every_n_epoch-0",
        lambda c: c.trainer(check_val_every_n_epoch=0), ValueError,
        r"check_val_every_n_epoch must be a positive int, or None to validate only every val_check_interval steps; got 0"),
    row("ctor-enable_progress_bar-a-string",
        lambda c: c.trainer(enable_progress_bar="no"), TypeError, r"enable_progress_bar.*True or False.*'no'"),
    row("ctor-callbacks-an-object",
        lambda c: c.trainer(callbacks=[object()]), TypeError, r"callbacks must be flaxlight\.Callback instances; got object"),
    row("ctor-callbacks-not-a-list",
        lambda c: c.trainer(callbacks=ModelCheckpoint()), TypeError, r"callbacks must be a list.*ModelCheckpoint"),
    row("ctor-loggers-an-object",
        lambda c: c.trainer(loggers=[object()]), TypeError, r"loggers must be flaxlight\.loggers\.Logger instances; got object"),
    row("ctor-logger_params-logdir",
        lambda c: c.trainer(logger_params={"logdir": str(c.tmp / "x")}), ValueError,
        r"Unknown logger_params key 'logdir'\. Did you mean 'log_dir'\?"),
    row("ctor-logger_type-bogus",
        lambda c: c.trainer(logger_params={"log_dir": str(c.run), "logger_type": "bogus"}), ValueError,
        r"Unknown logger_type 'bogus' in logger_params; valid: csv, tensorboard", on_run=True),
    row("ctor-log_dir-a-file",
        _log_dir_a_file, (OSError, ValueError), r"\blog_dir\b.*a_file.*(is a file|not a (directory|folder))"),
    row("ctor-exmp_input-None",
        lambda c: c.trainer(exmp_input=None), TypeError, r"exmp_input must be an array.*exmp_input=x\[:1\].*got None"),
    # --- train_model
    row("fit-num_epochs-0-on-resume",
        lambda c: c.fit(c.train, c.val, on_run=True, num_epochs=0, resume=True), ValueError,
        r"num_epochs must be a positive int, got 0", on_run=True),
    row("fit-check_val_every_n_epoch-beyond-num_epochs",
        lambda c: c.fit(c.train, c.val, num_epochs=2, trainer_kwargs={"check_val_every_n_epoch": 3}), ValueError,
        r"check_val_every_n_epoch=3 > num_epochs=2.*Lower check_val_every_n_epoch, train longer, or set val_check_interval"),
    row("fit-empty-train-loader",
        lambda c: c.fit([]), ValueError, r"train_loader yielded no batches.*batch_size and drop_last"),
    row("fit-loader-without-len",
        lambda c: c.fit(_generator(c)), TypeError, r"train_loader has no len\(\).*pass steps_per_epoch=N"),
    row("fit-steps_per_epoch-a-string",
        lambda c: c.fit(steps_per_epoch="4"), (TypeError, ValueError), r"steps_per_epoch.*'4'"),
    row("fit-batch-with-a-string-leaf",
        lambda c: c.fit(_batches((np.zeros((4, 4), np.float32), "abc"))), TypeError,
        r"first batch of train_loader.*leaf at \[1\] is a str\. Fields that are not numbers .* keep them out of the "
        r"batch"),
    row("fit-scalar-batch",
        lambda c: c.fit(_batches(np.float32(1.0))), ValueError,
        r"first batch of train_loader is a scalar \((np\.float32\()?1\.0\)?\).*leading batch dimension"),
    row("fit-input-shape-differs-from-exmp_input",
        lambda c: c.fit(ArrayLoader(np.zeros((8, 5), np.float32), np.zeros((8, 1), np.float32), batch_size=4)),
        ValueError, r"first batch of train_loader has shape \(4, 5\).*exmp_input of shape \(1, 4\).*Pass an exmp_input"),
    row("fit-val-input-shape-differs",
        lambda c: c.fit(c.train, ArrayLoader(np.zeros((8, 5), np.float32), np.zeros((8, 1), np.float32), batch_size=4)),
        ValueError, r"first batch of val_loader has shape \(4, 5\).*exmp_input of shape \(1, 4\)"),
    row("fit-eval-loader-without-batches",
        lambda c: c.fit(c.train, []), ValueError, r"val_loader yielded no batches"),
    row("fit-monitor-never-logged",
        lambda c: c.fit(c.train, c.val, trainer_kwargs={"monitor": "val/accuracy"}), KeyError,
        r"monitor 'val/accuracy', which no validation of this run logs: it is not among the eval step's metrics "
        r"\['val/loss'\]"),
    row("fit-resume_from-a-missing-path",
        lambda c: c.fit(resume_from=c.tmp / "no_such_run"), FileNotFoundError, r"no_such_run"),
    row("fit-resume_from-a-folder-without-checkpoints",
        lambda c: (c.tmp.joinpath("empty").mkdir(), c.fit(resume_from=c.tmp / "empty")), FileNotFoundError,
        r"resume_from='.*empty': no checkpoint there"),
    row("fit-into-a-folder-holding-a-run",
        lambda c: c.fit(c.train, c.val, on_run=True), FileExistsError,
        r"already holds a run.*train_model\(\.\.\., resume=True\).*train_model\(\.\.\., overwrite=True\)", on_run=True),
    row("fit-resume-with-a-string-leaf-batch",
        lambda c: c.fit(_batches((np.zeros((4, 4), np.float32), "abc")), on_run=True, num_epochs=4, resume=True),
        TypeError, r"leaf at \[1\] is a str", on_run=True,
        marks=[pytest.mark.filterwarnings("ignore:Resuming with a train_loader that has no set_epoch")]),
    row("fit-resume-with-a-changed-optimizer",
        lambda c: c.fit(c.train, c.val, on_run=True, num_epochs=4, resume=True,
                        trainer_kwargs={"optimizer_hparams": SGD_MOMENTUM}), ValueError,
        r"different optimizer.*optimizer_hparams changed.*start fresh.*load_from_checkpoint\(.*with_optimizer=False",
        on_run=True),
    # --- load_from_checkpoint
    row("load-a-folder-without-hparams",
        lambda c: RegressTrainer.load_from_checkpoint(c.tmp, exmp_input=X0), FileNotFoundError,
        r"No hparams\.yaml in .*load_from_checkpoint expects a run's log dir"),
    row("load-a-run-without-checkpoints",
        _load_without_checkpoints, FileNotFoundError, r"No checkpoint in .*copy/checkpoints: this run saved no model"),
    row("load-which-middle",
        lambda c: RegressTrainer.load_from_checkpoint(c.run, exmp_input=X0, which="middle"), ValueError,
        r"which must be 'best' or 'last', got 'middle'", on_run=True),
    row("load-misspelt-override",
        lambda c: RegressTrainer.load_from_checkpoint(c.run, exmp_input=X0, max_step=3), TypeError,
        r"'max_step'\. Did you mean 'max_steps'\?", on_run=True),
    row("load-with_optimizer-changed-optimizer",
        lambda c: RegressTrainer.load_from_checkpoint(c.run, exmp_input=X0, with_optimizer=True,
                                                      optimizer_hparams=SGD_MOMENTUM), ValueError,
        r"different optimizer.*with_optimizer=False", on_run=True),
    row("load-damaged-newest-checkpoint",
        _load_damaged, RuntimeWarning, r"Checkpoint \d+ .*(damaged|partial)", on_run=True,
        prepare=_damage_newest, check=_loaded_the_previous_checkpoint),
    row("load-checkpoints-path-a-file",
        _load_with_checkpoints_a_file, (OSError, ValueError), r"copy/checkpoints.*(is a file|not a (directory|folder))"),
    row("fit-checkpoints-path-a-file",
        _train_with_checkpoints_a_file, (OSError, ValueError), r"odd/checkpoints.*(is a file|not a (directory|folder))"),
    # --- the zoo's classifier
    row("classify-label-minus-one",
        lambda c: _classify(c, -1), ValueError,
        r"range over \[-1, 0\].*num_classes=3.*labels must be in \[0, 2\]"),
    row("classify-label-num_classes",
        lambda c: _classify(c, 3), ValueError, r"range over \[0, 3\].*num_classes=3.*labels must be in \[0, 2\]"),
    row("classify-float-labels",
        lambda c: _classify(c, 1.0), TypeError, r"integer class labels.*dtype float32.*astype\(np\.int32\)"),
    row("classify-sample-weights",
        lambda c: _classify_weighted(c, "train"), ValueError,
        r"ClassificationTrainer takes \(inputs, labels\) batches.*first batch of train_loader is a tuple of 3 parts, "
        r"of shapes \(8, 4\), \(8,\), \(8,\)\. Pass \(x, y\).*sample or class weights \(Keras' sample_weight, "
        r"class_weight\) needs a loss_fn of your own: subclass ClassificationTrainer and override loss_fn to read "
        r"\(x, y, w\) batches, see docs/data.md, \"Sample and class weights\""),
    row("classify-sample-weights-in-validation",
        lambda c: _classify_weighted(c, "val"), ValueError,
        r"ClassificationTrainer takes \(inputs, labels\) batches.*first batch of val_loader is a tuple of 3 parts.*"
        r"needs a loss_fn of your own", check=_nothing_written),
    # --- configs and the command line
    row("config-import-path-without-opt-in",
        lambda c: _load_config("model.name=mypkg.models.Net"), ValueError,
        r"model\.name: 'mypkg\.models\.Net' is an import path.*--trust-config"),
    row("config-imports-without-opt-in",
        lambda c: _load_config(imports=["os"]), ValueError, r"imports\[0\]: 'os' was not imported.*--trust-config"),
    row("config-unknown-key",
        lambda c: _load_config("trainer.max_epoch=3"), ValueError,
        r"Unknown key 'trainer\.max_epoch'\. Did you mean 'trainer\.max_epochs'\?"),
    row("config-wrong-type",
        lambda c: _load_config("trainer.max_epochs=ten"), ValueError, r"trainer\.max_epochs: expected int, got str 'ten'"),
    row("config-logger_params-logdir",
        lambda c: _load_config("trainer.logger_params.logdir=x"), ValueError,
        r"Did you mean 'trainer\.logger_params\.log_dir'\?"),
    row("cli-import-path-without-trust-config",
        lambda c: _cli(c, "fit", data={"name": "os.system", "kwargs": {"command": "true"}}), CliExit,
        r"data\.name: 'os\.system' is an import path, which was not imported.*--allow-import os.*--trust-config",
        check=_cli_refused),
    row("cli-unknown-override",
        lambda c: _cli(c, "fit", "trainer.max_epoch=3"), CliExit, r"Did you mean 'trainer\.max_epochs'\?",
        check=_cli_refused),
    # --- tuning
    row("tune-study_name-a-path",
        _tune_outside_base_dir, ValueError, r"study_name '\.\./x' is not a plain name.*set base_dir",
        check=_nothing_written_outside),
]


def test_the_table_is_large_and_its_ids_unique():
    ids = [case.id for case in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case: Case, tmp_path, earlier_run, capsys):
    run = tmp_path / "earlier_run"
    if case.on_run:
        shutil.copytree(earlier_run, run, ignore=shutil.ignore_patterns("*.lock"))
        hparams = read_hparams(run)  # as if the run had been trained in the copy: its hparams name it
        write_hparams(run, {**hparams, "logger_params": {**hparams["logger_params"], "log_dir": str(run)}})
        if case.prepare is not None:
            case.prepare(run)
        before = _snapshot(run)
    work = tmp_path / "work"
    work.mkdir()
    ctx = Ctx(work, run if case.on_run else earlier_run, capsys)
    if isinstance(case.error, type) and issubclass(case.error, Warning):
        with pytest.warns(case.error, match=case.match):
            outcome = case.act(ctx)
    else:
        with pytest.raises(case.error, match=case.match) as outcome:
            case.act(ctx)
    if case.check is not None:
        case.check(ctx, outcome)
    if case.on_run:
        assert _snapshot(run) == before, "the earlier run's files changed"
