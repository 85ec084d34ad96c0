"""terapipe's version, as every file it writes records it; the installed package's metadata reads it from here
(pyproject.toml)."""

__version__ = "0.1.0"
