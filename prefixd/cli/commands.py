"""What each `prefixd` command does, given its parsed flags and where its output goes. Online
work goes through the daemon that holds the store, offline work opens the store itself; commands
return an exit code and raise PrefixdError, and only `main` exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixd.cli.endpoints import Target, target
from prefixd.cli.output import Advance, Output
from prefixd.errors import ConfigError, PrefixdError, ServeError
from prefixd.store.purge import VERSIONED_FIELDS

if TYPE_CHECKING:
    from prefixd.config.settings import Config
    from prefixd.store import Store

POLL_S = 0.2  # how often a bar polls work that reports no progress of its own
UNKNOWN_NAME = 3  # exit code: a purge named a tenant or model the store does not hold
DURATION_UNITS = "ms, s, m, h, d"


def serve(args: argparse.Namespace, out: Output) -> int:
    from prefixd.config.sources import config_from_args

    config = config_from_args(args, os.environ)
    if args.print_config:
        if out.as_json:
            out.json(config.describe())
        else:
            out.stdout.write(config.toml())
        return 0
    return serve_config(config, reread=lambda: config_from_args(args, os.environ))


def serve_config(config: Config, reread: Callable[[], Config] | None = None) -> int:
    """Run a daemon on `config` until it stops: `serve`, and bench/tuned.py, which sets knobs
    serve does not list."""
    from prefixd.daemon.server import Server, run_server

    logging.basicConfig(
        level=config.metrics.log_level.upper(),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from prefixd.store.allocator import keep_write_buffers

    keep_write_buffers()  # the daemon owns its process: let LMDB reuse its write buffers
    server = Server(config, reread=reread)
    try:
        code = run_server(server)
    except OSError as exc:  # a data directory or socket path this user cannot have
        if isinstance(exc, (PrefixdError, BrokenPipeError)):
            raise
        from prefixd.cli.oserrors import explain

        flags = {config.store.data_dir: "--data-dir", config.socket.path: "--socket"}
        raise ServeError(explain(exc, os.environ, flags)) from None
    if server.abandoned:
        # Shutdown left store work running on threads past the grace period: end now, as a kill
        # would (LMDB keeps every committed transaction; the running ones never commit).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def stats(args: argparse.Namespace, out: Output) -> int:
    with _target(args, offline=False).client(args.timeout) as client:
        if args.watch is None:
            reply = _stats_of(client)
            if out.as_json:
                out.json(reply)
            else:
                from prefixd.cli.statsview import render

                out.show(render(reply))
            return 0
        return _watch_stats(client, args.watch, out)


def _answer(reply: dict[str, Any]) -> dict[str, Any]:
    """A daemon's reply as a command reports it: without the envelope's id and ok."""
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}


def _stats_of(client: Any) -> dict[str, Any]:
    reply = client.stats()
    return {k: reply[k] for k in ("store", "server", "metrics") if k in reply}


def _watch_stats(client: Any, every: float, out: Output) -> int:
    """JSON lines, or tables redrawn in place, every `every` seconds until interrupted."""
    from rich.live import Live

    from prefixd.cli.statsview import render

    if out.as_json:
        while True:
            out.stdout.write(json.dumps(_stats_of(client), sort_keys=True) + "\n")
            out.stdout.flush()
            time.sleep(every)
    with Live(render(_stats_of(client)), console=out.console, refresh_per_second=4) as live:
        while True:
            time.sleep(every)
            live.update(render(_stats_of(client)))


def health(args: argparse.Namespace, out: Output) -> int:
    where = _target(args, offline=False)
    with where.client(args.timeout) as client:
        report = {**_answer(client.health()), "socket": str(where.socket)}
    out.result(report, "prefixd health")
    return 0 if report.get("status") == "ok" else 1  # sync_failed: writes refused (the disk)


def verify(args: argparse.Namespace, out: Output) -> int:
    from prefixd.store import check_report

    if args.fix and args.no_payloads:
        raise ConfigError("--fix checks payloads too; drop --no-payloads")
    where = _target(args)
    if where.served:  # a daemon serves this store: it checks (and repairs) while serving
        with where.client(args.timeout) as client, out.progress("verifying through the daemon"):
            reply = client.verify(fix=args.fix, payloads=not args.no_payloads)
        report = {"mode": "online", "path": str(where.data_dir), **_answer(reply)}
    else:
        with (
            _opened(where) as store,
            out.progress("verifying", total=store.stats().blocks) as advance,
        ):
            found = check_report.verify(
                store, fix=args.fix, payloads=not args.no_payloads, progress=advance
            )
        report = {"mode": "offline", "path": str(where.data_dir), **found}
    out.result(report, "prefixd verify")
    return 1 if (report["remaining"] if args.fix else report["problems"]) else 0


def migrate_status(args: argparse.Namespace, out: Output) -> int:
    from prefixd.migrate import Migrator

    where = _target(args, probe=False)
    migrator = Migrator(where.data_dir, settings=where.config.store_config())
    out.result(migrator.status().describe(), "prefixd migrate status")
    return 0


def migrate_up(args: argparse.Namespace, out: Output) -> int:
    from prefixd.migrate import Migrator

    where = _target(args, probe=False)
    migrator = Migrator(where.data_dir, batch=args.batch, settings=where.config.store_config())
    with out.progress("migrating") as advance:
        report = migrator.upgrade(
            to=args.to,
            dry_run=args.dry_run,
            backup=args.backup,
            progress=lambda step, examined: advance(examined),
        )
    out.result(report.describe(), "prefixd migrate up")
    return 0


def purge(args: argparse.Namespace, out: Output) -> int:
    from prefixd.store import PurgeSelector

    older_than = None if args.older_than is None else _duration("--older-than", args.older_than)
    keep = {n: getattr(args, f"keep_{n}") for n in VERSIONED_FIELDS}
    criteria = {
        "tenant": args.tenant,
        "model": args.model,
        "keep": {n: v for n, v in keep.items() if v is not None},
        "older_than_s": older_than,
        "everything": args.all,
    }
    selector = PurgeSelector.from_dict(criteria)  # ConfigError names a bad criterion
    where = _target(args)
    if where.served:  # a daemon serves this store: ask it
        with where.client(args.timeout) as client, out.progress("purging through the daemon"):
            summary = _answer(client.purge(dry_run=args.dry_run, **selector.describe()))
        mode = "online"
    else:
        with (
            _opened(where) as store,
            out.progress("purging", total=None) as advance,
        ):
            summary = store.purge(
                selector, dry_run=args.dry_run, progress=advance, keep_known=True
            ).describe()
        mode = "offline"
    unknown = list(summary.get("unknown") or ())  # an older daemon does not say
    report = {"mode": mode, "path": str(where.data_dir), **summary, "unknown": unknown}
    out.result(report, "prefixd purge")
    if not unknown:
        return 0
    kept = " or ".join(f"{name} {value!r}" for name, value in selector.keep.items())
    named = {**criteria, "keep": f"version to keep ({kept}) of model {args.model!r}"}
    names = " and ".join(
        named["keep"] if field == "keep" else f"{field} {named[field]!r}" for field in unknown
    )
    if unknown == ["model"] and args.tenant is not None:
        names += f" of tenant {args.tenant!r}"
    print(f"prefixd: purge: the store {where.data_dir} holds no {names}", file=sys.stderr)
    return UNKNOWN_NAME


def _duration(flag: str, text: str) -> float:
    """A number and its unit; a bare 5 meant as days must not purge what idled 5 seconds."""
    from prefixd.store.config import parse_seconds

    try:
        bare = math.isfinite(float(text))
    except ValueError:
        bare = False
    if bare:
        n = text.strip()
        raise ConfigError(
            f"{flag} {text!r} has no unit: write {n}s, {n}m, {n}h or {n}d (units: {DURATION_UNITS})"
        )
    try:
        return parse_seconds(text)
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r} is not a duration (a number and its unit, one of {DURATION_UNITS}: "
            "like 30d or 12h)"
        ) from None


def compact(args: argparse.Namespace, out: Output) -> int:
    with _opened(_target(args, probe=False)) as store:
        used = store.stats().map_used_bytes
        with out.progress("compacting (bytes written)", total=used) as advance:
            report = _polled(lambda: store.compact_to(args.to), args.to / "data.mdb", advance)
    out.result(report, "prefixd compact")
    return 0


def _polled(work: Callable[[], dict[str, Any]], grows: Path, advance: Advance) -> dict[str, Any]:
    """Run `work`, advancing a bar by how much the file `grows` grows meanwhile."""
    done = threading.Event()

    def poll() -> None:
        seen = 0
        while not done.wait(POLL_S):
            size = grows.stat().st_size if grows.exists() else 0
            advance(size - seen)
            seen = size

    poller = threading.Thread(target=poll, name="prefixd-progress", daemon=True)
    poller.start()
    try:
        return work()
    finally:
        done.set()
        poller.join()


def completion(args: argparse.Namespace, out: Output) -> int:
    import shtab

    out.stdout.write(shtab.complete(args.parser(), shell=args.shell))
    return 0


def _target(args: argparse.Namespace, *, offline: bool = True, probe: bool = True) -> Target:
    """The store and daemon `args` name; `offline`: the command can work on the store itself;
    `probe` False: it works only offline (endpoints.target)."""
    timeout = min(args.timeout, 10.0)
    return target(args, os.environ, timeout=timeout, offline=offline, probe=probe)


def _opened(where: Target) -> Store:
    """The store, opened offline (exclusively) with the settings `serve` would use, never
    created."""
    from prefixd.store import Store

    settings = where.config.store_config()
    return Store(dataclasses.replace(settings, path=where.data_dir, create=False), exclusive=True)
