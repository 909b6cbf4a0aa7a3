"""The code stays lint-clean and formatted, and the offline layers type-check (settings in
pyproject.toml; `make lint` runs the same three checks)."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[lint]'; CI installs it with the test extra)")


def test_ruff_check_passes():
    _need("ruff")
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    _need("ruff")
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]


@pytest.mark.slow
def test_mypy_passes_on_the_offline_layers(tmp_path):
    if sys.version_info < (3, 10):
        pytest.skip("the type check runs on Python 3.10+ (mypy 2 does not run on 3.9; older mypy checks differently)")
    _need("mypy")
    res = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
    assert "Success: no issues found" in res.stdout


def _definitions(path: str):
    """The module-level functions, classes and names a module defines (dunders aside)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Assign):
            yield from (t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id


def unused_definitions(package: str, elsewhere: list[str]) -> list[str]:
    """``module: name`` for each module-level definition of ``package`` that nothing uses: named
    once in its own module (its definition) and nowhere in the package's other modules or in the
    files of ``elsewhere`` (tests, benchmarks, docs, the C extension...)."""
    import re

    modules = {}
    for directory, _, files in os.walk(package):
        for name in files:
            if name.endswith((".py", ".c")):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    modules[path] = f.read()
    others = []
    for root in elsewhere:
        paths = [root] if os.path.isfile(root) else [os.path.join(d, n) for d, _, fs in os.walk(root) for n in fs]
        for path in paths:
            if path.endswith((".py", ".md", ".ipynb", ".c", ".sh", ".yml", ".toml", ".cfg")) or "Makefile" in path:
                with open(path, encoding="utf-8", errors="replace") as f:
                    others.append(f.read())
    words: dict[str, int] = {}
    for text in list(modules.values()) + others:
        for word in re.findall(r"\w+", text):
            words[word] = words.get(word, 0) + 1
    out = []
    for path, text in modules.items():
        if not path.endswith(".py"):
            continue
        for name in _definitions(path):
            if name.startswith("__") and name.endswith("__"):
                continue
            if words.get(name, 0) == len(re.findall(rf"\b{re.escape(name)}\b", text)) <= 1:
                out.append(f"{os.path.relpath(path, ROOT)}: {name}")
    return out


def test_no_unused_definition_in_the_package():
    elsewhere = [os.path.join(ROOT, d) for d in ("tests", "benchmarks", "docs", "ci", "notebooks", "examples")]
    elsewhere += [os.path.join(ROOT, f) for f in ("README.md", "Makefile", "pyproject.toml", "setup.py")]
    unused = unused_definitions(os.path.join(ROOT, "commpatch"), [p for p in elsewhere if os.path.exists(p)])
    assert not unused, "defined and used nowhere (remove it, or use it):\n" + "\n".join(unused)


def test_the_unused_definition_check_can_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("def used():\n    return 1\n\n\ndef _dead():\n    return used()\n")
    (package / "b.py").write_text("from .a import used\n\nVALUE = used()\n")
    (tmp_path / "test_b.py").write_text("from pkg.b import VALUE\n")
    found = unused_definitions(str(package), [str(tmp_path / "test_b.py")])
    assert [f.rsplit(": ", 1)[1] for f in found] == ["_dead"]
