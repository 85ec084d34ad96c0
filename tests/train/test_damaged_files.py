"""Every reader of a run's files — config, metrics, timelines, summary — names a damaged file in one line, never a
raw JSONDecodeError, KeyError or UnicodeDecodeError: the launcher's error path (`launch.interrupted_message`), the
report (`report.runs.load_run`), a resumed run (`rundir.keep_metrics_until`) and the workers all read through them."""

from __future__ import annotations

import pytest
from fake_runs import make_run
from file_errors import assert_file_error

from terapipe_cli.report.runs import load_run
from terapipe_cli.schedule.timeline import read_timeline
from terapipe_cli.train.launch import interrupted_message
from terapipe_cli.train.rundir import keep_metrics_until, read_config, read_metrics, read_summary, timeline_path


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run", [(1, [16, 16])], steps=3)


def damage(path, data: bytes | None) -> None:
    """Cut the file short (None), or replace its bytes."""
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2] if data is None else data)


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("config.json", None, ["malformed JSON"]),
        ("summary.json", None, ["malformed JSON"]),
        ("timelines/rank_00000.json", None, ["malformed JSON"]),
        ("metrics.jsonl", b'{"schema": "terapipe.metrics/1", "step": 1, "lo\n{"step": 2}\n', ["corrupt line 1"]),
        ("metrics.jsonl", b"\xff\xfe\x00garbage\n", ["not text"]),
        ("metrics.jsonl", b'{"schema": "terapipe.metrics/1", "loss": 1.0}\n', ["line 1", "'step'"]),
        ("metrics.jsonl", b'{"schema": "terapipe.metrics/1", "step": "1"}\n', ["line 1", "'step'"]),
    ],
)
def test_a_damaged_file_is_one_line_naming_it_for_every_reader(run, name, data, words):
    path = run / name
    damage(path, data)
    readers = {
        "config.json": [read_config],
        "summary.json": [read_summary],
        "timelines/rank_00000.json": [lambda _: read_timeline(timeline_path(run, 0))],
        "metrics.jsonl": [read_metrics, lambda r: keep_metrics_until(r, 1)],
    }[name]
    for read in [*readers, load_run]:
        assert_file_error(lambda p, read=read: read(run), path, *words)


def test_the_interrupted_line_survives_a_damaged_run_folder(run):
    """Ctrl-C's one line reads the metrics and the config: damaged, it still says where things stand."""
    damage(run / "metrics.jsonl", b"\xff\xfe\x00garbage\n")
    damage(run / "config.json", None)
    line = interrupted_message(run)
    assert line.startswith("interrupted at step 1; no complete checkpoint yet"), line


def test_a_worker_traceback_cut_mid_character_still_names_the_rank(tmp_path):
    """The launcher's line when torchrun cannot read a worker's error file comes from errors/rank_N.txt, which a
    rank stopped mid-write can leave with half a UTF-8 character."""
    from terapipe_cli.train.launch import Launch, describe_unreadable_failure

    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank_00001.txt").write_bytes("Traceback ...\nRuntimeError: a tile of 2 µ".encode()[:-1])
    line = describe_unreadable_failure(Launch(run_dir=tmp_path, nproc_per_node=2, stages=2))
    assert line.startswith("worker rank 1 (stage 1, replica 0) failed: RuntimeError: a tile of 2"), line
