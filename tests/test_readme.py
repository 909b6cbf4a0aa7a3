"""README.md stays true: both set-up commands first, every column and every setting documented."""

import os
import re

from commpatch.config import SETTINGS
from commpatch.data.schema import SCHEMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def test_first_lines_are_the_two_commands_and_the_makefile_has_them():
    first = [line.strip() for line in README.splitlines()[1:6] if line.strip()]
    assert first[0].startswith("make demo") and first[1].startswith("make test")
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()


def test_every_column_is_in_the_reference():
    for col in SCHEMA:
        assert f"| `{col.name}` | {col.dtype} |" in README, f"column {col.name} missing from README"


def test_every_setting_is_documented():
    for setting in SETTINGS:
        assert f"| `{setting.env}` |" in README, f"{setting.env} missing from README"


def test_no_placeholder_left():
    for placeholder in ("PERFORMANCE_TABLE", "COLUMN_TABLE", "DDP_FIGURE"):
        assert placeholder not in README
