import torch
from conftest import tiny_model

from terapipe_cli.model import GPT, context_mask, token_loss_sum


def test_same_weights_whatever_the_stage_count(tiny):
    full = dict(GPT(tiny, seed=3).named_parameters())
    for stages in (2, 4):
        seen = set()
        for k in range(stages):
            for name, p in GPT(tiny, k, stages, seed=3).named_parameters():
                assert torch.equal(p, full[name]), name
                seen.add(name)
        assert seen == set(full)
    other = dict(GPT(tiny, seed=4).named_parameters())
    assert not torch.equal(other["blocks.1.mlp.fc.weight"], full["blocks.1.mlp.fc.weight"])


def test_context_mask_sees_all_context_and_causal_self():
    m = context_mask(3, 2, torch.device("cpu"))
    assert m.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_slice_by_slice_equals_whole_sequence():
    cfg = tiny_model(layers=2, seq_len=40)
    model = GPT(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab, (3, 40), generator=torch.Generator().manual_seed(0))
    whole, _ = model(tokens)
    context = [[] for _ in model.layer_ids]
    outs, start = [], 0
    for n in (17, 1, 9, 13):
        out, kvs = model(tokens[:, start : start + n], start, context if start else None)
        for layer, kv in zip(context, kvs, strict=True):
            layer.append(kv)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_loss_is_a_sum_over_tokens():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    torch.testing.assert_close(token_loss_sum(logits, targets), mean * 10)
