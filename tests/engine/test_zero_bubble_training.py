"""ZB-H1 trained through the workers' own code (the in-process executor, tests/conftest.py `verify_locally`): I's
and W's walked by the executor, the gradient sent after I, the same losses, gradients and weights as the
single-device reference — both architectures, unequal token slices and two batch slices sliced differently,
recomputation, T = 2, bf16, v = 2 — and negative controls that must fail. (Under NCCL's message rules:
tests/engine/test_cuda_branches.py.)"""

import pytest
from conftest import TWO_STEPS, local_setup, run_cli, verify_locally, write_plan_file

from terapipe_cli.engine.stage import StageRunner
from terapipe_cli.models import LlamaConfig, ModelConfig
from terapipe_cli.schedule.schedule import Schedule, parse_schedule


def llama(layers: int = 6) -> ModelConfig:
    return LlamaConfig(name="test-llama", layers=layers, hidden=32, heads=4, vocab=256, seq_len=32)


ZB = {"order": "zb1p"}
ZBV = {"order": "zbv", "virtual_stages": 2}
CASES = {
    "K=2, unequal token slices": ([(2, [13, 1, 11, 7])], 2, {}, ZB),
    "K=3, two batch slices sliced differently, recomputed on some stages": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        3,
        {},
        {**ZB, "recompute": [True, False, True]},
    ),
    "K=2, T=2, bf16": ([(1, [8, 24])] * 3, 2, {"tensor_parallel": 2, "precision": "bf16"}, ZB),
    "K=2, v=2, batch slices of different sizes": (
        [(2, [16, 16]), (1, [8, 8, 16]), (1, [32])],
        2,
        {},
        {**ZB, "virtual_stages": 2, "layers_per_stage": [1, 2, 2, 1]},
    ),
    "llama, K=2, recomputed, bf16": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        2,
        {"precision": "bf16"},
        {**ZB, "recompute": [True, True]},
    ),
    "llama, K=3, T=2": ([(2, [13, 1, 11, 7])], 3, {"tensor_parallel": 2}, ZB),
    # ZB-V: chunks k and 2K − 1 − k on device k; the V's bottom hands over in memory, the up arm sends back down.
    "ZB-V, K=2, unequal token slices": ([(2, [13, 1, 11, 7])], 2, {}, {**ZBV, "recompute": [False] * 4}),
    "ZB-V, K=3, two batch slices sliced differently, recomputed on some chunks, bf16": (
        [(1, [20, 12]), (1, [5, 5, 22])],
        3,
        {"precision": "bf16"},
        {**ZBV, "recompute": [True, False, False, True, False, True]},
    ),
    "llama, ZB-V, K=3, T=2": ([(1, [8, 24])] * 3, 3, {"tensor_parallel": 2}, {**ZBV, "recompute": [False] * 6}),
    # D = 2: each chunk's data-parallel sum starts at its last W, while the stage runs the rest of its actions.
    "K=2, v=2, D=2": (
        [(1, [12, 20])] * 2,
        2,
        {"data_parallel": 2},
        {**ZB, "virtual_stages": 2, "recompute": [False] * 4},
    ),
    "ZB-V, K=2, D=2": ([(1, [12, 20])] * 2, 2, {"data_parallel": 2}, {**ZBV, "recompute": [False] * 4}),
}


def setup_of(name: str, **changes):
    """The case ``name``, two steps (conftest.TWO_STEPS) unless ``changes`` say."""
    slices, stages, args, fields = CASES[name]
    model = llama() if name.startswith("llama") else None
    extra = {"model": model} if model is not None else {}
    return local_setup(slices, stages=stages, plan_fields=fields, **extra, **{**TWO_STEPS, **args, **changes})


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bubble_verifies(name):
    setup = setup_of(name)
    assert setup.plan.partition.placement == ("v" if "ZB-V" in name else "interleaved")
    result, run = verify_locally(setup)
    assert result.ok, [(c.what, c.max_rel, c.tolerance) for c in result.checks]


def test_dropping_the_kv_handback_fails_zb1p():
    result, _ = verify_locally(setup_of("K=2, unequal token slices", kv_handback=False))
    assert not result.ok


def test_skipping_one_tiles_w_fails(monkeypatch):
    original = StageRunner.backward_weight

    def skip_one(self, batch_slice, token_slice, *, chunk=None):
        if (batch_slice, token_slice) == (0, 1) and self.first:
            self._weights.pop((self._chunk(chunk), batch_slice, token_slice))  # its weights' gradient lost
            state = self._slices[(self._chunk(chunk), batch_slice)]
            state.weights_due -= 1
            self._backward_end((self._chunk(chunk), batch_slice, token_slice), state, popped=True)
            return
        original(self, batch_slice, token_slice, chunk=chunk)

    monkeypatch.setattr(StageRunner, "backward_weight", skip_one)
    result, _ = verify_locally(setup_of("K=2, unequal token slices"))
    assert not result.ok


def test_a_torch_format_csv_with_i_and_w_trains_the_same_order():
    """A schedule in torch.distributed.pipelining's CSV form (``0F0,0I0,0W0,…``: whole sequences) read by
    `parse_schedule`, as `terapipe train --schedule` reads it, trains ZB-H1's order and verifies."""
    setup = local_setup([(1, [32])] * 3, stages=2, plan_fields=ZB)
    built = Schedule.of_plan(setup.plan)
    text = built.to_csv()
    assert text.startswith("0F0,0F1,0I0,0W0,0F2,") and "1W0" in text
    schedule = parse_schedule(text, setup.plan.slices, 2, setup.plan.recompute)
    assert schedule.actions == built.actions
    result, run = verify_locally(setup, schedule)
    assert result.ok


def test_terapipe_train_reads_a_torch_format_csv_as_the_order_it_walks(tmp_path, capsys):
    """As a user gives it: `terapipe train --schedule order.csv` on a ZB-H1 plan of whole sequences, the CSV in
    torch.distributed.pipelining's form with every W held to the end (another legal order than the plan's own), is
    read, checked and kept as the schedule the workers walk (`--dry-run` says so: nothing launched); the same text
    walked in process verifies (the test above: the order is what runs)."""
    plan = write_plan_file(tmp_path / "plan.json", [(1, [32])] * 3, stages=2, order="zb1p")
    rows = ["0F0,0F1,0I0,0F2,0I1,0I2,0W0,0W1,0W2", "1F0,1I0,1F1,1I1,1F2,1I2,1W0,1W1,1W2"]
    (tmp_path / "order.csv").write_text("\n".join(rows) + "\n")
    p = run_cli(capsys, "train", "--plan", plan, "--schedule", tmp_path / "order.csv", "--dry-run", "--device", "cpu",
                cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("schedule:"))
    assert "order.csv (a custom order)" in line and "split into I and W" in line and "per device 9, 9" in line
    setup = local_setup([(1, [32])] * 3, stages=2, plan_fields=ZB)
    walked = parse_schedule("\n".join(rows), setup.plan.slices, 2, setup.plan.recompute)
    assert walked.to_csv().splitlines() == rows
    result, _ = verify_locally(setup, walked)
    assert result.ok
    bad = tmp_path / "bad.csv"
    bad.write_text(rows[0].replace("0I0,", "") + "\n" + rows[1] + "\n")  # 0W0 before its I: refused in one line
    p = run_cli(capsys, "train", "--plan", plan, "--schedule", bad, "--dry-run", "--device", "cpu", cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_each_chunks_replica_sum_starts_at_its_last_w(monkeypatch):
    """With D = 2 the trainer starts a chunk's data-parallel sum when the executor has run that chunk's last W —
    before the stage's last action where another chunk's W's follow — and waits for it only before the update; the
    step still verifies (CASES has the D = 2 cases)."""
    from terapipe_cli.engine.trainer import Trainer

    started: list[tuple[int, int]] = []  # (chunk, W's its runner had run by then)
    runs: dict[int, int] = {}
    original_w, original_start = StageRunner.backward_weight, Trainer.start_chunk_sum

    def counting_w(self, *a, **k):
        runs[id(self)] = runs.get(id(self), 0) + 1
        return original_w(self, *a, **k)

    def recording_start(self, chunk):
        started.append((chunk, runs.get(id(self.runner), 0)))
        return original_start(self, chunk)

    monkeypatch.setattr(StageRunner, "backward_weight", counting_w)
    monkeypatch.setattr(Trainer, "start_chunk_sum", recording_start)
    setup = setup_of("ZB-V, K=2, D=2")
    result, _ = verify_locally(setup)
    assert result.ok
    schedule = Schedule.of_plan(setup.plan)
    rows = {d: [a for a in schedule[d] if a.phase.value == "W"] for d in range(2)}
    assert {c for c, _ in started} == {0, 1, 2, 3}
    overlapped = 0
    for chunk, done in started:
        row = rows[schedule.device(chunk)]
        last_w = max(n for n, a in enumerate(row) if a.stage == chunk) + 1
        assert done % len(row) == last_w % len(row)  # started right after the chunk's last W, every step
        overlapped += last_w < len(row)
    assert overlapped  # on some device a chunk's sum started while the other chunk's W's still ran


def test_a_replica_sum_started_before_its_chunks_ws_fails(monkeypatch):
    """The negative control: each chunk's sum started at the step's first action instead of after its last W sums
    gradients not yet there (and copies them back over the real ones): --verify fails."""
    from terapipe_cli.engine.executor import StageExecutor

    original = StageExecutor.step

    def too_early(self, batch, *, chunk_done=None, **kw):
        if chunk_done is not None:
            for chunk in sorted({a.stage for a in self.actions}):
                chunk_done(chunk)
        return original(self, batch, **kw)

    monkeypatch.setattr(StageExecutor, "step", too_early)
    result, _ = verify_locally(setup_of("ZB-V, K=2, D=2"))
    assert not result.ok
