"""Learning curves from runs' ``metrics.csv`` as an image (the ``plot`` extra: matplotlib): a PNG,
or the format the file's suffix names (``.svg``, ``.pdf``, ``.jpg``, ...).

One panel per metric (``train/loss`` and ``val/loss`` share the ``loss`` panel), the runs
overlaid in one colour each (a single run: one colour per split): train solid, val dashed, test
as a star, the running per-step train values (``train/loss_step``) as a thin faint line.

Examples:
    >>> from flaxlight.plot import plot_runs
    >>> plot_runs(["checkpoints/MLP/version_0", "checkpoints/MLP/version_1"], "curves.png")  # doctest: +SKIP

From a shell: ``python -m flaxlight.plot RUN_DIR [RUN_DIR ...] [-o curves.png]`` (or ``curves.svg``, ...).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from typing import Any, Sequence

from flaxlight.loggers.base import run_display_name

__all__ = ["plot_runs", "read_metrics", "main"]

METRICS_FILE = "metrics.csv"
SKIPPED_COLUMNS = ("step", "epoch", "epoch_time", "trainer/global_step")  # its position column: see CSVLogger
SPLITS = ("train", "val", "test")
STEP_SUFFIX = "_step"
_STYLE = {  # split -> (line style, line width, alpha, marker)
    "train": ("-", 1.8, 1.0, None),
    "val": ("--", 1.8, 1.0, "o"),
    "test": ("", 0.0, 1.0, "*"),
    "train (step)": ("-", 0.7, 0.35, None),
    "": ("-", 1.8, 1.0, None),
}


def _metrics_path(run: str | os.PathLike) -> str:
    path = os.fspath(run)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No {METRICS_FILE} at {path}: pass a run's log dir (the folder with {METRICS_FILE}, e.g. "
            f"checkpoints/MLP/version_0) or the CSV file itself."
        )
    return path


def read_metrics(run: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """A run's ``metrics.csv`` as ``{column: (steps, values)}`` (empty cells skipped).

    Examples:
        >>> steps, values = read_metrics("checkpoints/MLP/version_0")["val/loss"]  # doctest: +SKIP
    """
    series: dict[str, tuple[list[int], list[float]]] = {}
    with open(_metrics_path(run), newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            if not row.get("step"):
                continue
            step = int(float(row["step"]))
            for key, text in row.items():
                if key is None or key in SKIPPED_COLUMNS or text in ("", None):
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(value)
    return series


def _panel_and_split(column: str) -> tuple[str, str]:
    """``"val/acc"`` -> ``("acc", "val")``; ``"train/loss_step"`` -> ``("loss", "train (step)")``."""
    split, sep, name = column.partition("/")
    if not sep or split not in SPLITS:
        return column, ""
    if split == "train" and name.endswith(STEP_SUFFIX) and len(name) > len(STEP_SUFFIX):
        return name[: -len(STEP_SUFFIX)], "train (step)"
    return name, split


def _run_names(run_dirs: Sequence[str]) -> list[str]:
    names = [run_display_name(os.path.dirname(p) if os.path.isfile(p) else p) for p in run_dirs]
    if len(set(names)) < len(names):  # same folder names: fall back to the paths as given
        names = [os.path.normpath(os.fspath(p)) for p in run_dirs]
    return names


def plot_runs(
    run_dirs: str | os.PathLike | Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    metrics: Sequence[str] | None = None,
    *,
    include_step: bool = True,
    ncols: int = 3,
    panel_size: tuple[float, float] = (4.8, 3.4),
    dpi: int = 100,
) -> str:
    """Draw the learning curves of one or more runs into an image file and return its path.

    Args:
        run_dirs: run log dirs (each with a ``metrics.csv``), or the CSV files themselves.
        out_path: the file to write (folders are created), in the format its suffix names, as
            matplotlib's ``savefig``: ``.png``, ``.svg``, ``.pdf``, ``.jpg``, ... (another or none:
            a ``ValueError`` listing them).
        metrics: panels to draw, in order: metric names without the split (``"loss"``,
            ``"acc"``) or full columns (``"val/acc"``); default: every metric in the files.
        include_step: also draw the per-step running train values (``train/loss_step``).
        ncols: panels per row (fewer when there are fewer metrics).
        panel_size: inches per panel; a PNG is ``ncols*w*dpi`` x ``nrows*h*dpi`` pixels.
        dpi: pixels per inch (of the raster formats).

    Examples:
        >>> plot_runs("checkpoints/MLP/version_0", "curves.png", metrics=["loss"])  # doctest: +SKIP
        'curves.png'
        >>> plot_runs("checkpoints/MLP/version_0", "curves.svg")  # doctest: +SKIP
        'curves.svg'
    """
    Figure, FigureCanvasAgg, MaxNLocator = _import_matplotlib()
    image_format = _image_format(out_path, FigureCanvasAgg.get_supported_filetypes())
    run_dirs = _as_run_dirs(run_dirs)
    runs = [read_metrics(p) for p in run_dirs]
    names = _run_names(run_dirs)
    panels = _select_panels(_group_panels(runs, include_step), metrics, run_dirs)
    ncols = max(1, min(ncols, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    colors = [c["color"] for c in _color_cycle()]
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (panel, entries) in zip(axes, panels.items()):
        _draw_panel(ax, panel, entries, names, colors, several_runs=len(runs) > 1, locator=MaxNLocator)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    if len(runs) == 1:
        fig.suptitle(names[0])
    return _save(fig, out_path, image_format, dpi)


# panel -> [(run index, split, column, (steps, values))]
_Panels = dict[str, list[tuple[int, str, str, tuple]]]


def _import_matplotlib() -> tuple[type, type, type]:
    """matplotlib's ``Figure``, ``FigureCanvasAgg`` and ``MaxNLocator``, or an ImportError naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError("plot_runs needs matplotlib: pip install 'flaxlight[plot]'.") from exc
    return Figure, FigureCanvasAgg, MaxNLocator


def _as_run_dirs(run_dirs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """One path or several -> a non-empty list of path strings."""
    if isinstance(run_dirs, (str, os.PathLike)):
        run_dirs = [run_dirs]
    run_dirs = [os.fspath(p) for p in run_dirs]
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run dir.")
    return run_dirs


def _group_panels(runs: Sequence[dict[str, tuple[list[int], list[float]]]], include_step: bool) -> _Panels:
    """The runs' columns grouped by panel (``train/loss`` and ``val/loss`` -> ``loss``)."""
    panels: _Panels = {}
    for index, series in enumerate(runs):
        for column, data in series.items():
            panel, split = _panel_and_split(column)
            if split == "train (step)" and not include_step:
                continue
            panels.setdefault(panel, []).append((index, split, column, data))
    return panels


def _select_panels(panels: _Panels, metrics: Sequence[str] | None, run_dirs: Sequence[str]) -> _Panels:
    """The panels asked for by ``metrics``, in that order (all when None); errors when there is nothing to draw."""
    if metrics is not None:
        wanted = list(dict.fromkeys(_panel_and_split(m)[0] for m in metrics))
        missing = [m for m in wanted if m not in panels]
        if missing:
            raise ValueError(f"No metric {', '.join(map(repr, missing))} in {', '.join(run_dirs)}; "
                             f"logged: {', '.join(sorted(panels)) or 'none'}.")
        panels = {m: panels[m] for m in wanted}
    if not panels:
        raise ValueError(f"Nothing to plot: {', '.join(run_dirs)} logged no metrics yet.")
    return panels


def _draw_panel(ax: Any, panel: str, entries: list[tuple[int, str, str, tuple]], names: Sequence[str],
                colors: Sequence[Any], *, several_runs: bool, locator: type) -> None:
    """Draw one panel's lines (train solid, val dashed, test a star) with its title, grid and legend."""
    for index, split, column, (steps, values) in sorted(entries, key=lambda e: (e[0], _split_order(e[1]))):
        style, width, alpha, marker = _STYLE.get(split, _STYLE[""])
        label = names[index] if not split else (f"{names[index]} {split}" if several_runs else split)
        if split == "test" or len(steps) == 1:
            style, marker = "", marker or "o"
        # several runs: one colour per run; one run: one colour per split (train and its steps alike)
        colour = index if several_runs else ("train", "val", "test", "").index(split.split(" ")[0])
        ax.plot(steps, values, linestyle=style or "none", linewidth=width, alpha=alpha, marker=marker,
                markersize=4 if split != "test" else 9, color=colors[colour % len(colors)], label=label)
    ax.set_title(panel)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(locator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _image_format(out_path: str | os.PathLike, supported: dict[str, str]) -> str:
    """The format ``out_path``'s suffix names (``"svg"`` for ``curves.svg``), one of matplotlib's
    ``supported`` ones; else a ``ValueError`` listing them (checked before anything is drawn)."""
    suffix = os.path.splitext(os.fspath(out_path))[1].lstrip(".").lower()
    if suffix in supported:
        return suffix
    named = f"its suffix .{suffix} is not an image format matplotlib writes" if suffix else "it has no suffix"
    raise ValueError(f"plot_runs writes the image format the file's suffix names, and {os.fspath(out_path)!r}: "
                     f"{named}. Name the file with one of {', '.join('.' + name for name in sorted(supported))} "
                     f"(e.g. curves.png, curves.svg, curves.pdf).")


def _save(fig: Any, out_path: str | os.PathLike, image_format: str, dpi: int) -> str:
    """Write ``fig`` to ``out_path`` in ``image_format`` (its folder created) and return the path."""
    out_path = os.fspath(out_path)
    if os.path.dirname(out_path):
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
    fig.savefig(out_path, format=image_format, dpi=dpi)
    return out_path


def _color_cycle() -> list[dict]:
    from matplotlib import rcParams

    return list(rcParams["axes.prop_cycle"])


def _split_order(split: str) -> int:
    return ("train (step)", "train", "val", "test", "").index(split) if split in _STYLE else 9


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flaxlight.plot RUN_DIR [RUN_DIR ...] [-o out.png|out.svg|out.pdf] [--metrics loss acc]``."""
    parser = argparse.ArgumentParser(
        prog="python -m flaxlight.plot",
        description="Draw learning curves from runs' metrics.csv: one panel per metric, train and val "
                    "together, several runs overlaid.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's log dir (with metrics.csv)")
    parser.add_argument("-o", "--output", default="learning_curves.png",
                        help="the image to write, in the format its suffix names: .png, .svg, .pdf, ... "
                             "(default: %(default)s)")
    parser.add_argument("--metrics", nargs="+", default=None, help="panels to draw, e.g. loss acc (default: all)")
    parser.add_argument("--no-step", action="store_true", help="leave out the per-step train values")
    args = parser.parse_args(argv)
    try:
        path = plot_runs(args.run_dirs, args.output, args.metrics, include_step=not args.no_step)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
