"""Deprecated alias (one release): the file functions now live in ``commpatch.io``."""

from .io import *  # noqa: F401,F403
from .io import __all__  # noqa: F401
