"""``terapipe export``: take the trained model out of a run, as one single-device state dict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from terapipe_cli.cli.console import make_console
from terapipe_cli.engine import require_torch
from terapipe_cli.errors import UserError
from terapipe_cli.files import check_output_file

HELP = """Join a run's per-stage checkpoint into one single-device model file (or, with --format hf, a Hugging Face \
folder), loadable without terapipe's runtime.

A model file loads with:

    from terapipe_cli import load_exported
    model, info = load_exported("model.pt")     # GPT or Llama (models.build_model), strict=True, eval mode

or by hand: build_model(ModelConfig.from_dict(obj["model_config"], "model.pt")).load_state_dict(obj["state_dict"])
with obj = torch.load("model.pt", weights_only=True) (build_model and ModelConfig from terapipe_cli.models).

--format hf writes a Hugging Face folder instead (config.json, model.safetensors) that
transformers' AutoModelForCausalLM.from_pretrained(OUT) loads; it needs pip install 'terapipe-cli\\[hf]'.

Examples:

    terapipe export runs/exp1 --out model.pt

    terapipe export runs/exp1 --step 200 --out model-200.pt

    terapipe export runs/exp1 --format hf --out model-hf
"""

FORMATS = ("pt", "hf")


def export(
    run: Annotated[Path, typer.Argument(help="The run folder (`terapipe train --out`).", show_default=False)],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="The file to write (pt; default model.pt), or a new folder (hf; default model-hf)."
        ),
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="pt: one torch file; hf: a Hugging Face folder (config.json, safetensors).")
    ] = "pt",
    step: Annotated[
        int | None, typer.Option("--step", help="A complete checkpoint's step (default: the latest).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out file (pt only).")] = False,
) -> None:
    require_torch("terapipe export")
    if fmt not in FORMATS:
        raise UserError(f"must be pt or hf, got {fmt!r}", where="--format")
    from terapipe_cli.train import export as exporting  # PyTorch: loaded when the command runs

    if fmt == "hf":
        from terapipe_cli.train import hf

        out = out or Path("model-hf")
        if force:
            raise UserError("--format hf never overwrites: give a new or an empty folder", where="--force")
        hf.require_hf()
        hf.check_output_folder(out)
        model, done, state = exporting.export_state(run, step)
        hf.write_hf(out, model, state, step=done, run=run, tokenizer=hf.run_tokenizer_of(run))
    else:
        out = out or Path("model.pt")
        check_output_file(out, kind="model export", schema=None, force=force, example="model.pt")
        model, done, state = exporting.export_state(run, step)
        exporting.write_export(out, run, model, done, state)
    params = sum(t.numel() for t in state.values())
    make_console(highlight=False).print(
        f"exported step {done} of {run} ({model.name}, {params:,} parameters) -> {out}", soft_wrap=True
    )


def register(app: typer.Typer) -> None:
    app.command("export", help=HELP)(export)
