"""The architecture, enforced: every module under commpatch/ is parsed with ``ast``; the import
graph between commpatch's own modules (function-level imports included) has no cycle, and every
import follows the layer order below. Imports are at the top of a module, except function-level
imports of third-party packages (torch, numpy, pandas, pyarrow, matplotlib, ...) and the lazy
imports listed in LAZY, each marked on its line with a ``# lazy: <reason>`` comment.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "commpatch")

# layer of a module: the first matching prefix wins
LAYER_OF = (
    ("commpatch.data", "data"),
    ("commpatch._version", "data"),  # a constant: imports nothing
    ("commpatch.config", "config"),
    ("commpatch.record", "record"),
    ("commpatch.patch", "patch"),
    ("commpatch.integrations", "integrations"),
    ("commpatch.watchdog", "watchdog"),
    ("commpatch.metrics", "metrics"),
    ("commpatch.io", "io"),
    ("commpatch.analysis", "analysis"),
    ("commpatch.render", "render"),
    ("commpatch.testing", "tools"),
    ("commpatch.session", "session"),
    ("commpatch.offline", "offline"),
    ("commpatch.cli", "cli"),
    ("commpatch.watch", "watch"),
    ("commpatch.__main__", "cli"),
    ("commpatch._bootstrap", "entry"),
    ("commpatch._boot", "entry"),
    ("commpatch", "entry"),
)

# what each layer may import (besides itself)
MAY_IMPORT = {
    "data": set(),
    "config": {"data"},
    "record": {"data"},
    "patch": {"data", "record"},
    "integrations": {"data", "record", "patch"},
    "io": {"data", "config"},
    "analysis": {"data"},
    "render": {"data", "analysis"},
    "watchdog": {"data", "record", "io"},
    "metrics": {"data", "io", "analysis"},  # live Prometheus metrics: fed by the session's flusher
    "tools": {"data", "io", "analysis"},
    "session": {"data", "config", "record", "patch", "integrations", "watchdog", "metrics", "io", "analysis", "render"},
    "offline": {"data", "config", "io", "analysis", "render"},  # commpatch.open: the Run
    "watch": {"data", "io", "analysis", "render"},  # `commpatch watch`: the live view of a running job
    "cli": {"data", "config", "io", "offline", "watch"},  # io: `commpatch run` checks its output (check_writable)
    "entry": {"config", "session", "offline", "io", "data"},
}
OFFLINE = {"data", "io", "analysis", "render", "offline", "watch"}
RUNTIME = {"record", "patch", "integrations", "watchdog", "metrics", "session"}

# (importing module, imported module): the function-level imports of commpatch modules allowed,
# each with a '# lazy: <reason>' comment on its line
LAZY = {
    ("commpatch", "commpatch.session"),  # import commpatch must cost (almost) nothing
    ("commpatch", "commpatch.config"),
    ("commpatch", "commpatch.io.reader"),
    ("commpatch", "commpatch.data.schema"),
    ("commpatch", "commpatch.offline"),
    ("commpatch._bootstrap", "commpatch.config"),  # imported in every process with COMMPATCH set
    ("commpatch._bootstrap", "commpatch.session"),
    ("commpatch.cli", "commpatch.offline"),  # `commpatch run` / `env` never load numpy or pandas
    ("commpatch.cli", "commpatch.io.paths"),
    ("commpatch.cli", "commpatch.watch"),  # `commpatch watch` alone loads rich
}


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py under commpatch/."""
    out = {}
    root = os.path.dirname(PACKAGE)
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].endswith("__init__.py")


def _resolve(module: str, node) -> list[str]:
    """The commpatch modules an import statement names (submodules when they exist)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [_known(n) for n in names if n == "commpatch" or n.startswith("commpatch.")]
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
        if not (target == "commpatch" or target.startswith("commpatch.")):
            return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else _known(target))
    return out


def _known(name: str) -> str:
    while name not in MODULES:
        name = name.rsplit(".", 1)[0]
    return name


def _layer(module: str) -> str:
    for prefix, layer in LAYER_OF:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module}: in no layer (add it to LAYER_OF)")


def _imports():
    """(module, imported, line, function-level, source line) for every import of a commpatch module."""
    for module, path in sorted(MODULES.items()):
        with open(path, encoding="utf-8") as f:
            source = f.read()
        lines = source.splitlines()
        tree = ast.parse(source, path)
        nested = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(module, node):
                    if target != module:
                        yield module, target, node.lineno, id(node) in nested, lines[node.lineno - 1]


IMPORTS = list(_imports())


def test_every_module_is_in_a_layer():
    for module in MODULES:
        assert _layer(module) in MAY_IMPORT


def test_no_import_cycle():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, target, *_ in IMPORTS:
        graph[module].add(target)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_imports_follow_the_layers():
    bad = []
    for module, target, line, _, _ in IMPORTS:
        a, b = _layer(module), _layer(target)
        if a != b and b not in MAY_IMPORT[a]:
            bad.append(f"{module}:{line} ({a}) imports {target} ({b})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_offline_side_never_imports_the_runtime_side():
    for layer in OFFLINE:
        assert not MAY_IMPORT[layer] & RUNTIME, layer
    for module, target, line, _, _ in IMPORTS:
        if _layer(module) in OFFLINE:
            assert _layer(target) not in RUNTIME, f"{module}:{line} imports {target}"


def test_function_level_imports_are_third_party_or_listed_and_explained():
    bad = []
    used = set()
    for module, target, line, nested, text in IMPORTS:
        if not nested:
            continue
        used.add((module, target))
        if (module, target) not in LAZY:
            bad.append(f"{module}:{line}: function-level import of {target} (move it to the top, or list it in LAZY)")
        elif "# lazy:" not in text:
            bad.append(f"{module}:{line}: a lazy import of {target} needs a '# lazy: <reason>' comment")
    assert not bad, "\n".join(bad)
    assert not LAZY - used, f"LAZY lists imports that no longer exist: {sorted(LAZY - used)}"


def test_the_data_layer_imports_no_torch_at_module_level():
    for module, path in MODULES.items():
        if _layer(module) not in ("data", "config", "entry") or module == "commpatch._boot.sitecustomize":
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            heavy = [n for n in names if n.split(".")[0] in ("torch", "pandas", "pyarrow", "matplotlib", "numpy")]
            assert not heavy, f"{module} imports {heavy} at module level"


def test_each_io_module_has_one_job_said_in_its_docstring_and_stays_small():
    """The io layer is split by role (paths, writer, discovery, formats, csvlog, validation,
    problems, reader, ...): each module says its job in a docstring and stays under ~450 lines."""
    for module, path in MODULES.items():
        if not module.startswith("commpatch.io"):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        assert ast.get_docstring(ast.parse(source, path)), f"{module}: no docstring saying its job"
        lines = source.count("\n")
        assert lines <= 450, f"{module}: {lines} lines; split it by role"


def test_the_reader_stays_the_entry_point_of_reading():
    """Users and the package import reading from ``commpatch.io.reader``: whatever module a name
    moves to, it stays importable from there."""
    from commpatch.io import reader

    names = (
        "read",
        "read_ranks",
        "RUN_ATTR",
        "LogFileError",
        "LogFileNotFoundError",
        "LogFileWarning",
        "expand",
        "file_rank",
        "partition_rank",
        "PARTITION",
        "runs",
        "run_started",
        "latest_run",
        "one_run",
        "chosen_run",
    )
    missing = [n for n in names if not hasattr(reader, n)]
    assert not missing, f"commpatch.io.reader lost {missing}"
    assert set(names) <= set(reader.__all__)
