"""terapipe's version, as every file it writes records it (pyproject.toml gives the installed package the same)."""

__version__ = "0.1.0"
