"""Model configurations: TOML files under ``configs/models/`` loaded into a validated dataclass.

[model]
name = "tiny"
layers = 4        # decoder layers N
hidden = 256      # H
heads = 4
vocab = 256
seq_len = 1024    # L
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.files import Fields, read_user_text


@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params_per_layer(self, tensor_parallel: int = 1, *, bias: bool = True) -> int:
        """Parameters of one decoder layer held by one device, with ``tensor_parallel`` ranks sharing the layer.

        Sharded: the Q/K/V and output projections and both MLP matrices (with their biases when ``bias``, as
        in GPT-3; the runtime's own model has none, as in nanoGPT). Replicated: the two layer norms (weight and
        bias) and the biases of the two row-parallel outputs.
        """
        H, t, inner = self.hidden, tensor_parallel, self.mlp_ratio * self.hidden
        sharded = 3 * H * H + H * H + H * inner + inner * H
        replicated = 4 * H
        if bias:
            sharded += 3 * H + inner
            replicated += 2 * H
        return sharded // t + replicated

    def check_tensor_parallel(self, tensor_parallel: int, where: str = "tensor_parallel") -> None:
        """T ranks split the heads and the MLP's inner dimension (docs/design.md §6b): T must divide both."""
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise UserError(f"must be a positive integer, got {t!r}", where=where)
        if self.heads % t:
            raise UserError(f"{t} does not divide the {self.heads} heads of model '{self.name}'", where=where)
        inner = self.mlp_ratio * self.hidden
        if inner % t:
            raise UserError(f"{t} does not divide the MLP's {inner} inner features of model '{self.name}'", where=where)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict, where: str, prefix: str = "model.") -> ModelConfig:
        """Build and validate from a mapping (a TOML table or a JSON object); errors name ``where``."""
        f = Fields(obj, where, prefix)
        cfg = cls(
            name=f.str("name"),
            layers=f.int("layers", minimum=1),
            hidden=f.int("hidden", minimum=1),
            heads=f.int("heads", minimum=1),
            vocab=f.int("vocab", minimum=2),
            seq_len=f.int("seq_len", minimum=1),
            mlp_ratio=f.int("mlp_ratio", minimum=1, default=4),
        )
        if cfg.hidden % cfg.heads:
            raise f.fail("heads", f"must divide hidden ({cfg.hidden}), got {cfg.heads}")
        known = {"name", "layers", "hidden", "heads", "vocab", "seq_len", "mlp_ratio"}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise f.fail(unknown[0], "is not a model setting (known: " + ", ".join(sorted(known)) + ")")
        return cfg

    def stage_layers(self, stages: int, where: str = "stages") -> int:
        """Layers per stage; the layer count must divide evenly (docs/design.md §6)."""
        if stages < 1:
            raise UserError(f"must be at least 1, got {stages}", where=where)
        if self.layers % stages:
            raise UserError(
                f"{stages} stages do not divide the {self.layers} layers of model '{self.name}'", where=where
            )
        return self.layers // stages


BUNDLED_KINDS = ("models", "hardware", "experiments")


def bundled_names(kind: str) -> list[str]:
    """The names of the configs of ``kind`` shipped with the package (``--model tiny``, ``--hardware h100``)."""
    folder = resources.files("terapipe_cli") / "configs" / kind
    return sorted(e.name.removesuffix(".toml") for e in folder.iterdir() if e.name.endswith(".toml"))


def bundled_config_summaries(kind: str) -> list[tuple[str, str]]:
    """(name, the file's first comment line) of each bundled config of ``kind``."""
    folder = resources.files("terapipe_cli") / "configs" / kind
    rows = []
    for name in bundled_names(kind):
        first = (folder / f"{name}.toml").read_text().splitlines()[:1]
        rows.append((name, first[0].lstrip("# ").strip() if first and first[0].startswith("#") else ""))
    return rows


def find_config(name_or_path: str | Path, kind: str, flag: str, *, prefix: bool = False) -> Path:
    """A config the user named: a file path as given, or the name of a bundled one (from any folder).

    A path that exists wins; a bare name (no folder, no suffix) is looked up among the package's configs of
    ``kind``; with ``prefix``, a bare name may also be the start of exactly one bundled name (``paper-04`` for
    ``paper-04-gpt3-13b``). Anything else is a one-line error that lists the bundled names (or the matches).
    """
    path = Path(name_or_path)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path  # the reader reports a missing or unreadable file in one line
    folder = resources.files("terapipe_cli") / "configs" / kind
    bundled = folder / f"{path.name}.toml"
    if bundled.is_file():
        return Path(str(bundled))
    names = bundled_names(kind)
    matches = [n for n in names if n.startswith(path.name)] if prefix else []
    if len(matches) == 1:
        return Path(str(folder / f"{matches[0]}.toml"))
    if matches:
        message = f"{str(path)!r} is the start of {len(matches)} bundled {kind} configs: {', '.join(matches)}"
    else:
        message = f"no file {str(path)!r} here and no bundled {kind} config of that name (bundled: {', '.join(names)})"
    raise UserError(message, where=flag)


def load_toml(path: str | Path, what: str = "config") -> dict:
    """Parse a TOML file the user named (one-line `UserError` naming it when it is missing or malformed)."""
    path = Path(path)
    text = read_user_text(path, name=f"{what} file", expected=f"a {what} TOML file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"malformed TOML: {e}", where=str(path)) from None


def load_model_config(path: str | Path) -> ModelConfig:
    """Load ``[model]`` from a TOML file, or a bundled model by name (``tiny``, ``gpt3-13b``; `find_config`)."""
    path = find_config(path, "models", "--model")
    data = load_toml(path, "model config")
    table = data.get("model")
    if not isinstance(table, dict):
        raise UserError("missing the [model] table", where=str(path))
    return ModelConfig.from_dict(table, str(path))
