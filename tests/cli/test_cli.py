"""The `terapipe` command itself: version, short help."""

from conftest import terapipe

from terapipe_cli import __version__


def test_version_and_short_help():
    p = terapipe("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"terapipe {__version__}"
    for args in (("-h",), ("plan", "-h"), ("train", "-h")):
        p = terapipe(*args)
        assert p.returncode == 0 and "Usage: terapipe" in p.stdout, args


def test_configs_lists_the_bundled_names():
    from terapipe_cli.config.bundled import bundled_names

    p = terapipe("configs")
    assert p.returncode == 0, p.stderr
    for kind in ("models", "hardware", "experiments"):
        for name in bundled_names(kind):
            assert name in p.stdout, (kind, name)
