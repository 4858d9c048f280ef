"""The `prefixd` command: serve, stats, health, verify. The only place that exits the process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prefixd import __version__
from prefixd.errors import PrefixdError
from prefixd.store.purge import VERSIONED_FIELDS


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "command"):
        parser.print_help()
        return 2
    try:
        return int(args.command(args))
    except PrefixdError as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    from prefixd.daemon.config import add_arguments

    parser = argparse.ArgumentParser(prog="prefixd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"prefixd {__version__}")
    commands = parser.add_subparsers(metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the daemon")
    add_arguments(serve)
    serve.add_argument(
        "--print-config", action="store_true", help="print the effective settings and exit"
    )
    serve.set_defaults(command=_serve)

    for name, run, text in (
        ("stats", _stats, "print the daemon's statistics (tables; --json for scripts)"),
        ("health", _health, "check that the daemon answers"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--socket", type=Path, help="the daemon's socket (default: as serve)")
        sub.add_argument("--timeout", type=float, default=10.0)
        if name == "stats":
            sub.add_argument("--json", action="store_true", help="print JSON, for scripts")
            sub.add_argument(
                "--watch",
                type=float,
                nargs="?",
                const=2.0,
                metavar="SECONDS",
                help="refresh every SECONDS (default 2) until interrupted",
            )
        sub.set_defaults(command=run)

    migrate = commands.add_parser("migrate", help="show or apply on-disk schema migrations")
    steps = migrate.add_subparsers(metavar="ACTION", required=True)
    status = steps.add_parser("status", help="the store's version and the pending steps")
    status.add_argument("--data-dir", type=Path, help="the store (default: as serve)")
    status.set_defaults(command=_migrate_status)
    up = steps.add_parser("up", help="apply pending steps (the daemon must be stopped)")
    up.add_argument("--data-dir", type=Path, help="the store (default: as serve)")
    up.add_argument("--to", type=int, help="stop at this version (default: the latest)")
    up.add_argument("--dry-run", action="store_true", help="change nothing; say what would change")
    up.add_argument("--backup", type=Path, help="copy the store here (compacted) first")
    up.add_argument("--batch", type=int, default=10_000, help="items per transaction")
    up.set_defaults(command=_migrate_up)

    purge = commands.add_parser(
        "purge",
        help="remove a tenant, retired model versions or idle entries",
        description="Online through the daemon when one holds the store, offline otherwise. "
        "Exit codes: 0 done (or nothing to do), 1 error, 2 bad arguments.",
    )
    purge.add_argument("--data-dir", type=Path, help="the store (default: as serve)")
    purge.add_argument("--socket", type=Path, help="the daemon's socket (default: as serve)")
    purge.add_argument("--tenant", help="remove every entry of this tenant")
    purge.add_argument("--model", help="retire versions of this model")
    for name in VERSIONED_FIELDS:
        purge.add_argument(
            f"--except-{name.replace('_', '-')}",
            dest=f"keep_{name}",
            metavar="VERSION",
            help=f"with --model: keep the entries whose {name} is VERSION",
        )
    purge.add_argument("--older-than", metavar="DURATION", help="only entries idle this long (30d)")
    purge.add_argument("--all", action="store_true", help="remove everything")
    purge.add_argument("--dry-run", action="store_true", help="count what would go; change nothing")
    purge.set_defaults(command=_purge)

    compact = commands.add_parser(
        "compact", help="write a compacted copy of a store (offline: the daemon must be stopped)"
    )
    compact.add_argument("--data-dir", type=Path, help="the store (default: as serve)")
    compact.add_argument("--to", type=Path, required=True, help="an empty directory for the copy")
    compact.set_defaults(command=_compact)

    verify = commands.add_parser(
        "verify",
        help="check a store and list every problem (exit 1 if any)",
        description="Through the daemon when one holds the store (service goes on), offline "
        "otherwise. Exit codes: 0 healthy (or repaired), 1 problems, 2 bad arguments.",
    )
    verify.add_argument("--data-dir", type=Path, help="the store (default: as serve)")
    verify.add_argument("--socket", type=Path, help="the daemon's socket (default: as serve)")
    verify.add_argument(
        "--no-payloads", action="store_true", help="skip payload checksums (metadata only)"
    )
    verify.add_argument(
        "--fix",
        action="store_true",
        help="quarantine what is broken (each block with everything below it) and rebuild the "
        "indexes and counters",
    )
    verify.set_defaults(command=_verify)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from prefixd.daemon.config import config_from_args
    from prefixd.daemon.server import Server, run_server

    config = config_from_args(args, os.environ)
    if args.print_config:
        print(json.dumps(config.describe(), indent=2, sort_keys=True))
        return 0
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from prefixd.store.allocator import keep_write_buffers

    keep_write_buffers()  # the daemon owns its process: let LMDB reuse its write buffers
    server = Server(config)
    code = run_server(server)
    if server.abandoned:
        # Shutdown left store work running on threads past the grace period: end now, as a kill
        # would (LMDB keeps every committed transaction; the running ones never commit).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _default_socket(args: argparse.Namespace) -> Path:
    from prefixd.daemon.config import default_socket

    return args.socket or default_socket(os.environ)


def _stats(args: argparse.Namespace) -> int:
    from prefixd.client import Client

    with Client(_default_socket(args), timeout=args.timeout) as client:
        if args.json and not args.watch:
            reply = client.stats()
            shown = {k: reply[k] for k in ("store", "server", "metrics") if k in reply}
            print(json.dumps(shown, indent=2, sort_keys=True))
            return 0
        return _show_stats(client, args.watch, as_json=args.json)


def _show_stats(client: Any, watch: float | None, *, as_json: bool) -> int:
    """Tables (or JSON lines), once or every `watch` seconds until interrupted."""
    import time

    from rich.console import Console
    from rich.live import Live

    from prefixd.cli.statsview import render  # the tables, kept apart from the commands

    console = Console()
    if watch is None:
        console.print(render(client.stats()))
        return 0
    if as_json:
        while True:
            reply = client.stats()
            print(json.dumps({k: reply[k] for k in ("store", "server", "metrics")}), flush=True)
            time.sleep(watch)
    with Live(render(client.stats()), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(watch)
            live.update(render(client.stats()))


def _health(args: argparse.Namespace) -> int:
    from prefixd.client import Client

    with Client(_default_socket(args), timeout=args.timeout) as client:
        reply = client.health()
    print(json.dumps({k: v for k, v in reply.items() if k not in ("id", "ok")}, sort_keys=True))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefixd.store import Store
    from prefixd.store.check_process import run_check
    from prefixd.store.check_report import verify_report
    from prefixd.store.environment import is_held
    from prefixd.store.results import RepairReport

    if args.fix and args.no_payloads:
        print("prefixd: --fix checks payloads too; drop --no-payloads", file=sys.stderr)
        return 2
    path = _data_dir(args)
    if is_held(path):  # a daemon serves this store: it checks (and repairs) while serving
        from prefixd.client import Client

        with Client(_default_socket(args), timeout=3600) as client:
            reply = client.verify(fix=args.fix, payloads=not args.no_payloads)
        report = {"mode": "online", "path": str(path), **reply}
    else:
        with Store.open(path, create=False, exclusive=True) as store:
            blocks, parts = store.stats().blocks, store.stats().parts
            with tqdm(total=blocks, desc="verifying", unit=" blocks", file=sys.stderr) as bar:
                # in a child: LMDB may abort the process that meets a damaged page
                payloads = not args.no_payloads
                problems = run_check(path, verify_payloads=payloads, progress=bar.update)
            mendable = not any(p.kind == "pages" for p in problems)
            if args.fix and mendable:
                report = verify_report(blocks, parts, fixed=store.repair(problems))
            elif args.fix:
                unfixed = RepairReport(len(problems), 0, 0, tuple(problems))
                report = verify_report(blocks, parts, fixed=unfixed)
            else:
                report = verify_report(blocks, parts, problems=problems)
        report = {"mode": "offline", "path": str(path), **report}
    print(json.dumps(report, indent=2))
    return 1 if (report["remaining"] if args.fix else report["problems"]) else 0


def _data_dir(args: argparse.Namespace) -> Path:
    from prefixd.daemon.config import default_data_dir

    return Path(args.data_dir or default_data_dir(os.environ))


def _migrate_status(args: argparse.Namespace) -> int:
    from prefixd.migrate import Migrator

    print(json.dumps(Migrator(_data_dir(args)).status().describe(), indent=2))
    return 0


def _migrate_up(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefixd.migrate import Migrator

    migrator = Migrator(_data_dir(args), batch=args.batch)
    bars: dict[int, Any] = {}

    def progress(step: Any, examined: int) -> None:
        bar = bars.get(step.version)
        if bar is None:
            bar = bars[step.version] = tqdm(desc=f"to version {step.version}", unit=" items")
        bar.update(examined)

    try:
        report = migrator.upgrade(
            to=args.to, dry_run=args.dry_run, backup=args.backup, progress=progress
        )
    finally:
        for bar in bars.values():
            bar.close()
    print(json.dumps(report.describe(), indent=2))
    return 0


def _purge(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prefixd.store import PurgeSelector, Store
    from prefixd.store.config import parse_seconds
    from prefixd.store.environment import is_held

    try:
        older_than = parse_seconds(args.older_than) if args.older_than is not None else None
    except ValueError:
        print(f"prefixd: --older-than {args.older_than!r} is not a duration", file=sys.stderr)
        return 2
    keep = {n: getattr(args, f"keep_{n}") for n in VERSIONED_FIELDS}
    criteria = {
        "tenant": args.tenant,
        "model": args.model,
        "keep": {n: v for n, v in keep.items() if v is not None},
        "older_than_s": older_than,
        "everything": args.all,
    }
    try:
        selector = PurgeSelector.from_dict(criteria)
    except PrefixdError as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 2
    path = _data_dir(args)
    if is_held(path):  # a daemon serves this store: ask it
        from prefixd.client import Client

        with Client(_default_socket(args)) as client:
            reply = client.purge(dry_run=args.dry_run, **selector.describe())
        summary = {k: v for k, v in reply.items() if k not in ("id", "ok")}
        mode = "online"
    else:
        with (
            Store.open(path, create=False, exclusive=True) as store,
            tqdm(desc="purging", unit=" roots", disable=args.dry_run) as bar,
        ):
            summary = store.purge(selector, dry_run=args.dry_run, progress=bar.update).describe()
        mode = "offline"
    print(json.dumps({"mode": mode, "path": str(path), **summary}, indent=2))
    return 0


def _compact(args: argparse.Namespace) -> int:
    from prefixd.store import Store

    source = _data_dir(args)
    with Store.open(source, create=False, exclusive=True) as store:
        report = store.compact_to(args.to)
    print(json.dumps(report, indent=2))
    return 0
