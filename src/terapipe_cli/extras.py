"""Optional packages: imported only by the commands that need them, each named with the pip line that installs it.

    transformers, safetensors   terapipe export --format hf          pip install 'terapipe-cli[hf]'
    tensorboard                 terapipe train --log tensorboard     pip install 'terapipe-cli[tensorboard]'
    tokenizers                  terapipe data tokenize               pip install 'terapipe-cli[data]'
    pyarrow                     terapipe data tokenize of Parquet    pip install pyarrow
    tiktoken                    terapipe sample on a GPT-2 BPE run   pip install tiktoken

In a checkout an extra installs as ``pip install -e '.[data]'``. The set-up (``scripts/setup.sh``: ``pip install -e
'.[test]'``) installs the first three extras and pyarrow; tiktoken is needed only to read the GPT-2 BPE token files
that nanoGPT-style preparation writes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from terapipe_cli.errors import UserError

# Module -> what installs it.
INSTALL = {
    "transformers": "pip install 'terapipe-cli[hf]' (in a checkout: pip install -e '.[hf]')",
    "safetensors": "pip install 'terapipe-cli[hf]' (in a checkout: pip install -e '.[hf]')",
    "tensorboard": "pip install 'terapipe-cli[tensorboard]' (in a checkout: pip install -e '.[tensorboard]')",
    "tokenizers": "pip install 'terapipe-cli[data]' (in a checkout: pip install -e '.[data]')",
    "pyarrow": "pip install pyarrow",
    "tiktoken": "pip install tiktoken",
}


def require(module: str, *, where: str) -> ModuleType:
    """``import module``, or one line (`UserError`, exit 2) naming the package and the pip line that installs it."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"needs the optional package {package!r}: {INSTALL[package]}", where=where) from None
