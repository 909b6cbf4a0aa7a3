"""Deprecated alias (one release): now ``commpatch.render.text``."""

from .render.text import *  # noqa: F401,F403
