"""`python -m prefixd` runs the CLI."""

from prefixd.cli import main

raise SystemExit(main())
