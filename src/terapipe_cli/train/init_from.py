"""``terapipe train --init-from SRC``: a new run that starts from pretrained weights instead of the seed's.

SRC is one of three (`open_source` tells them apart):

    a transformers folder   config.json + model.safetensors, or model.safetensors.index.json + its shards
    a terapipe export       model.pt (`export.read_export`'s record)
    a run folder            its newest checkpoint whose files match their manifest, checksums included, read as
                            ``--resume`` reads it (`export.verified_step`, `checkpoint.read_state`)

The launcher checks SRC before anything is written (`check_source`): readable, its model the plan's — the same
architecture, widths, heads, layers, vocabulary and head — with one line naming the first differing field, or the
first tensor missing or of another shape. ``seq_len``, ``rope_theta`` and ``rope_scaling`` may differ on purpose (a
longer context than SRC was trained for), and the run says so in one line (`source_note`). Every worker then copies
its own tensors into its stage (`load_weights`) before the first step, one tensor at a time: a `transformers`
folder's through safetensors' lazy slices (only this tensor rank's rows or columns of a split parameter are read),
an export's and a checkpoint's memory-mapped — so a rank holds its stage's weights and one tensor more, never the
whole model. bf16 and fp16 files become fp32 master weights. The optimizer starts fresh. ``--verify``'s reference
starts from the same weights (`initial_weights`, the one entry both use).

The names of a `transformers` folder are the architecture's table (`Arch.transformers_names`, the inverse of its
``hf_keys``). A ``GPT2LMHeadModel`` with the erf GELU reads as ``gpt`` (how ``gpt`` exports): its linear biases,
which ``gpt`` has not, must be zero (`check_zero_biases`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from terapipe_cli.config.model import model_from_transformers
from terapipe_cli.config.run import RunArguments
from terapipe_cli.errors import UserError
from terapipe_cli.extras import require
from terapipe_cli.files import read_json
from terapipe_cli.models import ModelConfig
from terapipe_cli.plan.file import plan_from_dict
from terapipe_cli.train import checkpoint
from terapipe_cli.train.rundir import read_config

WHERE = "init_from"  # the RunConfig field: the command line names it --init-from
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Model fields a run may set otherwise than SRC: the positions it sees, not the weights it holds.
CONTEXT_FIELDS = ("seq_len", "rope_theta", "rope_scaling")


@dataclass(frozen=True)
class Source:
    """Where a run's first weights come from: ``kind`` ("transformers", "export" or "run"), the path, SRC's model,
    and for a run folder the checkpoint read."""

    kind: str
    path: Path
    model: ModelConfig
    step: int | None = None

    def describe(self) -> str:
        what = {"transformers": "transformers folder", "export": "terapipe export", "run": "run"}[self.kind]
        step = f", the checkpoint of step {self.step}" if self.step is not None else ""
        return f"{what} {self.path}{step}"


def open_source(path: str | Path, step: int | None = None) -> Source:
    """SRC as given (a one-line `UserError` when it is none of the three, or unreadable); a run folder's newest
    verified checkpoint unless ``step`` (the one its launcher chose: the workers read that one)."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise UserError("no such file or folder (a transformers folder, a terapipe export or a run)", where=str(path))
    if path.is_file():
        from terapipe_cli.train.export import exported_model, read_export

        return Source("export", path, exported_model(read_export(path, mmap=True), path))
    config = path / "config.json"
    if not config.is_file():
        raise UserError(
            "is a folder without a config.json: give a transformers folder, a terapipe export or a run", where=str(path)
        )
    if (path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file():
        require("safetensors", where="--init-from")
        return Source("transformers", path, model_from_transformers(path))
    if "plan" not in read_json(config, what="config.json"):
        raise UserError(f"holds a config.json but neither {SAFETENSORS} nor a run's checkpoints", where=str(path))
    from terapipe_cli.train.export import verified_step

    cfg, _ = read_config(path)
    model = plan_from_dict(cfg["plan"], f"{config}: field 'plan'").model
    return Source("run", path, model, verified_step(path, None) if step is None else step)


def check_source(source: Source, model: ModelConfig) -> str:
    """SRC's model against the plan's (the first differing field in one line), every tensor of the plan's model in
    SRC with its shape (the first that is not, in one line), a ``gpt`` model's biases zero; returns the line the run
    prints at start (`source_note`)."""
    ours, theirs = {"arch": model.arch, **model.to_dict()}, {"arch": source.model.arch, **source.model.to_dict()}
    for key in {**ours, **theirs}:
        if key in ("name", *CONTEXT_FIELDS) or ours.get(key) == theirs.get(key):
            continue
        raise UserError(
            f"{source.describe()} holds another model: its field 'model.{key}' is {theirs.get(key)!r}, the plan's "
            f"{ours.get(key)!r} (a run starts from the weights of its own model only)",
            where=WHERE,
        )
    if model.spec.learned_positions and model.seq_len > source.model.seq_len:
        raise UserError(
            f"{source.describe()} learned {source.model.seq_len} positions; the plan's seq_len {model.seq_len} needs "
            f"more (arch {model.arch} has a position table)",
            where=WHERE,
        )
    reader = _Reader(source)
    for name, shape in model.spec.tensor_shapes(model).items():
        found = reader.shape(name)
        if found is None:
            raise UserError(f"{source.describe()} has no tensor {reader.stored_name(name)!r}", where=WHERE)
        if name == "wpe.weight":
            found = (min(found[0], shape[0]), *found[1:])  # the first seq_len rows (checked above)
        if tuple(found) != tuple(shape):
            raise UserError(
                f"{source.describe()}: tensor {reader.stored_name(name)!r} has the shape {tuple(found)}, the "
                f"plan's model needs {tuple(shape)}",
                where=WHERE,
            )
    check_zero_biases(reader, model, range(model.layers))
    return source_note(source, model)


def source_note(source: Source, model: ModelConfig) -> str:
    """One line: where the weights come from and, where the plan's context differs from SRC's, how."""
    changed = [
        f"{key} {getattr(source.model, key)!r} -> {getattr(model, key)!r}"
        for key in CONTEXT_FIELDS
        if hasattr(model, key) and getattr(source.model, key) != getattr(model, key)  # the same arch: the same keys
    ]
    line = f"terapipe: starting from the weights of {source.describe()}; the optimizer starts fresh"
    if changed:
        line += f"; the plan changes the context it was trained for: {', '.join(changed)}"
    return line


def check_zero_biases(reader: _Reader, model: ModelConfig, layers: Iterable[int]) -> None:
    """A ``gpt`` model read from a `transformers` folder: the GPT-2 linear biases of ``layers``, which ``gpt`` does not
    have (its export writes them as zeros), must be zero — one line naming the first that is not."""
    if reader.source.kind != "transformers":
        return
    for name in model.spec.hf_zero_tensors(model):
        if not any(f".{n}." in name for n in layers):
            continue
        t = reader.read_stored(name)
        if t is None or torch.count_nonzero(t):
            state = "is missing" if t is None else "is not zero"
            raise UserError(
                f"{reader.source.describe()}: bias {name!r} {state}; arch {model.arch} has no linear biases (a "
                "GPT2LMHeadModel with biases and the erf GELU is not a model terapipe computes exactly)",
                where=WHERE,
            )


class _Reader:
    """SRC's tensors by terapipe name, read one at a time: `shape` (from headers), `read` (a share of one)."""

    def __init__(self, source: Source, names: set[str] | None = None) -> None:
        """``names``: those a rank will read (a checkpoint's `read_state` maps only their files' records)."""
        self.source = source
        self.state: dict[str, torch.Tensor] = {}  # an export's or a checkpoint's tensors, memory-mapped
        self.files: dict[str, Path] = {}  # a transformers folder: its tensors' names -> the safetensors file
        self.shapes: dict[str, tuple[int, ...]] = {}  # ... and their shapes (the files' headers)
        self.table: dict[str, tuple[str, bool]] = {}
        if source.kind == "export":
            from terapipe_cli.train.export import read_export

            self.state = read_export(source.path, mmap=True)["state_dict"]
        elif source.kind == "run":
            try:
                stored = checkpoint.read_state(
                    source.path, source.step, names, model_config=source.model.to_dict(), map_location="cpu"
                )
            except checkpoint.CheckpointMismatch as e:
                raise UserError(str(e), where=WHERE) from None
            self.state = stored.model
        else:
            self.table = source.model.spec.transformers_names(source.model)
            index = source.path / SAFETENSORS_INDEX
            if index.is_file():
                shards = set(read_json(index, what="safetensors index").get("weight_map", {}).values())
            else:
                shards = {SAFETENSORS}
            for shard in sorted(shards):
                for name, shape in safetensors_shapes(source.path / shard).items():
                    self.files[name], self.shapes[name] = source.path / shard, shape

    def stored_name(self, name: str) -> str:
        """``name`` as SRC calls it."""
        return self.table[name][0] if name in self.table else name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The full tensor's shape in terapipe's orientation; None when SRC lacks it."""
        if self.source.kind != "transformers":
            t = self.state.get(name)
            return None if t is None else tuple(t.shape)
        stored, transposed = self.table.get(name, (name, False))
        if stored not in self.shapes:
            return None
        shape = self.shapes[stored]
        return shape[::-1] if transposed else shape

    def read(self, name: str, where: tuple[int, list[range]] | None, rows: int | None = None) -> torch.Tensor:
        """Tensor ``name`` in fp32 (``where``: only these ranges along that dimension, `tensor.shard_ranges`;
        ``rows``: only the first rows, a position table longer than the run's sequences)."""
        if rows is not None:
            where = (0, [range(rows)]) if where is None else where
        if self.source.kind != "transformers":
            full = self.state[name]
            if where is None:
                t = full.float()
                return t.clone() if t is full else t  # never the memory-mapped tensor itself
            dim, ranges = where
            return torch.cat([full.narrow(dim, r.start, len(r)) for r in ranges], dim=dim).float()
        stored, transposed = self.table.get(name, (name, False))
        # The file is opened (memory-mapped) for this one tensor and closed again: the pages read are unmapped at
        # once, so a rank's resident memory grows by the tensors it keeps, not by the file's pages it read.
        with safe_open(self.files[stored], "pt") as f:
            piece = f.get_slice(stored)
            if where is None:
                t = piece[:]
            else:
                dim, ranges = where
                dim = 1 - dim if transposed else dim  # GPT-2's Conv1D stores (in, out)
                parts = [piece[r.start : r.stop] if dim == 0 else piece[:, r.start : r.stop] for r in ranges]
                t = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        return (t.t() if transposed else t).float().contiguous()

    def read_stored(self, stored: str) -> torch.Tensor | None:
        """A `transformers` tensor by its own name (a bias ``gpt`` does not have), or None."""
        if stored not in self.files:
            return None
        with safe_open(self.files[stored], "pt") as f:
            return f.get_slice(stored)[:]


def safe_open(path: Path, framework: str):
    """safetensors' lazy reader (an optional extra, imported where a folder is read)."""
    from safetensors import safe_open

    return safe_open(path, framework)


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a safetensors file, from its header alone (8 bytes of length, then JSON), checked
    against the file's size: each tensor's bytes inside the file, as many as its shape and type need, and the file
    ending where its last tensor does. A download or copy cut short is named here, before any worker reads it, by
    the header and one ``stat`` (no checksum: a 70B model's files are read only by the workers that need them)."""
    start, size, header = _safetensors_header(path)
    shapes, end = {}, start
    try:
        for name, entry in header.items():
            shapes[name] = tuple(int(n) for n in entry["shape"])
            begin, stop = (int(n) for n in entry["data_offsets"])
            item = SAFETENSORS_DTYPE_BYTES.get(entry["dtype"])  # None: a type packed below a byte (F4, F6)
            if not 0 <= begin <= stop or (item is not None and stop - begin != item * math.prod(shapes[name])):
                raise ValueError(
                    f"tensor {name!r}: data_offsets [{begin}, {stop}] do not fit {entry['dtype']} {shapes[name]}"
                )
            end = max(end, start + stop)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"not a readable safetensors file ({type(e).__name__}: {e})", where=str(path)) from None
    if size < end:
        raise UserError(
            f"is cut short (an unfinished download or copy?): {size:,} bytes, its header's tensors end at byte {end:,}",
            where=str(path),
        )
    if size > end:
        raise UserError(f"has {size - end:,} bytes after its last tensor: not a safetensors file", where=str(path))
    return shapes


SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on the header's bytes


def _safetensors_header(path: Path) -> tuple[int, int, dict]:
    """(the byte where its tensors' data_offsets count from, the file's bytes, its header less ``__metadata__``)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > SAFETENSORS_MAX_HEADER:
                raise UserError("not a safetensors file (no header length in its first 8 bytes)", where=str(path))
            if 8 + length > size:
                raise UserError(
                    f"is cut short (an unfinished download or copy?): {size:,} bytes, fewer than its header's "
                    f"{8 + length:,}",
                    where=str(path),
                )
            header = json.loads(f.read(length))
    except OSError as e:
        raise UserError(f"cannot read ({e.strerror or e})", where=str(path)) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (a UserError is one too)
        if isinstance(e, UserError):
            raise
        raise UserError(
            f"not a safetensors file: its header is not JSON ({type(e).__name__})", where=str(path)
        ) from None
    if not isinstance(header, dict):
        raise UserError("not a safetensors file: its header is not a JSON object", where=str(path))
    header.pop("__metadata__", None)
    return 8 + length, size, header


# The bytes of one element of each safetensors dtype (its format's names) that is a whole number of bytes.
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def load_weights(source: Source, module: nn.Module, tensor_size: int = 1, tensor_rank: int = 0) -> None:
    """Copy SRC's tensors into ``module`` (a stage's part of the model, rank ``tensor_rank`` of ``tensor_size``'s share
    of it, or the whole model), one tensor at a time: each read is this rank's share only, upcast to fp32, and
    copied into the parameter it replaces."""
    from terapipe_cli.engine.tensor import shard_ranges

    own = module.state_dict()  # the parameters' own storage: copy_ writes into them
    model = source.model
    reader = _Reader(source, set(own))
    check_zero_biases(reader, model, {int(name.split(".")[1]) for name in own if name.startswith("blocks.")})
    for name, target in own.items():
        full = reader.shape(name)
        if full is None:
            raise UserError(f"{source.describe()} has no tensor {reader.stored_name(name)!r}", where=WHERE)
        rows = target.shape[0] if name == "wpe.weight" and full[0] > target.shape[0] else None
        if rows is not None:
            full = (rows, *full[1:])
        t = reader.read(name, shard_ranges(name, full, tensor_size, tensor_rank), rows)
        if t.shape != target.shape:
            raise UserError(
                f"{source.describe()}: tensor {reader.stored_name(name)!r} gives {tuple(t.shape)} here, the stage "
                f"holds {tuple(target.shape)}",
                where=WHERE,
            )
        with torch.no_grad():
            target.copy_(t)
        del t


def source_of(args: RunArguments) -> Source | None:
    """The source a run's arguments name (None: it starts from its seed)."""
    if args.init_from is None:
        return None
    return open_source(args.init_from, args.init_step)


def initial_weights(args: RunArguments, module: nn.Module, tensor_size: int = 1, tensor_rank: int = 0) -> None:
    """A new run's first weights: SRC's when the run names one (`load_weights`), else the seed's (left as they are).
    The workers (train/worker.py), the in-process trainer of the tests and ``--verify``'s reference all call this."""
    source = source_of(args)
    if source is not None:
        load_weights(source, module, tensor_size, tensor_rank)
