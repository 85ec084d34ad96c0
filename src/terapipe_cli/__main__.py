from terapipe_cli.cli import entry

entry()
