"""Renderers, DataFrame -> text / JSON / files: summary tables and the report (``text``), the
Chrome trace and module tree (``trace``), matplotlib figures (``plots``). Imports ``analysis`` and
``data``; never the runtime side."""
