"""The examples in the package's docstrings run and print what they show (a public symbol's
example is its shortest documentation: one that no longer holds misleads)."""

import doctest
import importlib
import pkgutil

import pytest

import flaxlight

MODULES = sorted(info.name for info in pkgutil.walk_packages(flaxlight.__path__, "flaxlight.")
                 if not info.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_of_each_module_hold(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} fail (run " \
                               f"python -m doctest -o ELLIPSIS on its file to see which)"


def test_every_module_is_seen():
    assert {"flaxlight.trainer", "flaxlight.data", "flaxlight.callbacks.model_checkpoint"} <= set(MODULES)
