"""Deprecated alias (one release): now ``commpatch.render.trace``."""

from .render.trace import *  # noqa: F401,F403
