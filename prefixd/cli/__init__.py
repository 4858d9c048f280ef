"""prefixd keeps an LLM inference engine's prompt state (closed blocks of prefix KV cache and
hybrid-model state, addressed by a chain hash over exact token ids under a full model identity) on
local disk, verified, so that after a restart or a GPU-cache miss the engine loads it instead of
prefilling again. `serve` runs the daemon beside the engine; the other commands inspect and
maintain it and its store.

Every command reads the same settings as `serve`: flags, PREFIXD_* variables and a --config TOML
file (`prefixd serve --print-config` writes one). A command told only a data directory finds the
daemon that serves it, and one told only a socket finds its store.

Exit codes: 0 done, 1 failed (or problems found), 2 bad arguments or settings, 3 a purge named a
tenant or model the store does not hold.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixd.cli import commands
from prefixd.cli.arguments import add_daemon_arguments, positive
from prefixd.cli.output import Output
from prefixd.errors import ConfigError, PrefixdError
from prefixd.store.config import parse_seconds
from prefixd.store.purge import VERSIONED_FIELDS
from prefixd.version import __version__

USAGE_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the only place in prefixd that decides the process's exit code."""
    args = parser().parse_args(argv)  # bad flags: argparse prints usage and exits 2
    if not hasattr(args, "command"):
        parser().print_help(sys.stderr)
        return USAGE_ERROR
    out = Output(as_json=getattr(args, "json", False), quiet=getattr(args, "quiet", False))
    try:
        return int(args.command(args, out))
    except PrefixdError as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return USAGE_ERROR if isinstance(exc, ConfigError) else 1  # a bad value: like a bad flag
    except BrokenPipeError:  # the reader left (| head): nothing more to say, and no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail
        return 1
    except OSError as exc:  # a path that is not what the command needs (a file, no access)
        from prefixd.cli.oserrors import explain

        print(f"prefixd: {explain(exc, os.environ)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def parser() -> argparse.ArgumentParser:
    """The whole command line (also what shell completion is generated from)."""
    from prefixd.config.sources import add_arguments

    top = Parser(
        prog="prefixd",
        description=__doc__.split("\n\n")[0].replace("\n", " ") if __doc__ else None,
        epilog="Exit codes: 0 done, 1 failed or problems found, 2 bad arguments or settings, "
        "3 a purge named a tenant or model the store does not hold. "
        "Run `prefixd COMMAND --help` for a command's flags.",
    )
    top.add_argument("--version", action="version", version=f"prefixd {__version__}")
    sub = top.add_subparsers(metavar="COMMAND", title="commands")

    serve = sub.add_parser(
        "serve",
        help="run the daemon on a Unix socket",
        description="Run the daemon: open (or create) the store, listen on the socket, serve "
        "until SIGTERM or SIGINT, shut down within the grace period.",
    )
    add_arguments(serve)
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings as a TOML file --config accepts (JSON with --json), "
        "and exit",
    )
    serve.add_argument("--json", action="store_true", help="with --print-config: print JSON")
    serve.set_defaults(command=commands.serve)

    online = _common(online=True)
    offline = _common(online=False)

    stats = sub.add_parser(
        "stats",
        parents=[online],
        help="print the daemon's statistics (hit rates, latencies, "
        "what the store holds per tenant)",
    )
    stats.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted (JSON lines with --json)",
    )
    stats.set_defaults(command=commands.stats, timeout=10.0)

    health = sub.add_parser("health", parents=[online], help="check that the daemon answers")
    health.set_defaults(command=commands.health, timeout=10.0)

    verify = sub.add_parser(
        "verify",
        parents=[online],
        help="check a store and list every problem (exit 1 if any)",
        description="Through the daemon when one serves the store (service goes on), offline "
        "otherwise. Exit codes: 0 healthy (or repaired), 1 problems, 2 bad arguments.",
    )
    verify.add_argument(
        "--no-payloads", action="store_true", help="skip payload checksums (metadata only)"
    )
    verify.add_argument(
        "--fix",
        action="store_true",
        help="quarantine what is broken (each block with everything below it) and rebuild the "
        "indexes and counters",
    )
    verify.set_defaults(command=commands.verify)

    purge = sub.add_parser(
        "purge",
        parents=[online],
        help="remove a tenant, retired model versions or idle entries",
        description="Online through the daemon when one serves the store, offline otherwise. "
        "Exit codes: 0 done (or nothing to do), 1 error, 2 bad arguments, 3 the store holds no "
        "tenant or model of the name given, or no version to keep of the model (nothing "
        "removed).",
    )
    purge.add_argument("--tenant", help="remove every entry of this tenant")
    purge.add_argument("--model", help="retire versions of this model")
    for name in VERSIONED_FIELDS:
        purge.add_argument(
            f"--except-{name.replace('_', '-')}",
            dest=f"keep_{name}",
            metavar="VERSION",
            help=f"with --model: keep the entries whose {name} is VERSION",
        )
    purge.add_argument(
        "--older-than",
        metavar="DURATION",
        help="only entries idle this long: a number and its unit (ms, s, m, h or d), like 30d",
    )
    purge.add_argument("--all", action="store_true", help="remove everything")
    purge.add_argument("--dry-run", action="store_true", help="count what would go; change nothing")
    purge.set_defaults(command=commands.purge)

    compact = sub.add_parser(
        "compact",
        parents=[offline],
        help="write a compacted copy of a store (offline: the daemon must be stopped)",
    )
    compact.add_argument("--to", type=Path, required=True, help="an empty directory for the copy")
    compact.set_defaults(command=commands.compact)

    migrate = sub.add_parser("migrate", help="show or apply on-disk schema migrations")
    steps = migrate.add_subparsers(metavar="ACTION", required=True, title="actions")
    status = steps.add_parser(
        "status", parents=[offline], help="the store's version and the pending steps"
    )
    status.set_defaults(command=commands.migrate_status)
    up = steps.add_parser(
        "up", parents=[offline], help="apply pending steps (the daemon must be stopped)"
    )
    up.add_argument("--to", type=int, help="stop at this version (default: the latest)")
    up.add_argument("--dry-run", action="store_true", help="change nothing; say what would change")
    up.add_argument("--backup", type=Path, help="copy the store here (compacted) first")
    up.add_argument("--batch", type=int, default=10_000, help="items per transaction")
    up.set_defaults(command=commands.migrate_up)

    from prefixd.cli import doctor

    doctor.add_parser(sub)  # check the node as an engine's user sees it

    completion = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for bash or zsh, e.g. "
        "`prefixd completion bash > /etc/bash_completion.d/prefixd` or "
        '`prefixd completion zsh > "${fpath[1]}/_prefixd"`.',
    )
    completion.add_argument("shell", choices=("bash", "zsh"))
    completion.set_defaults(command=commands.completion, parser=parser)  # the whole parser, anew
    return top


class Parser(argparse.ArgumentParser):
    """argparse's parser, taking no abbreviation of a long flag: a typo such as `purge --a` is
    refused instead of meaning `--all`. Subcommands' parsers are of this class too
    (add_subparsers makes them of the class of the parser it is called on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def _common(*, online: bool) -> Parser:
    """The flags every maintenance command shares: which store and daemon, and how to print."""
    common = Parser(add_help=False)
    where = common.add_argument_group("which store and daemon (as serve: flags, PREFIXD_*, TOML)")
    add_daemon_arguments(where, data_dir=True)
    if online:
        where.add_argument(
            "--timeout",
            type=positive(parse_seconds, "a number of seconds", "seconds"),
            default=3600.0,
            metavar="SECONDS",
            help="how long to wait for the daemon's reply, in seconds (default 10 for stats and"
            " health, 3600 for verify and purge)",
        )
    else:
        common.set_defaults(timeout=10.0)
    shown = common.add_argument_group("output")
    shown.add_argument("--json", action="store_true", help="print JSON, for scripts")
    shown.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    return common
