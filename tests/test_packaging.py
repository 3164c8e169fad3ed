"""The wheel: LICENSE, py.typed, metadata (license, classifiers), the version written once."""

import email
import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flaxlight

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_license_py_typed_and_the_one_version(tmp_path):
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} cannot build with license-files; pyproject asks >= 77")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, cwd=tmp_path, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = tmp_path.glob("flaxlight-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        license_text = archive.read(next(n for n in names if n.endswith("/licenses/LICENSE"))).decode()
    assert "flaxlight/py.typed" in names
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Version"] == flaxlight.__version__ == importlib.metadata.version("flaxlight")
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert f"## [{flaxlight.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
