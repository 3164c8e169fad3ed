"""``plot_runs`` / ``flaxlight plot -o FILE`` write the image format the file's suffix names."""

import pytest

pytest.importorskip("matplotlib")

from flaxlight import cli  # noqa: E402
from flaxlight.loggers import CSVLogger  # noqa: E402
from flaxlight.plot import plot_runs  # noqa: E402


def _run(run_dir):
    logger = CSVLogger(run_dir)
    for epoch in range(1, 4):
        logger.log_metrics({"train/loss": 1.0 / epoch, "epoch": epoch}, 10 * epoch)
        logger.log_metrics({"val/loss": 1.2 / epoch, "epoch": epoch}, 10 * epoch)
    logger.finalize("success")
    return run_dir


@pytest.mark.parametrize("name, start", [("curves.svg", b"<?xml"), ("curves.pdf", b"%PDF"), ("curves.PNG", b"\x89PNG"),
                                         ("curves.jpg", b"\xff\xd8\xff")])
def test_the_suffix_names_the_format_written(tmp_path, name, start):
    """curves.svg and curves.pdf held PNG bytes, which browsers, LaTeX and pdfinfo reject."""
    out = plot_runs(_run(tmp_path / "run"), tmp_path / name)
    with open(out, "rb") as f:
        assert f.read(16).startswith(start)
    if name.endswith(".svg"):
        assert "<svg" in (tmp_path / name).read_text()


@pytest.mark.parametrize("name, said", [("curves.txt", "its suffix .txt is not an image format matplotlib writes"),
                                        ("curves", "it has no suffix")])
def test_a_suffix_that_names_no_image_format_is_refused_before_anything_is_written(tmp_path, name, said):
    with pytest.raises(ValueError, match=rf"{said}\. Name the file with one of .*\.pdf, .*\.png, .*\.svg"):
        plot_runs(_run(tmp_path / "run"), tmp_path / "out" / name)
    assert not (tmp_path / "out").exists()


def test_flaxlight_plot_writes_svg_and_refuses_an_unknown_suffix(tmp_path, capsys):
    run = _run(tmp_path / "run")
    assert cli.main(["plot", str(run), "-o", str(tmp_path / "cli.svg")]) == 0
    assert (tmp_path / "cli.svg").read_bytes().startswith(b"<?xml")
    capsys.readouterr()
    assert cli.main(["plot", str(run), "-o", str(tmp_path / "cli.svgg")]) == 2
    err = capsys.readouterr().err
    assert "its suffix .svgg is not an image format" in err and "Traceback" not in err
    assert not (tmp_path / "cli.svgg").exists()
