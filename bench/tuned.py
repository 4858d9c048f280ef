"""`prefixd serve` with knobs serve does not list, for the benchmarks that compare against them
(eviction=lru, read_path=pread, cluster_client=inline, verified_cache_bytes=0):

    python bench/tuned.py NAME=VALUE ... -- SERVE-FLAGS

NAME is a setting's flat name (docs/settings.md's, or a deprecated one's), VALUE as its flag
writes it; the daemon is serve's own, on serve's settings with these changed."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from prefixd.cli import parser
from prefixd.cli.commands import serve_config
from prefixd.config.settings import Config
from prefixd.config.sources import config_from_args, parse_setting


def main(argv: Sequence[str]) -> int:
    cut = list(argv).index("--") if "--" in argv else len(argv)
    knobs = [item.partition("=") for item in argv[:cut]]
    tuned = {name: parse_setting(name, text, "bench/tuned.py") for name, _, text in knobs}
    args = parser().parse_args(["serve", *argv[cut + 1 :]])

    def settings() -> Config:
        return config_from_args(args, os.environ).with_settings(**tuned)

    return serve_config(settings(), reread=settings)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
