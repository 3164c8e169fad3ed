"""The ``flaxlight`` command line: ``fit``, ``validate``, ``test``, ``predict``, ``tune``, ``plot``, ``list``.

    flaxlight fit --config examples/configs/digits_mlp.yaml optimizer.lr=3e-4 trainer.max_epochs=20
    flaxlight test --ckpt checkpoints/MLPClassifier/version_0
    flaxlight fit --config cfg.yaml --print-config

``python -m flaxlight`` is the same program. See docs/cli.md.

A config names registered things only; import paths and ``imports:`` in it run only with
``--allow-import PREFIX`` (modules under PREFIX) or ``--trust-config`` (anything); ``--print-config``
never imports.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["main"]

_TRUST_EPILOG = """\
trust: a config (and a run folder's config.yaml) is data: its name: keys resolve to registered
  names only. Import paths (mypkg.models.ResNet) and imports: are refused unless you pass
  --allow-import mypkg (modules under that prefix) or --trust-config (any module).
"""

_EPILOG = """\
overrides: any number of dotted KEY=VALUE pairs after the options; values are read as YAML, e.g.
  optimizer.lr=3e-4 trainer.max_epochs=20 model.hparams.hidden_dims=[256,256] callbacks.0.args.patience=5

""" + _TRUST_EPILOG
_TOP_EPILOG = _EPILOG.replace("\n\ntrust:", "\n  (validate, test, predict and export take data.* overrides only; "
                              "validate also trainer.limit_val_batches;\n  validate, test, predict and fit --resume "
                              "take data.name, data.seed and data.kwargs\n  other than the run's only with "
                              "--allow-resplit)\n\ntrust:", 1)

# validate, test, predict and export load the run's model with its saved settings (hparams.yaml):
# they take data.* overrides only (validate also trainer.limit_val_batches) and refuse the others.
_EVAL_OVERRIDES = {  # command: (what it accepts, an example)
    "validate": ("data.* and trainer.limit_val_batches", "data.eval_batch_size=256 trainer.limit_val_batches=10"),
    "test": ("data.*", "data.eval_batch_size=256"),
    "predict": ("data.*", "data.eval_batch_size=256"),
    "export": ("data.*", "data.kwargs.KEY=VALUE"),  # the data gives only the example input (its train split)
}
# The data section's fields that decide which examples each split holds: validate, test, predict
# and fit --resume refuse a value other than the run's unless --allow-resplit (batch sizes are safe).
_SPLIT_FIELDS = ("name", "seed", "kwargs")
_RESPLIT_TEXT = ("data.name, data.seed and data.kwargs must be the run's (they decide which examples each split "
                 "holds) unless --allow-resplit is given")


def _eval_epilog(command: str) -> str:
    import textwrap

    accepted, example = _EVAL_OVERRIDES[command]
    text = (f"overrides: dotted KEY=VALUE pairs after the options; values are read as YAML. {command} loads the "
            f"run's model with its saved settings (hparams.yaml), so only {accepted} overrides apply, e.g. "
            f"{example}; others (optimizer.*, model.*, trainer.max_epochs, ...) are refused."
            + (f" Of the data section, {_RESPLIT_TEXT}." if command != "export" else ""))
    return textwrap.fill(text, width=100, subsequent_indent="  ", break_on_hyphens=False) + "\n\n" + _TRUST_EPILOG


class _Parser(argparse.ArgumentParser):
    """A command's parser; for the commands that read a config, ``--help`` also lists every config
    field with its type and default (imported only then: the schema needs jax)."""

    lists_config_fields = False

    def format_help(self) -> str:
        text = super().format_help()
        if not self.lists_config_fields:
            return text
        from flaxlight.config import config_fields

        rows = config_fields()
        width = max(len(key) for key, _, _ in rows)
        listing = "\n".join(f"  {key:<{width}}  {kind} = {default}" for key, kind, default in rows)
        return (f"{text}\nconfig fields (in the YAML, as KEY=VALUE or --KEY=VALUE; optimizer.* keys are the "
                f"optimizer_hparams of docs/optimizers.md):\n{listing}\n")


def _dotted_flags(argv: Sequence[str], value_options: Iterable[str] = ()) -> list[str]:
    """LightningCLI's ``--trainer.max_epochs=5`` / ``--trainer.max_epochs 5`` as our ``trainer.max_epochs=5``.
    As argparse, ``--KEY VALUE`` does not take an option as its VALUE (``--print-config``, ``-c``,
    ``--a.b``, ...), a negative number aside: ``--trainer.seed -1`` works, ``--KEY=-x`` for other text;
    nor is ``--KEY`` taken as the value of an option in ``value_options`` (``--log-dir --a.b 5``)."""
    out, args = [], list(argv)
    while args:
        arg = args.pop(0)
        name = arg[2:].split("=", 1)[0]
        if arg.startswith("--") and "." in name and not name.startswith("."):
            if out and out[-1] in value_options:
                raise _UsageError(f"{out[-1]} expects a value: {out[-1]} VALUE (the next argument, {arg}, is an "
                                  f"option).")
            if "=" in arg:
                out.append(arg[2:])
                continue
            if not args or _is_option(args[0]):
                after = f" (the next argument, {args[0]}, is an option; a value that starts with '-' goes " \
                        f"after '=': {arg}=-x)" if args else ""
                raise _UsageError(f"{arg} expects a value: {arg} VALUE or {arg}=VALUE{after}.")
            out.append(f"{name}={args.pop(0)}")
        else:
            out.append(arg)
    return out


def _is_option(text: str) -> bool:
    """Whether a command-line argument reads as an option, as argparse reads it: it starts with
    ``-`` and is not a number (``-1``, ``-1e-3``) or ``-`` alone."""
    if not text.startswith("-") or text == "-":
        return False
    try:
        float(text)
    except ValueError:
        return True
    return False


def _add_config_arguments(parser: argparse.ArgumentParser, *, config_required: bool,
                          evaluates: str | None = None, fits: bool = False) -> None:
    parser.lists_config_fields = True
    more = "; repeatable: later files are merged over earlier ones, section by section"
    if fits:  # required, but for --resume RUN_DIR, which reads RUN_DIR/config.yaml
        parser.add_argument("-c", "--config", action="append", metavar="PATH",
                            help="the run's YAML config (required; with --resume RUN_DIR the default is "
                                 "RUN_DIR/config.yaml, saved by fit)" + more)
    elif config_required:
        parser.add_argument("-c", "--config", required=True, action="append", metavar="PATH",
                            help="the run's YAML config" + more)
    else:
        parser.add_argument("-c", "--config", action="append", metavar="PATH",
                            help="the run's YAML config (default: RUN_DIR/config.yaml, saved by fit)" + more)
    if evaluates is None:
        overrides_help = ("dotted overrides, e.g. optimizer.lr=3e-4 trainer.max_epochs=20 (or, as in "
                          "LightningCLI, --optimizer.lr=3e-4 --trainer.max_epochs 20)")
    else:
        accepted, example = _EVAL_OVERRIDES[evaluates]
        first = example.split()[0]
        overrides_help = (f"dotted overrides, {accepted} only (the model keeps its saved settings), e.g. "
                          f"{example} (or, as in LightningCLI, --{first.replace('=', ' ', 1)})")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)
    parser.add_argument("--print-config", "--print_config", action="store_true",
                        help="print the resolved config (defaults filled in, overrides applied) and exit; "
                             "imports nothing")
    parser.add_argument("--allow-import", action="append", default=[], metavar="PREFIX", dest="allow_import",
                        help="let the config import modules under PREFIX (e.g. mypkg: mypkg.models.ResNet, "
                             "imports: [mypkg.registrations]); repeatable. Only for configs you trust")
    parser.add_argument("--trust-config", action="store_true",
                        help="let the config import any module (its import paths and imports: run code); only "
                             "for configs you wrote or trust. --allow-import is the narrower choice")


def _add_fit_arguments(fit: argparse.ArgumentParser) -> None:
    _add_config_arguments(fit, config_required=True, fits=True)
    fit.add_argument("--log-dir", metavar="DIR", help="the run's log dir (same as trainer.logger_params.log_dir=DIR)")
    fit.add_argument("--resume", metavar="RUN_DIR",
                     help="continue the run in RUN_DIR from its newest checkpoint (its log dir becomes RUN_DIR)")
    fit.add_argument("--overwrite", action="store_true",
                     help="replace the run already in --log-dir (its checkpoints and metrics are deleted)")
    fit.add_argument("--allow-resplit", action="store_true",
                     help="with --resume: continue on data whose data.name, data.seed or data.kwargs differ from the "
                          "run's (they change which examples each split holds, so the val and test splits may then "
                          "hold examples the run trained on)")


def _add_checkpoint_arguments(parser: argparse.ArgumentParser, *, scores: bool = True) -> None:
    parser.add_argument("--ckpt", "--ckpt_path", "--ckpt-path", dest="ckpt", required=True, metavar="RUN_DIR",
                        help="a run's log dir (with hparams.yaml and checkpoints/), as printed by fit")
    parser.add_argument("--which", choices=("best", "last"), default="best",
                        help="which checkpoint to load (default: %(default)s)")
    if scores:  # validate, test, predict: the data's splits matter (export takes one example input)
        parser.add_argument("--allow-resplit", action="store_true",
                            help="evaluate on data whose data.name, data.seed or data.kwargs differ from the run's "
                                 "(they change which examples each split holds, so a split may then hold examples "
                                 "the run trained on)")


_EXPORT_TEXT = ("Load a run's checkpoint and write its eval-mode forward pass, trained variables baked in, with "
                "jax.export (any batch size; for this machine's platform, or --platforms cpu,cuda) to a folder that "
                "serves without flaxlight; plain JAX loads it: "
                "jax.export.deserialize(open(DIR/model.jax_exported, 'rb').read()).call(x).")


def _add_export_arguments(export: argparse.ArgumentParser) -> None:
    _add_config_arguments(export, config_required=False, evaluates="export")
    _add_checkpoint_arguments(export, scores=False)
    export.add_argument("-o", "--output", metavar="DIR",
                        help="the folder to write (default: RUN_DIR/export, or RUN_DIR/export_last for --which last)")
    export.add_argument("--batch-size", type=_positive_int, metavar="N",
                        help="export for exactly N examples (default: any batch size)")
    export.add_argument("--platforms", type=_platforms, metavar="NAMES",
                        help="the platforms the artifact runs on, comma-separated: cpu, cuda, rocm, tpu (e.g. "
                             "cpu,cuda; default: this machine's). It runs on no other")
    export.add_argument("--precision", choices=("fp32", "bf16"),
                        help="the forward pass's precision (default: the run's, as its validation computed)")


def _add_predict_arguments(predict: argparse.ArgumentParser) -> None:
    _add_config_arguments(predict, config_required=False, evaluates="predict")
    _add_checkpoint_arguments(predict)
    predict.add_argument("--split", choices=("test", "val", "train"), default="test",
                         help="which split to predict (default: %(default)s)")
    predict.add_argument("-o", "--output", metavar="PATH",
                         help="the .npy file (default: RUN_DIR/predictions[_<split>][_last].npy: the split unless "
                              "test, _last for --which last; .npz for a model of several outputs); the rows follow "
                              "the split's order")


def _platforms(text: str) -> tuple[str, ...]:
    from flaxlight.export import PLATFORMS

    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in PLATFORMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected platforms among {', '.join(PLATFORMS)}, comma-separated (e.g. "
                                         f"cpu,cuda); got {text!r}" + (" (gpu: cuda for NVIDIA, rocm for AMD)"
                                                                       if "gpu" in unknown else ""))
    return names


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from flaxlight import __version__

    top = argparse.ArgumentParser(
        prog="flaxlight",
        description="Train, evaluate, tune and plot flaxlight runs from YAML configs.",
        epilog="Run 'flaxlight COMMAND --help' for a command's options.\n\n" + _TOP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"flaxlight {__version__}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    parsers: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text, description=description,
                                epilog=(None if name in ("plot", "list")  # plot, list: read no config
                                        else _eval_epilog(name) if name in _EVAL_OVERRIDES else _EPILOG),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parsers[name] = parser
        return parser

    fit = add("fit", "train (and test) the run a config describes",
              "Build data, model, trainer, callbacks and loggers from the config; train; test the best model "
              "when the data has a test split. The resolved config is saved as config.yaml in the run's log dir; "
              "the metrics and the log dir are printed.")
    _add_fit_arguments(fit)

    for name, split in (("validate", "validation"), ("test", "test")):
        parser = add(name, f"evaluate a trained run on the {split} split",
                     f"Load a run's checkpoint (load_from_checkpoint) and evaluate it on the {split} split of the "
                     f"config's data; print the metrics.")
        _add_config_arguments(parser, config_required=False, evaluates=name)
        _add_checkpoint_arguments(parser)

    predict = add("predict", "write a trained run's predictions to an .npy file (.npz for several outputs)",
                  "Load a run's checkpoint and write the model's outputs (eval mode) on a split of the config's data, "
                  "in the split's order (unshuffled), to an .npy file; a model that returns several outputs (a dict "
                  "or a tuple) to one .npz, one entry per output (np.load(path)['digit']).")
    _add_predict_arguments(predict)

    _add_export_arguments(add("export", "write a trained run's model as a jax.export artifact", _EXPORT_TEXT))
    tune = add("tune", "search hyperparameters with Optuna (the config's tune: section)",
               "Run an Optuna study over the config's tune: section (see docs/tuning.md); delegates to "
               "flaxlight.tune.tune_from_config and prints the best trial.")
    _add_config_arguments(tune, config_required=True)
    tune.add_argument("--n-trials", type=int, metavar="N", help="trials to run (default: the tune: section's)")

    plot = add("plot", "draw learning curves of runs (PNG, SVG, PDF, ...), or an Optuna study's plots (PNG)",
               "flaxlight plot RUN_DIR [RUN_DIR ...] [-o curves.png]: learning curves from the runs' metrics.csv, "
               "several runs overlaid, in the format the file's suffix names (curves.svg, curves.pdf, ...).\n"
               "flaxlight plot --study STORAGE_URL --study-name NAME -o DIR: optimisation history, intermediate "
               "values, parameter importances and a contour plot of a study.")
    plot.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="runs' log dirs (with metrics.csv)")
    plot.add_argument("-o", "--output", metavar="PATH",
                      help="the image, in the format its suffix names: .png, .svg, .pdf, ... (default: "
                           "learning_curves.png), or the folder for --study (default: study_plots)")
    plot.add_argument("--metrics", nargs="+", metavar="NAME", help="panels to draw, e.g. loss acc (default: all)")
    plot.add_argument("--study", metavar="STORAGE_URL", help="an Optuna storage, e.g. sqlite:///runs/study.db")
    plot.add_argument("--study-name", metavar="NAME", help="the study in that storage")

    add("list", "list the registered models, datasets, trainers, callbacks and loggers",
        "List the short names the config's name: keys accept (an import path such as mypkg.models.ResNet "
        "works too).").add_argument("kind", nargs="?", choices=("models", "datasets", "trainers", "callbacks",
                                                               "loggers"), help="only this kind")
    return top, parsers


# ---------------------------------------------------------------------------------------- helpers
def _metrics_heading(metrics: Mapping[str, Any]) -> str:
    """Which metrics ``fit`` prints: those of the best validation (found in the run's history by
    its values, for its epoch), with the train metrics of the epoch it ended, or the last epoch's.

    Examples:
        >>> from flaxlight.callbacks.history import FitResult
        >>> _metrics_heading(FitResult({"val/loss": 0.2, "train/loss": 0.3}, history=[
        ...     {"epoch": 1, "val/loss": 0.2, "train/loss": 0.3}, {"epoch": 2, "val/loss": 0.4, "train/loss": 0.1}]))
        "metrics of the best validation (epoch 1; train/... of the epoch it ended; metrics.csv holds every epoch's):"
    """
    validation = {key: value for key, value in metrics.items() if key.startswith("val/")}
    if not validation:
        return "metrics (the last epoch's):"
    epoch = next((row.get("epoch") for row in reversed(getattr(metrics, "history", None) or [])
                  if all(row.get(key) == value for key, value in validation.items())), None)
    at = f"epoch {epoch}; " if epoch is not None else ""
    return f"metrics of the best validation ({at}train/... of the epoch it ended; metrics.csv holds every epoch's):"


def _format_metrics(metrics: dict[str, Any]) -> str:
    lines = []
    for key in sorted(metrics):
        value = metrics[key]
        lines.append(f"  {key}: {value:.6g}" if isinstance(value, (int, float)) else f"  {key}: {value}")
    return "\n".join(lines)


def _opt_in(args: argparse.Namespace) -> dict[str, Any]:
    """The import opt-in of the command line, as the config functions' keyword arguments."""
    return {"trust_config": args.trust_config, "allow_imports": list(args.allow_import)}


def _load(args: argparse.Namespace, default_config: str | None = None):
    """The config of the command; with ``--print-config`` only its schema is checked (no imports)."""
    from flaxlight.config import ConfigError, load_config

    path = args.config or default_config  # --config given: a list of files, merged in order
    if path is None:
        resume = " (or --resume RUN_DIR, which continues that run with its config.yaml)" \
            if args.command == "fit" else ""
        raise ConfigError(f"No config given: pass --config PATH{resume}.")
    ckpt = getattr(args, "ckpt", None)
    if ckpt and os.path.isfile(ckpt):
        run = os.path.dirname(os.path.normpath(ckpt)) or "."
        raise ConfigError(f"--ckpt {ckpt} is a file; --ckpt takes a run's folder, the one holding config.yaml, "
                          f"hparams.yaml and checkpoints/ (here: --ckpt {run}), and --which picks its best or last "
                          f"checkpoint. To evaluate with another config, add --config FILE.")
    if ckpt and os.path.basename(os.path.normpath(ckpt)).isdigit() and \
            os.path.basename(os.path.dirname(os.path.normpath(ckpt))) == "checkpoints":
        run = os.path.dirname(os.path.dirname(os.path.normpath(ckpt)))
        raise ConfigError(f"--ckpt {ckpt} is one checkpoint of the run in {run}; --ckpt takes the run's folder and "
                          f"--which picks its best or last checkpoint: --ckpt {run} --which best|last.")
    if ckpt and os.path.basename(os.path.normpath(ckpt)) == "checkpoints" and \
            os.path.isfile(os.path.join(os.path.dirname(os.path.normpath(ckpt)), "config.yaml")):
        run = os.path.dirname(os.path.normpath(ckpt)) or "."
        raise ConfigError(f"--ckpt {ckpt} is the checkpoints folder of the run in {run}; --ckpt takes the run's "
                          f"folder and --which picks its best or last checkpoint: --ckpt {run} --which best|last.")
    run_dir = os.path.dirname(path) if args.config is None else None  # the default: RUN_DIR/config.yaml
    if run_dir is not None and not os.path.isdir(run_dir):
        flag = "--resume" if args.command == "fit" else "--ckpt"
        raise ConfigError(f"{flag} {run_dir}: no such folder; give the folder of a run (`flaxlight fit` prints its "
                          f"log dir; it holds config.yaml, hparams.yaml and checkpoints/).")
    if run_dir is not None and not os.path.isfile(path):
        raise ConfigError(f"No {os.path.basename(path)} in {run_dir} (runs started by "
                          f"`flaxlight fit` save one there); pass --config PATH.")
    return load_config(path, args.overrides, check=not args.print_config, **_opt_in(args))


def _print_config(cfg) -> int:
    from flaxlight.config import dump_config

    print(dump_config(cfg), end="")
    return 0


# ---------------------------------------------------------------------------------------- commands
def _fit(args: argparse.Namespace) -> int:
    from flaxlight.config import CONFIG_FILE, ConfigError, fit

    if args.resume and not args.config:  # its own config.yaml, as validate and test read it
        _check_resumable(args.resume)
    cfg = _load(args, os.path.join(args.resume, CONFIG_FILE) if args.resume else None)
    if args.resume and args.log_dir and os.path.abspath(args.resume) != os.path.abspath(args.log_dir):
        raise ConfigError("--resume RUN_DIR continues the run in RUN_DIR; do not also give a different --log-dir.")
    if args.resume and args.overwrite:
        raise ConfigError(f"--resume {args.resume} continues the run there and --overwrite replaces it (its "
                          f"checkpoints and metrics are deleted): give one of them.")
    if args.resume:
        _check_resumable(args.resume)
    if args.log_dir or args.resume:
        cfg.trainer.logger_params.log_dir = args.resume or args.log_dir
    if args.print_config:
        return _print_config(cfg)
    if args.resume and not args.allow_resplit:
        _check_same_splits(cfg, args, args.resume)
    done = _nothing_to_train(cfg, args.resume) if args.resume else None
    if done:
        print(done)
        return 0
    try:
        result = fit(cfg, resume=bool(args.resume), overwrite=args.overwrite, **_opt_in(args))
    except FileExistsError as exc:
        if "already holds a run" not in str(exc):
            raise
        raise _UsageError(_run_in_the_way(cfg.trainer.logger_params.log_dir, bool(args.log_dir))) from None
    print(_metrics_heading(result.metrics) + "\n" + _format_metrics(result.metrics))
    if result.log_dir:
        print(f"config: {os.path.join(result.log_dir, CONFIG_FILE)}")
        print(f"log dir: {result.log_dir}")
    return 0


def _has_checkpoint(run_dir: str) -> bool:
    from flaxlight.runfiles import CHECKPOINT_DIR

    folder = os.path.join(run_dir, CHECKPOINT_DIR)
    return os.path.isdir(folder) and any(name.isdigit() for name in os.listdir(folder))


def _check_resumable(run_dir: str) -> None:
    """``--resume RUN_DIR`` needs a checkpoint there; without one, what the folder holds and the way on."""
    from flaxlight.config import ConfigError
    from flaxlight.runfiles import failed_start, run_files_present

    if _has_checkpoint(run_dir):
        return
    if not os.path.isdir(run_dir) or not run_files_present(run_dir):
        raise ConfigError(f"--resume {run_dir}: no run to continue there (no checkpoints/ folder). Give the folder of "
                          f"an earlier run (it holds hparams.yaml and checkpoints/), or drop --resume.")
    if failed_start(run_dir):
        raise ConfigError(f"--resume {run_dir}: the run there failed before its first checkpoint and record, so "
                          f"there is nothing to continue. Drop --resume to start it again there (the failed "
                          f"attempt's files are moved to {run_dir}/failed_start_N/, nothing is deleted).")
    raise ConfigError(f"--resume {run_dir}: the run there saved no checkpoint (it stopped before its first, or ran with "
                      f"trainer.enable_checkpointing: false), so it cannot be continued. Train it again with "
                      f"--log-dir {run_dir} --overwrite (its records are deleted), or in another --log-dir.")


def _run_in_the_way(run_dir: str, from_flag: bool) -> str:
    """The refusal of a ``fit`` into a folder that holds a run: ``--resume`` only where a checkpoint is."""
    named = f"--log-dir {run_dir}" if from_flag else f"The config's trainer.logger_params.log_dir {run_dir}"
    fresh = " (without one, each run gets a new version_N folder)" if from_flag else \
        ", or trainer.logger_params.log_dir=null for a new version_N folder"
    if _has_checkpoint(run_dir):
        return (f"{named} already holds a run. --resume {run_dir} continues it, --overwrite replaces it (its "
                f"checkpoints and metrics are deleted), or give another --log-dir{fresh}.")
    return (f"{named} already holds a run's records (metrics) but no checkpoint, so it cannot be resumed. "
            f"--overwrite replaces it (its records are deleted), or give another --log-dir{fresh}.")


def _nothing_to_train(cfg: Any, run_dir: str) -> str | None:
    """What to say when the run's newest checkpoint already reached the config's ``max_epochs`` or
    ``max_steps`` (training would do nothing, and testing again add a duplicate test); else None."""
    from flaxlight.resume import CheckpointMeta, checkpointer_for

    try:
        checkpointer = checkpointer_for(run_dir)
        step = max(checkpointer.all_steps())
        meta = CheckpointMeta.from_json(checkpointer.read_meta(step))
    except Exception:  # noqa: BLE001 - unreadable: the resume itself says what is wrong
        return None
    max_steps, max_epochs = cfg.trainer.max_steps, cfg.trainer.max_epochs
    if max_steps is not None and meta.step >= max_steps:
        reached, more = f"trainer.max_steps={max_steps} (its newest checkpoint is step {meta.step})", "max_steps"
    elif meta.epoch >= max_epochs and (meta.phase == "epoch_end" or (meta.phase == "val" and meta.validated)):
        reached = f"trainer.max_epochs={max_epochs} (its newest checkpoint, step {meta.step}, ends epoch {meta.epoch})"
        more = "max_epochs"
    else:
        return None
    return (f"Nothing to train: the run in {run_dir} has reached {reached}; nothing was run or written. To train "
            f"on, raise it (trainer.{more}=N); to test the run again: flaxlight test --ckpt {run_dir}.")


def _evaluate(args: argparse.Namespace) -> int:
    from flaxlight.config import (CONFIG_FILE, ConfigError, build_data, example_input, load_trainer,
                                  raised_by_flaxlight, resolve_config)

    cfg = _load(args, os.path.join(args.ckpt, CONFIG_FILE))
    keys = [text.split("=", 1)[0] for text in args.overrides]
    limit_given = args.command == "validate" and "trainer.limit_val_batches" in keys
    ignored = [text for text, key in zip(args.overrides, keys) if key.split(".", 1)[0] not in ("data", "imports")
               and not (limit_given and key == "trainer.limit_val_batches")]
    if ignored:
        also = " (and trainer.limit_val_batches for validate)" if args.command == "validate" else ""
        raise ConfigError(f"{args.command} loads the run's model with its saved settings (hparams.yaml), so only "
                          f"data.* overrides apply{also}; {', '.join(ignored)} would be ignored. To change the "
                          f"model or its training, fit a new run.")
    if args.print_config:
        return _print_config(cfg)
    if args.command != "export" and not args.allow_resplit:
        _check_same_splits(cfg, args, args.ckpt)
    resolved = resolve_config(cfg, **_opt_in(args))
    train, val, test = build_data(cfg, resolved)
    split = getattr(args, "split", None) or {"validate": "val", "test": "test", "export": "train"}[args.command]
    loader = {"train": train, "val": val, "test": test}[split]
    if loader is None:
        other = " Pick another with --split val or --split train." if args.command == "predict" else ""
        raise ConfigError(f"data {cfg.data.name!r} has no {split} split (its factory returned None for it).{other}")
    trainer = load_trainer(cfg, args.ckpt, example_input(train), which=args.which, resolved=resolved,
                           **_opt_in(args))
    if args.command == "predict":
        return _write_predictions(trainer, loader, args, split)
    if args.command == "export":
        path = trainer.export(args.output or os.path.join(args.ckpt, "export" if args.which == "best" else
                                                           f"export_{args.which}"), which=args.which,
                              batch_size=args.batch_size, platforms=args.platforms,
                              precision=args.precision)
        print(f"exported ({args.which} checkpoint of {args.ckpt}): {path}")
        return 0
    limit = (cfg.trainer.limit_val_batches if limit_given else trainer.options.limit_val_batches) \
        if args.command == "validate" else None
    if limit is not None:  # the run's own validation: its best was chosen on these batches
        from flaxlight.data import FirstBatches
        from flaxlight.loop import limit_batches, safe_len

        loader = FirstBatches(loader, limit_batches(safe_len(loader), limit, "limit_val_batches"))
    try:
        metrics = trainer.eval_model(loader, log_prefix=f"{split}/")
    except ValueError as exc:  # flaxlight's checks (no batches, a batch unlike the model's input)
        if not raised_by_flaxlight(exc):
            raise
        raise ConfigError(str(exc)) from None
    limited = f", limit_val_batches={limit}" + ("" if limit_given else " as in the run") if limit is not None else ""
    print(f"{args.command} ({args.which} checkpoint of {trainer.log_dir}{limited}):\n" + _format_metrics(metrics))
    return 0


def _check_same_splits(cfg: Any, args: argparse.Namespace, run_dir: str) -> None:
    """Refuse data settings that change which examples each split holds (:data:`_SPLIT_FIELDS`),
    compared with the run's own ``config.yaml`` (else, when evaluating, the ``--config`` files without the
    overrides): evaluating (or resuming: ``fit --resume``) would score the model on examples it may have
    trained on."""
    from flaxlight.config import CONFIG_FILE, ConfigError, load_config

    saved = os.path.join(run_dir, CONFIG_FILE)
    reference = None
    # A resume compares with the run's own record only: without one (a run started from Python, a
    # config.yaml an older flaxlight wrote) the --config files say nothing of the run's data.
    fallback = () if args.command == "fit" else ((args.config, " + ".join(args.config or [])),)
    for source, what in ((saved, f"the run's config ({saved})"), *fallback):
        if source and (isinstance(source, list) or os.path.isfile(source)):
            try:
                reference = load_config(source, check=False)
                break
            except ConfigError:
                continue
    if reference is None:
        return
    differ = [f"data.{key}: {getattr(cfg.data, key)!r} here, {getattr(reference.data, key)!r} in {what}"
              for key in _SPLIT_FIELDS if getattr(cfg.data, key) != getattr(reference.data, key)]
    if not differ:
        return
    given = [text for text in args.overrides if text.split("=", 1)[0].strip().split(".")[0] == "data"
             and text.split("=", 1)[0].strip() not in ("data.batch_size", "data.eval_batch_size")]
    by = f" (the override{'s' * (len(given) > 1)} {', '.join(given)})" if given else ""
    if args.command == "fit":
        doing, harm, anyway = ("fit --resume would continue the run on other data than the run's",
                               "the resumed epochs would train on other examples, and validate and test on splits "
                               "that may hold examples the run trained on", "continue on this data anyway")
    else:
        doing, harm, anyway = (f"{args.command} would score the run's model on other data than the run's",
                               "this split may hold examples the run trained on", "evaluate on this data anyway")
    raise ConfigError(f"{doing}: {'; '.join(differ)}{by}. data.name, data.seed and data.kwargs decide which "
                      f"examples each split holds, so {harm}. Keep the run's (data.batch_size and "
                      f"data.eval_batch_size may change), or pass --allow-resplit to {anyway}.")


def _in_order(loader):
    """``loader`` read in order and whole (a shuffling train loader's rows would not match the
    split's): a copy of an :class:`~flaxlight.ArrayLoader` (a subclass keeps its own batches) with
    ``shuffle=False, drop_last=False``; other loaders as they are."""
    import copy

    from flaxlight.data import ArrayLoader

    if isinstance(loader, ArrayLoader) and (loader.shuffle or loader.drop_last):
        loader = copy.copy(loader)
        loader.shuffle, loader.drop_last = False, False  # every row, in order
    return loader


def _write_predictions(trainer, loader, args: argparse.Namespace, split: str) -> int:
    """Predict the split and write it: one array as ``.npy``; several outputs (a dict, tuple or other
    pytree of arrays) as one ``.npz`` beside it, one entry per output (:func:`_output_arrays`)."""
    import numpy as np

    from flaxlight.config import ConfigError

    try:  # as trainer.predict computes them: eval mode, the run's precision
        predictions = trainer.predict(_in_order(loader))
    except ValueError as exc:
        if "yielded no batches" not in str(exc):
            raise
        raise ConfigError(f"The {split} split yielded no batches: nothing to predict (check the data's settings).") \
            from None
    several = not isinstance(predictions, np.ndarray)
    arrays = _output_arrays(predictions) if several else None
    stem = "predictions" + ("" if split == "test" else f"_{split}") + ("" if args.which == "best" else f"_{args.which}")
    suffix = ".npz" if several else ".npy"  # what np.save / np.savez write
    path = args.output or os.path.join(args.ckpt, stem + suffix)
    if several and path.endswith(".npy"):
        path = path[:-len(".npy")]
    path = path if path.endswith(suffix) else path + suffix
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if not several:
        np.save(path, predictions)
        print(f"predictions ({split} split, shape {predictions.shape}, {predictions.dtype}): {path}")
        return 0
    _savez(path, arrays)
    listing = ", ".join(f"{key} {value.shape} {value.dtype}" for key, value in arrays.items())
    print(f"predictions ({split} split; the model returns a {type(predictions).__name__} of {len(arrays)} outputs, "
          f"saved as one .npz, an array per key: {listing}): {path}")
    return 0


def _output_arrays(predictions: Any) -> dict[str, Any]:
    """The model's outputs by key, as the ``.npz`` holds them: a dict's keys (nested ones joined by
    ``/``: ``heads/digit``), a tuple's or list's positions (``0``, ``1``, ...), a dataclass's or
    named tuple's field names. Outputs that are not arrays, none at all, or two with one key are
    refused in one line."""
    import jax
    import numpy as np

    from flaxlight.config import ConfigError

    def part(entry: Any) -> str:
        for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
            if hasattr(entry, attribute):
                return str(getattr(entry, attribute))
        return str(entry)

    arrays: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(predictions)[0]:
        key = "/".join(part(entry) for entry in path)
        if not isinstance(leaf, np.ndarray) or leaf.dtype == object:
            raise ConfigError(f"predict writes arrays, but the model's output {key or '(the whole output)'} is "
                              f"{type(leaf).__name__}; nothing was written. Return arrays (a dict or tuple of them), "
                              f"or use the Python API (trainer.predict) for other outputs.")
        if key in arrays:
            raise ConfigError(f"predict: two of the model's outputs would be saved under one key, {key!r} (a dict "
                              f"key holding '/' beside a nested dict?); nothing was written. Rename one.")
        arrays[key] = leaf
    if not arrays:
        raise ConfigError(f"predict: the model returns no arrays ({type(predictions).__name__} "
                          f"{str(predictions)[:60]}); nothing was written.")
    return arrays


def _savez(path: str, arrays: dict[str, Any]) -> None:
    """``np.savez(path, **arrays)`` for any keys (np.savez's own keyword names, ``file``, included)."""
    import zipfile

    import numpy as np

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, value in arrays.items():
            with archive.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)


def _tune(args: argparse.Namespace) -> int:
    from flaxlight.config import ConfigError, config_to_dict

    cfg = _load(args)
    if args.print_config:
        return _print_config(cfg)
    if args.n_trials is not None and args.n_trials < 1:
        raise _usage_error(f"--n-trials must be >= 1, got {args.n_trials}.")
    tune_from_config = _import_tune("tune_from_config")
    opt_in = {k: v for k, v in _opt_in(args).items() if v}  # only what was asked for
    tune_module = sys.modules.get("flaxlight.tune")
    failed = tuple(filter(None, [getattr(tune_module, "TuneError", None)]))
    try:
        study = tune_from_config(config_to_dict(cfg), n_trials=args.n_trials, **opt_in)
    except failed as exc:  # the study ran, and failed: its trials are saved
        raise _CommandFailed(str(exc)) from None
    except (ValueError, LookupError, ConnectionError) as exc:
        # Set-up errors only (every trial's own errors are recorded in the study): the tune section,
        # the search space, the metric never logged, the storage. One line, exit status 2.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise ConfigError(f"{' + '.join(args.config)}: {message}") from None
    _print_study(study)
    return 0


def _print_study(study: Any) -> None:
    try:
        best = study.best_trial
    except (ValueError, AttributeError):  # optuna: no trial completed
        print(f"study {getattr(study, 'study_name', '')!r}: no trial completed.")
        return
    print(f"study {study.study_name!r}: best trial #{best.number}, value {best.value:.6g}")
    for key, value in best.params.items():
        print(f"  {key}: {value}")
    log_dir = best.user_attrs.get("log_dir") if isinstance(getattr(best, "user_attrs", None), dict) else None
    if log_dir:
        print(f"log dir: {log_dir}")


def _import_tune(name: str) -> Callable:
    import importlib

    try:
        tune_module = importlib.import_module("flaxlight.tune")
    except ImportError as exc:
        raise _usage_error(f"flaxlight {'tune' if name == 'tune_from_config' else 'plot --study'} needs "
                           f"flaxlight.tune and optuna (pip install optuna): {exc}") from None
    function = getattr(tune_module, name, None)
    if function is None:
        raise _usage_error(f"flaxlight.tune has no {name}() in this version.")
    return function


def _plot(args: argparse.Namespace) -> int:
    if args.study:
        if args.run_dirs:
            raise _usage_error("give either RUN_DIRs (learning curves) or --study (a study's plots), not both.")
        plot_study = _import_tune("plot_study")
        try:
            written = plot_study(args.study, args.study_name, args.output or "study_plots")
        except (KeyError, ValueError) as exc:  # no such study, several studies and no name
            raise _usage_error(str(exc.args[0]) if exc.args else str(exc)) from None
        if isinstance(written, (list, tuple)):
            for path in written:
                print(path)
        else:
            print(written if written is not None else (args.output or "study_plots"))
        return 0
    if args.study_name:
        raise _usage_error("--study-name needs --study STORAGE_URL.")
    if not args.run_dirs:
        raise _usage_error("give one or more RUN_DIRs, or --study STORAGE_URL --study-name NAME.")
    try:
        from flaxlight.plot import plot_runs

        path = plot_runs(args.run_dirs, args.output or "learning_curves.png", args.metrics)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        raise _usage_error(str(exc)) from None
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    from flaxlight.registry import REGISTRIES

    for kind, reg in REGISTRIES.items():
        if args.kind in (None, f"{kind}s"):
            print(f"{kind}s: {', '.join(reg.names()) or '(none)'}")
    return 0


# Advice that flaxlight's messages give in Python terms, as a command-line user acts on it (errors and
# log lines of a command pass through _for_cli). Python spelling -> command-line spelling.
_CLI_SPELLINGS = (
    ("Pass monitor='val/<name>' (and mode='min'/'max') to the trainer",
     "Set trainer.monitor=val/<name> (and trainer.mode=min or max)"),
    ("pass monitor='val/<name>', mode='min'/'max' to choose another",
     "set trainer.monitor=val/<name> and trainer.mode=min or max to choose another"),
    ("Pass which='current' to say so, or turn checkpointing on",
     "Turn checkpointing on (trainer.enable_checkpointing=true, or a model_checkpoint callback)"),
    ("(enable_checkpointing=True, or callbacks=[ModelCheckpoint(...)]), or use the trainer that trained it "
     "(predict, export)", "(trainer.enable_checkpointing=true, or a model_checkpoint callback)"),
    ("optimizer_hparams (see its hparams.yaml)", "optimizer section (see its config.yaml)"),
    ("start fresh from its weights: load_from_checkpoint(run_dir, exmp_input, with_optimizer=False, "
     "optimizer_hparams=...) and train_model into a new log_dir",
     "start a new run from its weights, which the command line cannot do (the Python recipe: docs/cli.md, "
     "\"A new run from a trained run's weights\")"),
    ("build the trainer with the model hyperparameters of that run (see its hparams.yaml)",
     "use the run's model section (its config.yaml, the default without --config)"),
    ("Build the trainer with the model hyperparameters of that run (see its hparams.yaml)",
     "Use the run's model section (its config.yaml, the default without --config)"),
    # a command tests the config's one test set again (fit --resume, test --ckpt): no second set to name
    ("holds an earlier test's metrics: this one's", "holds an earlier test's metrics (of the same test split): "
     "this one's"),
    (" Name test sets with test(..., name='shifted'): test_shifted/... metrics.", " The earlier file is kept."),
    ("set val_check_interval=N (steps) with check_val_every_n_epoch=None",
     "set trainer.val_check_interval=N (steps) with trainer.check_val_every_n_epoch=null"),
    ("Lower check_val_every_n_epoch, train longer", "Lower trainer.check_val_every_n_epoch, train longer"),
    ("or lower check_val_every_n_epoch.", "or lower trainer.check_val_every_n_epoch."),
)


def _for_cli(text: str) -> str:
    """``text`` with the Python-only advice of :data:`_CLI_SPELLINGS` in the command line's spelling.

    Examples:
        >>> _for_cli("Pass monitor='val/<name>' (and mode='min'/'max') to the trainer.")
        'Set trainer.monitor=val/<name> (and trainer.mode=min or max).'
        >>> _for_cli("optimizer_hparams['lr'] must be > 0")
        'optimizer.lr must be > 0'
    """
    for python, command_line in _CLI_SPELLINGS:
        text = text.replace(python, command_line)
    text = re.sub(r"\bresume to num_epochs=(\d+)", r"resume with trainer.max_epochs=\1", text)
    return re.sub(r"optimizer_hparams\['(\w+)'\]", r"optimizer.\1", text)  # a setting of the optimizer section


def _cli_log_lines(record: Any) -> bool:
    """A filter of the ``flaxlight`` logger while a command runs: its lines in the CLI's spelling."""
    record.msg, record.args = _for_cli(record.getMessage()), ()
    return True


def _command_line_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                          line: str | None = None) -> str:
    r"""``warnings.formatwarning`` while a command runs: no source line (a warning of flaxlight's
    attributed to the user's code lands on the ``flaxlight`` script's ``sys.exit(main())``), and no
    place when that place is the script itself or flaxlight's own code.

    Examples:
        >>> _command_line_warning("Study 's' is continued ...", UserWarning, sys.argv[0], 6)
        "UserWarning: Study 's' is continued ...\n"
    """
    path = os.path.abspath(filename)
    inside = path == os.path.abspath(sys.argv[0]) or path.startswith(os.path.dirname(os.path.abspath(__file__)) + os.sep)
    return f"{'' if inside else f'{filename}:{lineno}: '}{category.__name__}: {_for_cli(str(message))}\n"


class _UsageError(Exception):
    """Wrong arguments: the message is printed, the exit status is 2."""


class _CommandFailed(Exception):
    """The command ran and did not succeed (e.g. every trial of a study failed): the message is
    printed, the exit status is 1."""


_usage_error = _UsageError


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "fit": _fit, "validate": _evaluate, "test": _evaluate, "predict": _evaluate, "export": _evaluate, "tune": _tune,
    "plot": _plot,
    "list": _list,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 a usage or config error, 1 a run that
    failed, e.g. a study whose every trial failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top, parsers = _build_parser()
    parser = parsers.get(argv[0]) if argv else None
    value_options = {option for action in (parser._actions if parser else [])  # argparse's own list
                     for option in action.option_strings if action.nargs != 0}  # store_true, help: nargs 0
    try:
        argv = _dotted_flags(argv, value_options)
    except _UsageError as exc:
        print(f"flaxlight{f' {argv[0]}' if parser else ''}: error: {exc}", file=sys.stderr)
        return 2
    if argv and argv[0] in parsers:
        # Intermixed: overrides may come before, between or after the options.
        args = parsers[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
    else:
        args = top.parse_args(argv)
        if args.command is None:
            top.print_help(sys.stderr)
            return 2
    from flaxlight.checkpoint import DamagedCheckpointError
    from flaxlight.config import ConfigError
    from flaxlight.messages import logger
    from flaxlight.registry import RegistryError
    from flaxlight.runfiles import ByNameHparamError, RunInUseError

    added = _cli_log_lines not in logger.filters  # not by a main() called inside another (which removes it)
    if added:
        logger.addFilter(_cli_log_lines)
    format_warning, warnings.formatwarning = warnings.formatwarning, _command_line_warning
    try:
        return _COMMANDS[args.command](args)
    except (ConfigError, RegistryError, _UsageError, RunInUseError,  # and paths: --ckpt at no run, -o at a
            FileNotFoundError, FileExistsError, NotADirectoryError) as exc:  # file, a file where a folder goes
        print(f"flaxlight {args.command}: error: {_for_cli(str(exc))}", file=sys.stderr)
        return 2
    except ByNameHparamError as exc:  # a function of the run's model_hparams: loadable in Python only
        print(f"flaxlight {args.command}: error: {exc.command_line}", file=sys.stderr)
        return 2
    except (_CommandFailed, DamagedCheckpointError) as exc:
        print(f"flaxlight {args.command}: error: {_for_cli(str(exc))}", file=sys.stderr)
        return 1
    finally:
        warnings.formatwarning = format_warning
        if added:
            logger.removeFilter(_cli_log_lines)


if __name__ == "__main__":
    sys.exit(main())
