"""Only here for what pyproject.toml cannot declare: shipping commpatch.pth at the top of
site-packages (coverage.py's way; editable installs do not run build_py: use `commpatch
install-hook`), and the optional C row writer of the hot path (commpatch/record/_hot.c, like
coverage.py's CTracer: when it cannot be compiled the install goes on and the pure-Python path is
used). Everything else (metadata, dependencies, extras, entry point, package data) is in
pyproject.toml."""

import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "commpatch", "commpatch.pth")
        self.copy_file(src, os.path.join(self.build_lib, "commpatch.pth"), preserve_mode=0)


setup(
    cmdclass={"build_py": build_py_with_pth},
    ext_modules=[Extension("commpatch.record._hot", ["commpatch/record/_hot.c"], optional=True)],
)
