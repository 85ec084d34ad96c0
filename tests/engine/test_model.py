import torch
from conftest import tiny_model

from terapipe_cli.engine.loss import token_loss_sum
from terapipe_cli.models.attention import KVCache
from terapipe_cli.models.gpt.module import GPT


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


def test_slice_by_slice_equals_whole_sequence():
    cfg = tiny_model(layers=2, seq_len=40)
    model = GPT(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab, (3, 40), generator=torch.Generator().manual_seed(0))
    whole = model(tokens)
    caches = [KVCache(cfg.seq_len) for _ in model.layer_ids]
    outs, start = [], 0
    for n in (17, 1, 9, 13):
        outs.append(model(tokens[:, start : start + n], start, caches))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_loss_is_a_sum_over_tokens():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    torch.testing.assert_close(token_loss_sum(logits, targets), mean * 10)


def test_kv_cache_is_written_once_and_read_in_place():
    """Each slice writes its keys/values into the cache once; later slices read them there, not from copies."""
    cfg = tiny_model(layers=1, seq_len=24)
    cache = KVCache(cfg.seq_len)
    seen = []
    k_all = torch.randn(2, 2, 24, 16)
    for start, n in ((0, 10), (10, 6), (16, 8)):
        keys, values = cache.window(k_all[:, :, start : start + n], k_all[:, :, start : start + n] * 2, start)
        assert keys.shape == (2, 2, start + n, 16)
        assert keys.untyped_storage().data_ptr() == cache.keys.untyped_storage().data_ptr()
        seen.append(keys)
    torch.testing.assert_close(seen[-1], k_all, rtol=0, atol=0)
    torch.testing.assert_close(seen[0], k_all[:, :, :10], rtol=0, atol=0)  # later writes left earlier rows alone


def test_kv_cache_hands_gradients_back_to_earlier_slices():
    """The gradient reaching each slice's own k equals the gradient of k in one whole-sequence window."""
    k_all = torch.randn(1, 2, 12, 4, requires_grad=True)
    weight = torch.randn(1, 2, 12, 4)
    cache = KVCache(12)
    parts, outs = [], []
    for start, n in ((0, 5), (5, 4), (9, 3)):
        k = k_all[:, :, start : start + n].detach().requires_grad_(True)
        keys, values = cache.window(k, k * 0, start)
        parts.append(k)
        outs.append((keys * weight[:, :, : start + n]).sum())
    for out in reversed(outs):  # reverse token order, as the runtime
        out.backward()
    (k_all * weight * torch.tensor([3.0] * 5 + [2.0] * 4 + [1.0] * 3).view(1, 1, 12, 1)).sum().backward()
    torch.testing.assert_close(torch.cat([p.grad for p in parts], dim=2), k_all.grad)
