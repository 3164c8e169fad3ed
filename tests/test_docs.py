"""The documentation's code runs: every fenced python block marked ``<!-- runnable ... -->`` in the
README and docs/ is executed, the blocks of one page in order in one namespace (a later block
may use what an earlier one defined), in a fresh working directory."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- runnable\b.*-->\s*$")


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line number, code)`` of each python block whose fence follows a runnable mark."""
    lines, blocks = page.read_text().splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() == "```python" and i > 0 and MARK.match(lines[i - 1].strip()):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append((i + 2, "\n".join(lines[i + 1:end])))
    return blocks


PAGES_WITH_CODE = [page for page in PAGES if runnable_blocks(page)]


def test_the_readme_and_the_model_guide_have_runnable_blocks():
    names = {page.name for page in PAGES_WITH_CODE}
    assert {"README.md", "models.md"} <= names, names


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: page.name)
def test_runnable_doc_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")  # plain progress lines
    # The page's code is a module, as a user's script is (hparams.yaml names classes by module).
    module = types.ModuleType(f"docs_{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    for line, code in runnable_blocks(page):
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"The code block at {page.relative_to(ROOT)}:{line} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    assert os.listdir(tmp_path), "the blocks ran without writing a run folder"


def test_the_api_reference_names_every_public_symbol():
    """docs/api/*.md (the site's API pages, built by ``make docs``) document every exported name."""
    import flaxlight
    import flaxlight.callbacks
    import flaxlight.loggers
    import flaxlight.metric_objects

    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))
    listed = set(re.findall(r"::: flaxlight\.(\w+)", pages))
    members = set(re.findall(r"members: \[([^\]]*)\]", pages, re.S))
    listed |= {name.strip() for block in members for name in block.split(",")}
    whole_modules = {"loggers", "metric_objects", "tune"}  # pages that render a module's whole __all__
    missing = [name for name in flaxlight.__all__ if name not in listed and name not in {"__version__", "callbacks",
                                                                                        "loggers"}]
    missing += [name for name in flaxlight.callbacks.__all__ if name not in listed]
    assert not missing, f"not in docs/api/*.md: {missing}"
    assert whole_modules <= listed


QUIET_FIRST = """
import logging
{set_level}
import flaxlight
from flaxlight.messages import logger
logger.info("an information")
logger.warning("a warning")
print(logging.getLevelName(logger.level))
"""


@pytest.mark.parametrize("set_level, level, informs", [
    ('logging.getLogger("flaxlight").setLevel(logging.WARNING)', "WARNING", False),
    ("", "INFO", True),  # flaxlight's default: its information is shown
])
def test_setting_the_flaxlight_loggers_level_before_the_import_is_kept(set_level, level, informs):
    """docs/logging.md: ``logging.getLogger("flaxlight").setLevel(logging.WARNING)`` silences
    flaxlight's information. Done at the top of a script, before ``import flaxlight``, the import
    set INFO again. Run in a fresh interpreter: the import must happen here for the first time."""
    import flaxlight

    source = str(Path(flaxlight.__file__).resolve().parents[1])  # this flaxlight, not another installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", QUIET_FIRST.format(set_level=set_level)], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [level]
    assert "a warning" in result.stderr
    assert ("an information" in result.stderr) == informs, result.stderr
