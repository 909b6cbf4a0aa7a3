"""What a user or packager of the project finds around the code: the version (``commpatch --version``,
``python -m commpatch --version``, the changelog's entry for it), the LICENSE matching the package
metadata."""

import configparser
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
    res = subprocess.run([sys.executable, "-m", "commpatch", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"commpatch {commpatch.__version__}"
    assert res.stderr == ""


def test_version_is_a_release_in_the_changelog():
    changelog = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    assert f"## {commpatch.__version__} " in changelog, "CHANGELOG.md has no section for this version"


def _metadata() -> dict:
    """The package metadata (pyproject.toml's [project] when it holds it, else setup.cfg's [metadata])."""
    pyproject = os.path.join(ROOT, "pyproject.toml")
    try:
        import tomllib
    except ImportError:                      # Python < 3.11
        tomllib = None
    if tomllib is not None:
        with open(pyproject, "rb") as f:
            project = tomllib.load(f).get("project")
        if project:
            license = project.get("license")
            return {"license": license if isinstance(license, str) else (license or {}).get("text", ""),
                    "license_files": project.get("license-files", [])}
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return {"license": cfg["metadata"]["license"], "license_files": []}


def test_license_file_matches_the_metadata():
    text = open(os.path.join(ROOT, "LICENSE")).read()
    meta = _metadata()
    assert meta["license"] == "BSD-3-Clause"
    assert text.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder nor the names of its" in text
