"""Only here to ship commpatch.pth at the top of site-packages (coverage.py's way):
setuptools has no declarative option for that. Everything else is in setup.cfg.
Editable installs (pip install -e .) do not run build_py: use `commpatch install-hook`."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commpatch", "commpatch.pth")
        self.copy_file(src, os.path.join(self.build_lib, "commpatch.pth"), preserve_mode=0)


setup(cmdclass={"build_py": build_py_with_pth})
