"""The documentation builds: Sphinx over docs/ (the Markdown pages through MyST, the API reference
generated from every public module's docstrings) with warnings as errors and every cross-reference
checked (``-W -n --keep-going``), so a broken reference or a malformed docstring fails CI.
"""
import os
import pkgutil
import re
import subprocess
import sys
import time

import pytest

from mpirun import MPI_ENV, ROOT

pytest.importorskip("sphinx", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs extra is not installed: pip install -e '.[docs]'")



def public_modules():
    """Every module of the package whose dotted name has no ``_private`` part."""
    import hvdcomp

    names = ["hvdcomp"]
    for info in pkgutil.walk_packages(hvdcomp.__path__, "hvdcomp."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return names


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    warnings = out / "warnings.txt"
    env = {**os.environ, **MPI_ENV, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html",
           "-d", str(out / "doctrees"), "-w", str(warnings), os.path.join(ROOT, "docs"), str(out / "html")]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    seconds = time.monotonic() - start
    print(f"docs build: {seconds:.1f} s")
    text = warnings.read_text() if warnings.exists() else ""
    # one warning per entry: a line that names a location and a level (a table's text follows on
    # the lines after its first)
    found = [line for line in text.splitlines() if re.search(r": (WARNING|ERROR|CRITICAL|SEVERE): ", line)]
    return proc, found, out / "html", seconds


def test_docs_build_with_warnings_as_errors(build):
    proc, found, _, _ = build
    assert not found, "\n".join(found) + "\n\n" + proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_every_page_and_public_module_is_in_the_html(build):
    _, _, html, _ = build
    for page in ("index", "install", "quickstart", "methods", "modes", "transports", "architecture",
                 "adding-a-method", "troubleshooting", "results", "api"):
        assert (html / f"{page}.html").is_file(), page
    missing = [m for m in public_modules() if not (html / "api" / f"{m}.html").is_file()]
    assert not missing, missing
    # a documented class of each front-end, and a private name left out
    optimizer = (html / "api" / "hvdcomp.optimizer.html").read_text()
    assert 'id="hvdcomp.optimizer.DistributedOptimizer"' in optimizer
    assert 'id="hvdcomp.ddp.hook.register"' in (html / "api" / "hvdcomp.ddp.hook.html").read_text()
    assert "_DistributedOptimizer" not in optimizer
