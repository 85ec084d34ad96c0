"""Tiny `transformers` models of random weights, saved into a test's folder (``save_pretrained``; never downloaded),
and their weights moved into terapipe's model of the same config by the architecture's name table."""

from __future__ import annotations

from pathlib import Path

import torch

from terapipe_cli.models import ModelConfig, build_model


def saved(folder: Path, cls: str, seed: int = 0, **config):
    """A ``transformers.<cls>`` of random weights (seeded) with ``config`` (its class's config fields), saved into
    ``folder``; returns the model, in eval mode."""
    import copy

    import transformers

    model_cls = getattr(transformers, cls)
    torch.manual_seed(seed)
    model = model_cls(model_cls.config_class(**copy.deepcopy(config))).eval()  # transformers edits rope_scaling
    with torch.no_grad():  # biases and norms away from their zero/one initialisation, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn(p.shape))
    model.save_pretrained(folder)
    return model


def terapipe_model(theirs, cfg: ModelConfig):
    """terapipe's single-device model of ``cfg`` holding ``theirs``' weights, by the architecture's table
    (`Arch.transformers_names`, what ``--init-from`` reads a folder by), eval mode."""
    state = theirs.state_dict()
    ours = {
        name: state[hf_name].t() if transposed else state[hf_name]
        for name, (hf_name, transposed) in cfg.spec.transformers_names(cfg).items()
    }
    model = build_model(cfg)
    model.load_state_dict(ours, strict=True)
    return model.eval()
