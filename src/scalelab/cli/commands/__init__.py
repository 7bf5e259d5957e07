"""One module per subcommand; importing this package registers them in COMMANDS."""

from scalelab.cli.commands import demo, env, layers, listing, run  # noqa: F401
