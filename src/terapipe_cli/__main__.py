from terapipe_cli.cli import main

main()
