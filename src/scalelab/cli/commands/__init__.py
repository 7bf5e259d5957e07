"""One module per subcommand; importing this package registers them in COMMANDS."""

from scalelab.cli.commands import (  # noqa: F401
    bench,
    ceilings,
    demo,
    env,
    fit,
    layers,
    listing,
    phases,
    plan,
    predict,
    report,
    roofline,
    run,
    scaling,
    slurm,
    sweep,
    timeline,
    versions,
)
