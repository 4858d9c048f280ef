"""`python -m prefixd.integrations.vllm --socket PATH [--tenant T] -- VLLM_SERVE_ARGS...` prints the
`--kv-transfer-config` JSON that puts prefixd behind `vllm serve` with those arguments: the tier's
identity is taken from the config vLLM builds from the same arguments, so pass exactly the ones
`vllm serve` gets (model, revision, dtype, KV cache dtype, block size, parallel sizes, ...).

    vllm serve MODEL --block-size 32 --kv-transfer-config "$(python -m prefixd.integrations.vllm \\
        --socket /run/prefixd/prefixd.sock --cpu-bytes 8GiB -- --model MODEL --block-size 32)"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from prefixd.integrations.vllm import kv_transfer_config
from prefixd.store.config import parse_size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, engine_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        prog="python -m prefixd.integrations.vllm", description=__doc__
    )
    parser.add_argument("--socket", required=True, help="the prefixd daemon's socket")
    parser.add_argument("--tenant", default="default")
    parser.add_argument(
        "--cpu-bytes", default="4GiB", help="vLLM's CPU primary tier (cpu_bytes_to_use)"
    )
    args = parser.parse_args(ours)

    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout: only the JSON goes there
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        engine_parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
        engine = EngineArgs.from_cli_args(engine_parser.parse_args(engine_argv))
        config = kv_transfer_config(
            engine,
            socket=args.socket,
            tenant=args.tenant,
            extra_config={"cpu_bytes_to_use": parse_size(args.cpu_bytes)},
        )
    settings = {
        "kv_connector": config.kv_connector,
        "kv_role": config.kv_role,
        "kv_connector_extra_config": config.kv_connector_extra_config,
    }
    print(json.dumps(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
