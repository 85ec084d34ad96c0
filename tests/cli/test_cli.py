"""The `terapipe` command itself: version, short help."""

from conftest import run_cli, terapipe

from terapipe_cli import __version__


def test_version_and_short_help(capsys):
    p = terapipe("--version")  # a real process; the help pages in this one
    assert p.returncode == 0 and p.stdout.strip() == f"terapipe {__version__}"
    for args in (("-h",), ("plan", "-h"), ("train", "-h")):
        p = run_cli(capsys, *args)
        assert p.returncode == 0 and "Usage: terapipe" in p.stdout, args


def test_configs_lists_the_bundled_names():
    from terapipe_cli.config.bundled import bundled_names

    p = terapipe("configs")
    assert p.returncode == 0, p.stderr
    for kind in ("models", "hardware", "experiments"):
        for name in bundled_names(kind):
            assert name in p.stdout, (kind, name)


def test_each_commands_line_in_the_help_is_a_whole_sentence():
    """`terapipe --help` shows each command's first paragraph: it must end a sentence, not stop at a colon."""
    import typer

    from terapipe_cli.cli import app

    for name, command in typer.main.get_command(app).commands.items():
        first = " ".join(command.help.split("\n\n")[0].split())
        assert first.endswith("."), (name, first)


def test_profile_help_says_model_takes_a_transformers_folder(capsys):
    from conftest import run_cli

    p = run_cli(capsys, "profile", "--help")
    assert p.returncode == 0 and "transformers folder" in " ".join(p.stdout.replace("│", " ").split()), p.stdout
