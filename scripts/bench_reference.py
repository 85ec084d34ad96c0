#!/usr/bin/env python3
"""A plain PyTorch GPT of a terapipe model's shape, eager and `torch.compile`d per block: the single-GPU reference
that `terapipe train` at K = 1 is compared with (scripts/bench_gpu.py times terapipe's own step).

    python scripts/bench_reference.py --markdown                   # GPT3-1B, B = 8, L = 2048, bf16 (an H100)
    python scripts/bench_reference.py --model M.toml --batch 2     # another GPT-family model
    python scripts/bench_reference.py --device cpu --modes eager   # a dry run on the tiny model (seconds)

The reference is written the way a user would write it without terapipe (nanoGPT's layout): token and position
embeddings, pre-norm blocks of LayerNorm, one Q/K/V projection, `scaled_dot_product_attention(is_causal=True)`, the
output projection, a GELU MLP of the model's inner width, no biases in the linear layers (as terapipe's `gpt`
architecture), the final LayerNorm and the head (tied to the embedding when the model ties it). One training step:
bf16 autocast over fp32 weights (fp32: none), the mean cross-entropy over B·L tokens, backward, global-norm clip
1.0, fused AdamW on CUDA (foreach on the CPU) — the step `terapipe train` takes with its defaults.

Modes run interleaved on their own weights (eager, compiled, eager, compiled, ...), after untimed warm-up steps (the
compile happens there, and its seconds are printed); each cell is the median (min–max) of the timed steps. Model
TFLOP/s and MFU use `plan.mfu.step_flops` and the bf16 peak of bench_gpu.py, as bench_gpu.py's table does.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))


def build(model, device, dtype=None):
    """The reference GPT of ``model``'s shape (a `terapipe_cli.models.GptConfig`)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    H, heads = model.hidden, model.heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(H, eps=model.norm_eps), nn.LayerNorm(H, eps=model.norm_eps)
            self.qkv, self.proj = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H, bias=False)
            self.fc, self.out = nn.Linear(H, model.ffn_hidden, bias=False), nn.Linear(model.ffn_hidden, H, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, heads, H // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, H))
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(model.vocab, H), nn.Embedding(model.seq_len, H)
            self.blocks = nn.ModuleList(Block() for _ in range(model.layers))
            self.ln_f, self.head = nn.LayerNorm(H, eps=model.norm_eps), nn.Linear(H, model.vocab, bias=False)
            if model.tie_embeddings:
                self.head.weight = self.wte.weight
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, ids, targets):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    return GPT().to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run (default cuda)")
    parser.add_argument("--model", help="model TOML or bundled name (default gpt3-1b; on the CPU tiny at L = 128)")
    parser.add_argument("--batch", type=int, help="sequences per step B (default 8; on the CPU 1)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="default bf16")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, compiled (default both)")
    parser.add_argument("--rounds", type=int, help="timed steps per mode (default 5; on the CPU 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps per mode first (default 2; on the CPU 1)")
    parser.add_argument("--markdown", action="store_true", help="a Markdown table (for docs/results.md)")
    args = parser.parse_args(argv)

    import torch
    from bench_gpu import NO_GPU, load_model, peak_flops

    from terapipe_cli.plan.mfu import step_flops

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "compiled"}:
        print(f"bench_reference.py: --modes takes eager and/or compiled, got {args.modes!r}", file=sys.stderr)
        return 2
    default_model = ROOT / "configs/models" / ("gpt3-1b.toml" if cuda else "tiny.toml")
    model = load_model(args.model or str(default_model), None if (cuda or args.model) else 128)
    if model.arch != "gpt":
        print(f"bench_reference.py: the reference is a GPT; {model.name} is {model.arch}", file=sys.stderr)
        return 2
    B = args.batch or (8 if cuda else 1)
    rounds, warmup = args.rounds or (5 if cuda else 1), args.warmup if args.warmup is not None else (2 if cuda else 1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    ids = torch.randint(0, model.vocab, (B, model.seq_len + 1), device=device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    autocast = torch.autocast(args.device, torch.bfloat16, enabled=args.precision == "bf16")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    runs = {}
    for mode in modes:
        net = build(model, device)
        if mode == "compiled":
            for block in net.blocks:
                block.compile()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, **({"fused": True} if cuda else {"foreach": True}))

        def step(net=net, opt=opt) -> float:
            with autocast:
                loss = net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        runs[mode] = {"step": step, "times": [], "warm_s": 0.0, "loss": math.nan, "peak": 0}

    for mode, run in runs.items():  # warm-up (and compile) one mode after the other, each timed as a whole
        sync()
        t0 = time.perf_counter()
        for _ in range(warmup):
            run["loss"] = float(run["step"]())
        sync()
        run["warm_s"] = time.perf_counter() - t0
        print(f"{mode}: {warmup} warm-up step(s) in {run['warm_s']:.1f} s, loss {run['loss']:.3f}", file=sys.stderr)
    for _ in range(rounds):
        for run in runs.values():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            run["step"]()
            sync()
            run["times"].append(time.perf_counter() - t0)
            if cuda:
                run["peak"] = max(run["peak"], torch.cuda.max_memory_allocated())

    flops = step_flops(model, model.seq_len, B)
    peak, peak_source = peak_flops(torch.cuda.get_device_name(0), None) if cuda else (None, "no CUDA")
    where = torch.cuda.get_device_name(0) if cuda else "cpu (a dry run, not a measurement)"
    headers = ["plain PyTorch GPT", "ms/step, median (min–max)", "model TFLOP/s", "MFU", "peak GiB", "warm-up s"]
    rows = []
    for mode, run in runs.items():
        med = statistics.median(run["times"])
        rows.append([
            mode, f"{med * 1e3:.1f} ({min(run['times']) * 1e3:.1f}–{max(run['times']) * 1e3:.1f})",
            f"{flops / med / 1e12:.3g}", f"{flops / med / peak:.1%}" if peak else "no CUDA",
            f"{run['peak'] / 2**30:.1f}" if cuda else "no CUDA", f"{run['warm_s']:.1f}",
        ])  # fmt: skip
    title = (f"Reference: {model.name} (H {model.hidden}, {model.layers} layers, vocab {model.vocab}), B = {B}, "
             f"L = {model.seq_len}, {args.precision}; {where}; {rounds} timed step(s) per mode, interleaved; "
             f"peak: {peak_source}")  # fmt: skip
    if args.markdown:
        print(f"\n{title}\n\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print(title)
        for row in [headers, *rows]:
            print("  ".join(f"{c:>24}" for c in row))
    return 0


if __name__ == "__main__":
    from terapipe_cli.ending import entry_point

    entry_point(main)
