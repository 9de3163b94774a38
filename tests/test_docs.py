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

#: TEMPORARY: warnings in files other work was changing when the docs build arrived. Each entry is
#: (path relative to the repository, regular expression of the message). They are excluded here,
#: and only these; the test fails once one no longer occurs, so that the list gets emptied as they
#: are fixed. Empty it, and delete it, when they are all fixed.
TEMPORARY_EXCLUSIONS = [
    ("hvdcomp/adaptive_opt/onebit_lamb.py", r"OneBitLamb:22: WARNING: Field list ends without a blank line"),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:15: WARNING: py:meth reference target not found: open "),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:16: WARNING: py:meth reference target not found: agree "),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:17: WARNING: py:meth reference target not found: skip "),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:18: WARNING: py:meth reference target not found: reduced "),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:19: WARNING: py:meth reference target not found: apply "),
    ("hvdcomp/ddp/cycle.py", r"hvdcomp\.ddp\.cycle:20: WARNING: py:meth reference target not found: discard "),
    ("docs/robustness.md", r"robustness\.md:3: WARNING: 'myst' cross-reference target not found: 'docs/numerics\.md'"),
]


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
    excluded = [(path, pattern) for path, pattern in TEMPORARY_EXCLUSIONS]
    unexpected = [w for w in found
                  if not any(path in w and re.search(pattern, w) for path, pattern in excluded)]
    assert not unexpected, "\n".join(unexpected) + "\n\n" + proc.stdout[-3000:]
    stale = [(path, pattern) for path, pattern in excluded
             if not any(path in w and re.search(pattern, w) for w in found)]
    assert not stale, f"fixed, so take them out of TEMPORARY_EXCLUSIONS: {stale}"
    assert proc.returncode == (1 if found else 0), proc.stdout[-3000:]


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
