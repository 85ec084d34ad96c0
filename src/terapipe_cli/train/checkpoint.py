"""Checkpoints: one file per stage, complete only when a manifest lists every file with its size and checksum.

    checkpoints/step_000010/stage_000.pt      {"schema": "terapipe.checkpoint/2", "step", "stage", "stages",
    checkpoints/step_000010/stage_001.pt       "layout", "model_config", "model": {name: tensor},
                                               "optimizer": {"by_name": {name: AdamW state}, ["loss_scale"]}}
    checkpoints/step_000010/complete.json     {"schema": "terapipe.checkpoint-marker/2", "step", "stages",
                                               "files": [{"name", "bytes", "sha256"}, ...]}

A checkpoint is the model, not the layout (docs/design.md §6e): every tensor — weights and AdamW's moments — is
stored under the whole model's name (``blocks.5.attn.qkv.weight``), whole over the tensor ranks, so any plan of the
same model can continue from it: each rank reads the names it holds from whichever stage files hold them
(`read_state`; every file memory-mapped, so a rank reads its own tensors' bytes, not the files'). ``layout`` and
``model_config`` say what wrote it: a file of another model is named in one line, never trained on. A stage file of
``terapipe.checkpoint/1`` (before the names: the optimizer state by index in its stage) still resumes under the
plan that wrote it.

Each stage file is written atomically (`terapipe_cli.files`), by a background thread from a copy in host memory
(`StageWriter`, torchtitan's async mode: the next step runs while the file is written). The thread makes that copy
too, while the next step's forward and backward read the weights; the step waits for it before its update changes
them (`StageWriter.copied`). Its size and SHA-256 are
taken from the bytes written, not read back. Completeness is decided through the process group: the ranks
exchange their files' sizes and checksums in one all-reduce once every write has finished (train/worker.py), so
when it returns every stage of the step is on disk somewhere, or every rank knows a write failed. Then one worker
per run folder writes that folder's manifest, ``complete.json``, last and atomically, listing the stage files the
folder holds: all of them in a folder every node shares, the node's own stages in a node-local one
(docs/design.md §6). A run killed at any moment, or whose disk fills, therefore leaves the last *marked*
checkpoint intact, and `complete_steps` ignores a half-written one. Replicas hold identical weights, so one rank
per stage and folder writes. The newest ``keep`` complete checkpoints are kept (``--keep-checkpoints``); older
ones are removed only once a newer one is complete.

`complete_steps` checks what is cheap (the manifest, each file there with its size); resuming checks the
checksums too (`latest_verified`), and falls back to the newest checkpoint that passes. A marker of schema
``terapipe.checkpoint-marker/1`` (runs from before the manifest) lists file names only: such a checkpoint counts
when its files are there, which is all that can be checked.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from terapipe_cli.config.run import DEFAULT_KEEP_CHECKPOINTS
from terapipe_cli.errors import UserError
from terapipe_cli.files import check_free_space, read_json, why_not_written, write_bytes_atomic, write_json_atomic

CHECKPOINT_SCHEMA = "terapipe.checkpoint/2"
OLD_CHECKPOINT_SCHEMA = "terapipe.checkpoint/1"  # the optimizer state by index: resumes under its own plan only
MARKER_SCHEMA = "terapipe.checkpoint-marker/2"
OLD_MARKER_SCHEMA = "terapipe.checkpoint-marker/1"  # names only: runs from before the manifest
MARKER = "complete.json"
KEEP = DEFAULT_KEEP_CHECKPOINTS  # --keep-checkpoints' default (config/run.py)
WORDS = 5  # a `FileEntry` as int64 words for an all-reduce: its size, then the 32 bytes of its SHA-256


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def stage_file(run_dir: str | Path, step: int, stage: int) -> Path:
    return step_dir(run_dir, step) / f"stage_{stage:03d}.pt"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its manifest lists it."""

    name: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, name: str, data: bytes) -> FileEntry:
        return cls(name, len(data), hashlib.sha256(data).hexdigest())

    def to_words(self) -> list[int]:
        """`WORDS` int64 values (an all-reduce of one row per rank carries every rank's entry)."""
        digest = bytes.fromhex(self.sha256)
        return [self.bytes] + [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]

    @classmethod
    def from_words(cls, name: str, words: list[int]) -> FileEntry:
        digest = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words[1:WORDS])
        return cls(name, int(words[0]), digest.hex())


class WriteFailed(Exception):
    """A checkpoint file could not be written (a full disk, a quota, a folder gone): one line naming it."""


def _model_difference(stored: dict, ours: dict) -> str | None:
    """The first field but ``name`` (a label: a transformers folder's is the folder's) in which the model a file was
    written for differs from ``ours``, as a phrase; None for the same model."""
    for key in {**ours, **stored}:
        if key != "name" and stored.get(key) != ours.get(key):
            return f"its field 'model.{key}' is {stored.get(key)!r}, the run's {ours.get(key)!r}"
    return None


@dataclass(frozen=True)
class Origin:
    """What wrote a checkpoint: the model (its config as a model file gives it) and the layout (D, K, T, virtual
    stages, layers per stage)."""

    model_config: dict
    layout: dict


def _record(step: int, stage: int, stages: int, model: dict, optimizer: dict, origin: Origin | None) -> dict:
    record = {
        "schema": CHECKPOINT_SCHEMA,
        "step": step,
        "stage": stage,
        "stages": stages,
        "model": model,
        "optimizer": optimizer,
    }
    if origin is not None:
        record.update(model_config=origin.model_config, layout=origin.layout)
    return record


def encode_stage(
    step: int, stage: int, stages: int, model: dict, optimizer: dict, origin: Origin | None = None
) -> bytes:
    """A stage file's bytes."""
    buffer = io.BytesIO()
    torch.save(_record(step, stage, stages, model, optimizer, origin), buffer)
    return buffer.getvalue()


def save_stage(
    run_dir: str | Path,
    step: int,
    stage: int,
    stages: int,
    model: dict,
    optimizer: dict,
    *,
    write=None,
    origin: Origin | None = None,
) -> FileEntry:
    """Write one stage's file atomically, streamed and hashed as it is written (or encoded, then ``write(path,
    data)``); its manifest entry. Raises `WriteFailed`: "disk full" when the disk has less room than the state's
    bytes (checked first) or fills during the write, naming the file."""
    path = stage_file(run_dir, step, stage)
    try:
        check_free_space(path, state_bytes((model, optimizer)))
        if write is not None:
            data = encode_stage(step, stage, stages, model, optimizer, origin)
            write(path, data)
            return FileEntry.of(path.name, data)
        return _stream_atomic(path, _record(step, stage, stages, model, optimizer, origin))
    except (OSError, UserError) as e:
        raise WriteFailed(
            str(e) if isinstance(e, UserError) else f"{path}: cannot write: {why_not_written(e)}"
        ) from None


def _tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) state: dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict | list | tuple):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors_in(v)


def state_bytes(obj: object) -> int:
    """The bytes of every tensor in a (nested) state: about its checkpoint file's size."""
    return sum(t.numel() * t.element_size() for t in _tensors_in(obj))


class _Hashing:
    """A file that hashes and counts what is written to it: the manifest entry without a second pass or a copy."""

    def __init__(self, f) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import: setting the umask to read it is not safe in the writer thread


def _stream_atomic(path: Path, obj: object) -> FileEntry:
    """``torch.save`` straight into a temporary file next to ``path``, renamed into place once whole (a reader
    sees the old file or the new one; a failed write leaves neither the new file nor the temporary one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            out = _Hashing(f)
            torch.save(obj, out)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600 files; checkpoints get the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        # torch.save's zip writer reports a write that failed as "[enforce fail at inline_container.cc] unexpected
        # pos"; the file's own error (a full disk) is its context.
        if isinstance(e, RuntimeError) and isinstance(e.__context__, OSError):
            raise e.__context__ from None
        raise
    return FileEntry(path.name, out.bytes, out.sha256.hexdigest())


def save_torch_atomic(path: str | Path, obj: object) -> Path:
    """``torch.save`` to ``path`` all at once: a reader sees the old file or the whole new one."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_bytes_atomic(path, buffer.getvalue())


def host_copy(obj: object) -> object:
    """``obj`` (a state dict, nested) with every tensor copied to host memory: what the writer thread saves while
    the next step updates the weights in place."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def _first_device(obj: object) -> torch.device:
    """The device of the first tensor in a (nested) state that is not on the CPU (the CPU when none is)."""
    return next((t.device for t in _tensors_in(obj) if t.device.type != "cpu"), torch.device("cpu"))


class StageWriter:
    """Writes one stage file at a time in a background thread (`start`), from a host copy of the state that the
    thread makes first (`copied` waits for it); `wait` returns its manifest entry, or raises `WriteFailed`. A worker
    waits before it marks a checkpoint complete and before it exits, however it exits."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: FileEntry | WriteFailed | None = None
        self._copied = threading.Event()
        self._copied.set()

    @property
    def busy(self) -> bool:
        """A file was started and not waited for."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """The file is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def start(
        self,
        run_dir: Path,
        step: int,
        stage: int,
        stages: int,
        model: dict,
        optimizer: dict,
        *,
        write=None,
        origin: Origin | None = None,
    ) -> None:
        self.wait_quietly()
        copied = self._copied = threading.Event()

        device = _first_device((model, optimizer))

        def write_file() -> None:
            try:
                try:
                    if device.type == "cuda":
                        torch.cuda.set_device(device)  # this thread's CUDA work on the stage's GPU, as the worker's
                    held = host_copy(model), host_copy(optimizer)
                finally:
                    copied.set()
                _lower_priority()  # the copy at the training thread's priority: the update waits for it
                self._result = save_stage(run_dir, step, stage, stages, *held, write=write, origin=origin)
            except WriteFailed as e:
                self._result = e
            except BaseException as e:  # noqa: BLE001 - the worker raises it where it waits
                self._result = WriteFailed(f"{stage_file(run_dir, step, stage)}: {type(e).__name__}: {e}")

        self._thread = threading.Thread(target=write_file, name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def copied(self) -> None:
        """Returns once the file's host copy of the state (`start`'s ``model`` and ``optimizer``) is made: from then
        on the tensors may change. Before every update of the weights or the optimizer state."""
        self._copied.wait()

    def wait(self, timeout_s: float | None = None) -> FileEntry:
        """The entry of the file being written, once written; raises `WriteFailed` (also after ``timeout_s``)."""
        if self._thread is None:
            raise RuntimeError("no checkpoint file is being written")
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise WriteFailed(f"writing {self._thread.name} did not finish within {timeout_s:g} s")
        result, self._thread, self._result = self._result, None, None
        if isinstance(result, WriteFailed):
            raise result
        assert result is not None
        return result

    def wait_quietly(self, timeout_s: float | None = None) -> None:
        """Let a file being written finish (its atomic rename done) before the process goes on or ends."""
        if self._thread is not None:
            try:
                self.wait(timeout_s)
            except WriteFailed:
                pass


def _lower_priority() -> None:
    """This thread (the writer) yields the CPU to the training thread when both want it (Linux: a thread's nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):
        pass


WRITER_NICE = 10  # half-way to the lowest priority (19): it still runs whenever a core is free


def mark_complete(
    run_dir: str | Path,
    step: int,
    stages: int,
    held: list[int] | None = None,
    entries: dict[int, FileEntry] | None = None,
    keep: int = KEEP,
) -> None:
    """Call once every stage file of ``step`` is written (the process group said so): write the manifest of the
    stages ``held`` here (default all), with ``entries`` (stage -> entry, as written; default: read back), then
    remove all but the newest ``keep`` complete checkpoints and older incomplete ones."""
    held = list(range(stages)) if held is None else sorted(held)
    folder = step_dir(run_dir, step)
    files = []
    for k in held:
        path = stage_file(run_dir, step, k)
        if not path.is_file():
            raise RuntimeError(f"checkpoint of step {step} lacks {path.name}")
        entry = entries[k] if entries is not None else FileEntry.of(path.name, path.read_bytes())
        if path.stat().st_size != entry.bytes:
            raise RuntimeError(f"{path}: {path.stat().st_size} bytes on disk, {entry.bytes} written")
        files.append({"name": entry.name, "bytes": entry.bytes, "sha256": entry.sha256})
    write_json_atomic(folder / MARKER, {"schema": MARKER_SCHEMA, "step": step, "stages": stages, "files": files})
    prune(run_dir, keep)


def prune(run_dir: str | Path, keep: int) -> None:
    """Remove the complete checkpoints before the newest ``keep``, and incomplete ones older than the newest
    complete one (a save that failed or was cut short)."""
    complete = complete_steps(run_dir)
    if not complete:
        return
    kept = set(complete[-keep:])
    for step in step_folders(run_dir):
        if step < complete[-1] and step not in kept:
            shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)


def step_folders(run_dir: str | Path) -> list[int]:
    """The steps of every checkpoint folder, complete or not, ascending."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def discard(run_dir: str | Path, step: int) -> None:
    """Remove the folder of a checkpoint that will not be completed (its marker first, so that a remove cut
    short never leaves a marked folder with files missing)."""
    (step_dir(run_dir, step) / MARKER).unlink(missing_ok=True)
    shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)


def discard_after(run_dir: str | Path, step: int) -> None:
    """Before a run continues from ``step``: the checkpoints of later steps belong to the abandoned attempt (a
    damaged one, or one a restart will write again), and are removed."""
    for later in step_folders(run_dir):
        if later > step:
            discard(run_dir, later)


def _manifest(run_dir: str | Path, step: int) -> tuple[list[dict] | None, str | None]:
    """(the files the marker of ``step`` lists, each {"name", and for a manifest "bytes", "sha256"}; or None and
    why the checkpoint is not complete)."""
    path = step_dir(run_dir, step) / MARKER
    if not path.is_file():
        return None, "no complete.json (the save did not finish)"
    try:
        marker = read_json(path, what="checkpoint marker")
    except UserError as e:
        return None, e.message
    schema = marker.get("schema")
    files = marker.get("files")
    if schema not in (MARKER_SCHEMA, OLD_MARKER_SCHEMA) or marker.get("step") != step or not isinstance(files, list):
        return None, f"{MARKER} is not the manifest of step {step}"
    if schema == OLD_MARKER_SCHEMA:
        return [{"name": name} for name in files], None
    if not all(isinstance(f, dict) and {"name", "bytes", "sha256"} <= set(f) for f in files):
        return None, f"{MARKER} lists a file without its size and checksum"
    return files, None


def check_step(
    run_dir: str | Path, step: int, *, checksums: bool = True, stages: list[int] | None = None
) -> str | None:
    """None when the checkpoint of ``step`` is complete (every file its manifest lists is there with its size and,
    with ``checksums``, its SHA-256; ``stages``: only those stages' files), else what is wrong, in a few words."""
    files, problem = _manifest(run_dir, step)
    if files is None:
        return problem
    names = None if stages is None else {stage_file(run_dir, step, k).name for k in stages}
    for f in files:
        if names is not None and f["name"] not in names:
            continue
        path = step_dir(run_dir, step) / f["name"]
        if not path.is_file():
            return f"{f['name']} is missing"
        if "bytes" not in f:
            continue  # an old marker: the file's presence is all it records
        size = path.stat().st_size
        if size != f["bytes"]:
            return f"{f['name']} has {size} bytes, its manifest says {f['bytes']}"
        if checksums and _sha256(path) != f["sha256"]:
            return f"{f['name']} does not match its checksum"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete checkpoint (the manifest's files there, each of its size), ascending."""
    return [step for step in step_folders(run_dir) if check_step(run_dir, step, checksums=False) is None]


def latest_complete(run_dir: str | Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def latest_verified(run_dir: str | Path, stages: list[int] | None = None) -> tuple[int | None, list[str]]:
    """(the newest checkpoint whose files all match its manifest, checksums included; ``stages``: only those
    stages' files), and one line for each newer checkpoint passed over and why (a save cut short, a damaged file)."""
    skipped = []
    for step in reversed(step_folders(run_dir)):
        problem = check_step(run_dir, step, stages=stages)
        if problem is None:
            return step, skipped
        skipped.append(f"the checkpoint of step {step} is not usable ({problem})")
    return None, skipped


def load_stage(
    run_dir: str | Path, step: int, stage: int, map_location: str | torch.device = "cpu", *, mmap: bool = False
) -> dict:
    """One stage file, checked to be what its name says (`CheckpointMismatch` otherwise); ``mmap``: its tensors
    memory-mapped, read from disk only where used."""
    path = stage_file(run_dir, step, stage)
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # not a torch file, or one holding more than tensors and plain data
        raise CheckpointMismatch(f"{path}: not a terapipe checkpoint file ({type(e).__name__})") from None
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if schema not in (CHECKPOINT_SCHEMA, OLD_CHECKPOINT_SCHEMA) or obj.get("step") != step or obj.get("stage") != stage:
        raise CheckpointMismatch(f"{path}: not the checkpoint of stage {stage} at step {step}")
    return obj


class CheckpointMismatch(Exception):
    """A checkpoint file that is not what its run and name say (another run's, another model's, not a checkpoint):
    one line naming it."""


def checkpoint_stages(run_dir: str | Path, step: int) -> list[int]:
    """The stages whose files the checkpoint of ``step`` lists in its manifest (this folder's)."""
    files, problem = _manifest(run_dir, step)
    if files is None:
        raise CheckpointMismatch(f"{step_dir(run_dir, step)}: {problem}")
    stages = []
    for f in files:
        name = f["name"]
        if name.startswith("stage_") and name.endswith(".pt") and name[6:-3].isdigit():
            stages.append(int(name[6:-3]))
    return sorted(stages)


@dataclass
class Stored:
    """What `read_state` read: tensors under whole-model names, the optimizer state by name, the fp16 loss scale,
    and what wrote them (each stage file's ``layout``; None for a file from before the names)."""

    model: dict
    optimizer_by_name: dict
    loss_scale: dict | None
    layouts: list[dict | None]
    by_index: dict[int, dict]  # terapipe.checkpoint/1 files, by stage: their whole record (the optimizer by index)


def read_state(
    run_dir: str | Path,
    step: int,
    names: set[str] | None = None,
    *,
    model_config: dict | None = None,
    map_location: str | torch.device = "cpu",
) -> Stored:
    """The tensors ``names`` (None: all) and their optimizer state from every stage file of the checkpoint of
    ``step`` (its manifest's), each memory-mapped. ``model_config``: the model the run trains, which every file
    must have been written for (`CheckpointMismatch` naming the first that was not)."""
    out = Stored({}, {}, None, [], {})
    for stage in checkpoint_stages(run_dir, step):
        obj = load_stage(run_dir, step, stage, map_location, mmap=True)
        path = stage_file(run_dir, step, stage)
        differs = (
            None if model_config is None else _model_difference(obj.get("model_config", model_config), model_config)
        )
        if differs is not None:
            raise CheckpointMismatch(f"{path}: written for another model: {differs}")
        out.layouts.append(obj.get("layout"))
        if obj["schema"] == OLD_CHECKPOINT_SCHEMA:
            out.by_index[stage] = obj
        optimizer = obj.get("optimizer", {})
        by_name = optimizer.get("by_name", {}) if isinstance(optimizer, dict) else {}
        for name, tensor in obj["model"].items():
            if names is None or name in names:
                out.model.setdefault(name, tensor)
                if name in by_name:
                    out.optimizer_by_name.setdefault(name, by_name[name])
        if isinstance(optimizer, dict) and optimizer.get("loss_scale") is not None:
            out.loss_scale = optimizer["loss_scale"]
    return out
