"""README.md stays true and short: both set-up commands first, the support table is what the
integrations and CI cells say. (The column and setting references moved to the docs site, generated
from the code: tests/test_docs.py checks them.)"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_first_lines_are_the_two_commands_and_the_makefile_has_them():
    first = [line.strip() for line in README.splitlines()[1:6] if line.strip()]
    assert first[0].startswith("make demo") and first[1].startswith("make test")
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_readme_is_for_users_and_short():
    assert len(README.splitlines()) <= 200
    for page in re.findall(r"\]\((docs/[^)#]+)", README):
        assert os.path.exists(os.path.join(ROOT, page)), f"README links to {page}, which does not exist"


def test_no_placeholder_left():
    for placeholder in ("PERFORMANCE_TABLE", "COLUMN_TABLE", "DDP_FIGURE"):
        assert placeholder not in README


def _support_table() -> list[dict]:
    """The rows of README's support table, as {column: cell}."""
    lines = README[README.index("### Supported torch and Python") :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| torch |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def test_support_table_row_of_this_torch_is_what_the_integrations_say():
    """Each CI cell checks its own row: every integration's status on the installed torch (the
    names it relies on, resolved) is the one the README states; a torch CI does not run fails."""
    import sys

    import torch
    import torch._dynamo  # noqa: F401 - as `commpatch env` does: functorch's internals import after it

    from commpatch import integrations
    from commpatch.integrations import base

    version = torch.__version__.split("+")[0]
    rows = {row["torch"]: row for row in _support_table()}
    cell = os.environ.get("CI_MATRIX_CELL")  # set by ci/matrix.sh: a CI cell's torch must have its row
    assert version in rows or not cell, f"cell {cell}: torch {version} is not in README's support table"
    if version not in rows:  # a user's torch: untested here, not broken (every CI cell has its row: the test below)
        pytest.skip(f"torch {version} has no row in README's support table: untested by this project's CI")
    row = rows[version]
    assert row["Python"] == "{}.{}".format(*sys.version_info[:2]), row
    for integration in integrations.ALL:
        assert row[integration.name] == base.status(integration)[0], (integration.name, row)


def test_support_table_rows_are_the_ci_cells_and_the_declared_range():
    rows = _support_table()
    matrix = open(os.path.join(ROOT, "ci", "matrix.sh")).read()
    cells = dict(re.findall(r'\[(\w+)\]="([\d.]+ [\d.]+)"', matrix))  # name -> "python torch"
    for row in rows:
        ci = row["CI"].strip("`")
        if ci == "make test":
            makefile = open(os.path.join(ROOT, "Makefile")).read()
            assert f"torch=={row['torch']}" in makefile
        else:
            name = ci.split()[-1]
            assert cells.get(name) == f"{row['Python']} {row['torch']}", (row, cells)
    assert len(rows) == len(cells) + 1
    ci_run = open(os.path.join(ROOT, ".ci", "run")).read()
    in_ci = re.search(r'^make matrix CELLS="([\w ]+)"', ci_run, re.M)
    assert in_ci and set(in_ci.group(1).split()) == set(cells) | {"pure"}, "CI runs every cell of the table, and pure"
    assert re.search(r"^make test$", ci_run, re.M)
    oldest = min(rows, key=lambda r: tuple(int(x) for x in r["torch"].split(".")))
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    major_minor = ".".join(oldest["torch"].split(".")[:2])
    assert f'"torch>={major_minor}"' in pyproject and f'requires-python = ">={oldest["Python"]}"' in pyproject
    assert f"torch {major_minor} to" in README and f"Python {oldest['Python']} to" in README
