"""What a user or packager of the project finds around the code: the version (``commpatch --version``,
``python -m commpatch --version``, the changelog's entry for it), the LICENSE matching the package
metadata, the metadata in pyproject.toml alone (setup.py only builds the C extension and ships the .pth)."""

import os
import subprocess
import sys

import pytest

import commpatch
from commpatch import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"commpatch {commpatch.__version__}"


def test_python_m_commpatch_version():
    res = subprocess.run([sys.executable, "-m", "commpatch", "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"commpatch {commpatch.__version__}"
    assert res.stderr == ""


def test_version_is_a_release_in_the_changelog():
    changelog = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    assert f"## {commpatch.__version__} " in changelog, "CHANGELOG.md has no section for this version"


def _project() -> dict:
    """pyproject.toml's [project] table (PEP 621 metadata)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        pytest.skip("tomllib is Python 3.11+")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_license_file_matches_the_metadata():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    project = _project()
    assert project["license"] == "BSD-3-Clause" and project["license-files"] == ["LICENSE"]
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_metadata_is_in_pyproject_and_setup_py_only_adds_the_extension_and_the_hook():
    project = _project()
    assert project["dynamic"] == ["version"] and project["requires-python"] == ">=3.9"
    assert project["scripts"] == {"commpatch": "commpatch.cli:main"}
    assert {"test", "docs", "lint", "arrow", "scale"} <= set(project["optional-dependencies"])
    assert not os.path.exists(os.path.join(ROOT, "setup.cfg"))
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    assert "ext_modules" in setup_py and "build_py" in setup_py and "install_requires" not in setup_py
