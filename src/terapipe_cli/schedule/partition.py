"""How the model's layers are cut into the pipeline's chunks, and which device runs each (docs/design.md §11).
Imports no torch.

A pipeline of K devices runs S = K·v *chunks* (virtual stages) in model order: chunk c holds ``layers[c]``
consecutive decoder layers and runs on device c mod K, so with v = 1 a chunk is a stage and with v > 1 device k holds
chunks k, k + K, …, k + (v − 1)·K (Megatron-LM's interleaving). Chunk 0 also embeds the tokens, chunk S − 1 runs
the final norm, the LM head and the loss: those two may hold no layer at all. Every other chunk holds at least one.
A tile passes chunk c → c + 1, wrapping from device K − 1 back to device 0 between rounds.

The plan file keeps ``layers_per_stage`` (one count per chunk, K·v of them) and ``virtual_stages`` (v); a plan
without them has v = 1 and the even split, which needs K to divide N (as before they existed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from terapipe_cli.errors import UserError

PLACEMENTS = ("interleaved", "v")


def refuses_tied(placement: str) -> bool:
    """Whether ``placement`` cannot run a model whose LM head is tied to its embedding: the V puts both ends on
    device 0, where the tied copies' gradient sum (the first and last stages' embedding group) has nothing to sum.
    The one rule the plan file, the request and the search check."""
    return placement == "v"


@dataclass(frozen=True)
class Partition:
    """``layers[c]``: the decoder layers of chunk c, in model order; chunk c runs on `device` (c), by ``placement``:
    ``interleaved``, device c mod ``devices`` (Megatron-LM's rounds); ``v`` (two chunks per device, ZB-V), device k
    holds chunks k and 2K − 1 − k, so the pipeline goes down the devices and back up: the first chunk and the last
    (the embedding and the head) share device 0, and chunks K − 1 and K, at the V's bottom, are on one device."""

    layers: tuple[int, ...]
    devices: int
    placement: str = "interleaved"  # one of PLACEMENTS

    def __post_init__(self) -> None:
        if self.devices < 1 or not self.layers or len(self.layers) % self.devices:
            raise ValueError(f"{len(self.layers)} chunks do not fill {self.devices} devices evenly")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "v" and len(self.layers) != 2 * self.devices:
            raise ValueError(f"the V placement holds two chunks per device, not {len(self.layers) / self.devices:g}")

    @property
    def chunks(self) -> int:
        return len(self.layers)

    @property
    def virtual(self) -> int:
        """Chunks per device, v."""
        return self.chunks // self.devices

    @property
    def total_layers(self) -> int:
        return sum(self.layers)

    @property
    def even(self) -> bool:
        """Every chunk holds as many layers as every other (the split a plan without ``layers_per_stage`` has)."""
        return len(set(self.layers)) == 1

    def device(self, chunk: int) -> int:
        if self.placement == "v":
            return chunk if chunk < self.devices else 2 * self.devices - 1 - chunk
        return chunk % self.devices

    def chunks_on(self, device: int) -> tuple[int, ...]:
        """The chunks device ``device`` runs, in model order."""
        if self.placement == "v":
            return (device, 2 * self.devices - 1 - device)
        return tuple(range(device, self.chunks, self.devices))

    def layer_ids(self, chunk: int) -> range:
        """The global indices of chunk ``chunk``'s layers."""
        start = sum(self.layers[:chunk])
        return range(start, start + self.layers[chunk])

    def device_layers(self, device: int) -> int:
        """Layers device ``device`` holds over all its chunks."""
        return sum(self.layers[c] for c in self.chunks_on(device))

    def to_list(self) -> list[int]:
        return list(self.layers)

    def text(self) -> str:
        """``5, 6, 6, 7``; runs of three or more folded (``1, 2×46, 1``); by round when v > 1 (``1 2 | 2 1``)."""
        rounds = [self.layers[r * self.devices : (r + 1) * self.devices] for r in range(self.virtual)]
        return " | ".join(_folded(r, ", " if self.virtual == 1 else " ") for r in rounds)

    @classmethod
    def balanced(cls, layers: int, devices: int, virtual: int = 1, placement: str = "interleaved") -> Partition:
        """The most even split of ``layers`` over K·v chunks: the layers left over go to the middle chunks first (the
        first and last chunks also embed and run the head), then to the first, then to the last; on ``placement``."""
        chunks = devices * virtual
        base, extra = divmod(layers, chunks)
        counts = [base] * chunks
        order = list(range(1, chunks - 1)) + [0] + ([chunks - 1] if chunks > 1 else [])
        for c in order[:extra]:
            counts[c] += 1
        return cls(tuple(counts), devices, placement)

    @classmethod
    def even_split(cls, layers: int, devices: int, *, where: str = "stages", name: str = "model") -> Partition:
        """N/K layers per stage (v = 1): a one-line `UserError` listing the stage counts that divide N otherwise."""
        if devices < 1:
            raise UserError(f"must be at least 1, got {devices}", where=where)
        if layers % devices:
            divisors = [k for k in range(1, layers + 1) if layers % k == 0]
            raise UserError(
                f"{devices} stages do not divide the {layers} layers of model '{name}' (stage counts that divide "
                f"them: {', '.join(map(str, divisors))}); give the layers of each stage (--layers-per-stage) or let "
                "the planner choose them (--partition auto)",
                where=where,
            )
        return cls((layers // devices,) * devices, devices)


def check_partition(
    counts: Sequence,
    *,
    layers: int,
    devices: int,
    virtual: int = 1,
    where: str = "layers_per_stage",
    placement: str = "interleaved",
) -> Partition:
    """``counts`` (per chunk) as a `Partition` of ``layers`` over ``devices`` × ``virtual`` chunks, checked: K·v
    whole numbers summing to N, at least one layer in every chunk but the first and the last, K ≤ N. One-line
    `UserError` naming ``where`` otherwise."""
    chunks = devices * virtual
    if devices > layers:
        raise UserError(f"{devices} stages are more than the model's {layers} layers", where=where)
    if not isinstance(counts, (list, tuple)) or len(counts) != chunks:
        what = f"{devices} stages" + (f" x {virtual} virtual stages" if virtual > 1 else "")
        raise UserError(f"must list {chunks} layer counts ({what}), got {list(counts)!r}", where=where)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise UserError(f"must be whole numbers of layers (0 or more), got {list(counts)!r}", where=where)
    if sum(counts) != layers:
        raise UserError(f"sum to {sum(counts)} layers, the model has {layers}", where=where)
    empty = [c for c in range(1, chunks - 1) if counts[c] == 0]
    if empty:
        raise UserError(
            f"stage {empty[0]} holds no layer (only the first and the last may: they embed and run the head)",
            where=where,
        )
    if placement == "v" and virtual != 2:
        raise UserError(f"the V placement holds two chunks per device: virtual_stages must be 2, got {virtual}",
                        where=where)  # fmt: skip
    return Partition(tuple(int(n) for n in counts), devices, placement)


def parse_layers(text: str, *, where: str = "--layers-per-stage") -> list[int]:
    """``5,6,6,7`` -> [5, 6, 6, 7] (a one-line `UserError` for anything else)."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(
            f"expected whole numbers separated by commas, e.g. 5,6,6,7, got {text!r}", where=where
        ) from None


def _folded(counts: Sequence[int], sep: str) -> str:
    parts, k = [], 0
    while k < len(counts):
        run = 1
        while k + run < len(counts) and counts[k + run] == counts[k]:
            run += 1
        parts += [f"{counts[k]}×{run}"] if run >= 3 else [str(counts[k])] * run
        k += run
    return sep.join(parts)
