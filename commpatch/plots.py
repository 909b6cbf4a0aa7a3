"""Deprecated alias (one release): now ``commpatch.render.plots``."""

from .render.plots import *  # noqa: F401,F403
