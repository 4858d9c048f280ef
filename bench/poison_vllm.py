"""The poison suite's vLLM rows: each silent wrong-KV failure vLLM's offloading has had, run
through prefixd's tier and through vLLM's own file tier ("fs") on the same bytes.

Run in the vLLM venv (.ci/vllm-venv), from the repository root:

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/poison_vllm.py [--json]

In each scenario engine A stores a prompt's KV and engine B, the same but for one change, asks for
the same prompt. Each engine is built as vLLM builds one at start: its VllmConfig from EngineArgs
(a tiny seeded model in a directory, or in a Hugging Face cache and named by repo id as an online
engine names it: tests/integrations/vllm/hub_cache.py), the KV cache layout resolved as the
engine core resolves it, the attention specs its workers report, and vLLM's own
`build_offloading_config`; the tier's settings come from
`prefixd.integrations.vllm.kv_transfer_config`, so prefixd's identity is the one a real engine's
tier gets. The offloading itself is vLLM's TieringOffloadingSpec and TieringOffloadingManager over
a CPU primary tier (tests/integrations/vllm/harness.py), the keys vLLM's own block hashes of the
prompt, which no change here alters (B asks for A's keys).

What B is served is judged against the bytes its own KV cache would hold for the prompt. Where
the change only moves A's KV around (KV layout, tensor-parallel size) those bytes are A's KV laid
out as B lays it (`direct_rows`); where it changes the KV itself (RoPE, revision, weights, dtype)
nothing of A's is right for B. With a LoRA adapter the keys carry it as vLLM's scheduler puts it
(its name and path), and the tier is told the adapters the engine serves (`lora_modules`, as
`vllm serve --lora-modules` names them). Before B, a fresh engine with A's configuration loads
the prompt from each tier (the control): a tier that never served would pass for a safe one. In
the at-rest scenario B is A, and between the control and B one byte of a stored block is flipped
where the tier keeps it on disk (bit rot, a bad sector): the right answer is the blocks before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
if __name__ == "__main__":  # vLLM logs to stdout unless told, and stdout is the report
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import torch
from poisonlib import Outcome, Row, files_under, judge, main, rot, store_files
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, hash_block_tokens, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from prefixd.integrations.vllm import kv_transfer_config
from tests.integrations.vllm.harness import TOKENS_PER_BLOCK, Engine, context
from tests.integrations.vllm.hub_cache import publish, serving
from tests.integrations.vllm.tiny_model import VOCAB, build_tiny_model, write_lora_adapter

PROMPT_BLOCKS = 4  # the prompt's closed blocks (one per chunk)
GPU_BLOCKS = 64  # the KV cache the engine's workers report room for
CPU_BYTES = 4 << 20  # the primary CPU tier
HUB_MODEL = "poison/tiny"  # a model named by its hub repo id (tests/integrations/vllm/hub_cache.py)
LAYOUT_VARIABLE = "VLLM_KV_CACHE_LAYOUT"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Config:
    """One engine: EngineArgs changes from the base engine, the KV cache layout asked for
    (VLLM_KV_CACHE_LAYOUT, None: the engine core's choice), the dtypes its platform supports
    (None: this machine's), the seed of its model's weights, the commit the hub's `main`
    names when the model is named by repo id (None: a local directory), and the seed of the
    weights of the LoRA adapter its prompt is served with (None: no adapter)."""

    changes: dict[str, Any] = field(default_factory=dict)
    layout: str | None = None
    platform_dtypes: tuple[str, ...] | None = None
    weights: int = 0
    commit: str | None = None
    lora: int | None = None


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str
    where: str
    a: Config
    b: Config
    moves_kv: bool  # B's right bytes are A's KV laid out B's way (else none of A's are right)
    rots: bool = False  # a byte of a stored block flips on disk before B asks


ROTTEN_BLOCK = 1  # the block whose stored bytes rot: the right answer is the one before it
LORA_NAME = "sql"  # the adapter's name (--lora-modules sql=PATH)


# A GPU engine's attention backend (FlashAttention takes any layout, as in vllm#55904); the CPU
# backend takes only LBHNC, so on CPU the layout could not differ at all.
BACKENDS = (FlashAttentionBackend,)

SCENARIOS = (
    Scenario(
        "layout",
        "KV cache layout changed (LBNHC to LBHNC)",
        "vllm#55904",
        Config(layout="NHD"),
        Config(),  # the offloading connector's preference: HND (LBHNC)
        moves_kv=True,
    ),
    Scenario(
        "rope",
        "RoPE scaling changed",
        "vllm#56311",
        Config(),
        Config({"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}),
        moves_kv=False,
    ),
    Scenario(
        "tp",
        "tensor-parallel size changed (1 to 2)",
        "vllm PR #55191",
        Config(),
        Config({"tensor_parallel_size": 2}),
        moves_kv=True,
    ),
    Scenario(
        "revision",
        "model revision changed (the hub's main moved to new weights)",
        "vllm#49261",
        Config(commit="a" * 40),
        Config(commit="b" * 40, weights=1),
        moves_kv=False,
    ),
    Scenario(
        "weights",
        "model weights changed in place (same directory)",
        "vllm#49261",
        Config(),
        Config(weights=1),
        moves_kv=False,
    ),
    Scenario(
        "dtype",
        "dtype auto resolved differently (bfloat16 to float16)",
        "vllm PR #49438",
        Config({"dtype": "auto"}),
        Config({"dtype": "auto"}, platform_dtypes=("float16", "float32")),  # a host without bf16
        moves_kv=False,
    ),
    Scenario(
        "lora",
        "a LoRA adapter retrained in place (same name and path)",
        "measured here",
        Config(lora=0),
        Config(lora=1),
        moves_kv=False,
    ),
    Scenario(
        "rot",
        "a byte of a stored block flipped on disk (bit rot)",
        "vllm PR #57912",
        Config(),
        Config(),
        moves_kv=True,
        rots=True,
    ),
)


@contextlib.contextmanager
def platform(config: Config, work: Path) -> Iterator[None]:
    """The process as it is on `config`'s host: its VLLM_KV_CACHE_LAYOUT, its platform's
    dtypes (vLLM resolves dtype "auto" to the first one the platform supports), its Hugging
    Face cache (`work`/hub) where the model is named by repo id."""
    saved = os.environ.pop(LAYOUT_VARIABLE, None)
    if config.layout is not None:
        os.environ[LAYOUT_VARIABLE] = config.layout
    try:
        with contextlib.ExitStack() as stack:
            if config.commit is not None:
                stack.enter_context(serving(work / "hub"))
            if config.platform_dtypes is not None:
                dtypes = [_DTYPES[name] for name in config.platform_dtypes]
                stack.enter_context(
                    mock.patch.object(
                        type(current_platform),
                        "supported_dtypes",
                        new_callable=mock.PropertyMock,
                        return_value=dtypes,
                    )
                )
            yield
    finally:
        os.environ.pop(LAYOUT_VARIABLE, None)
        if saved is not None:
            os.environ[LAYOUT_VARIABLE] = saved


def install(work: Path, config: Config) -> str:
    """`config`'s model and LoRA adapter, written where its engine finds them (over what was
    there: a new revision in place, or the hub's `main` moved); how the engine names the model."""
    if config.lora is not None:
        write_lora_adapter(lora_path(work), np.random.default_rng(config.lora).bytes(4096))
    if config.commit is None:
        return str(build_tiny_model(work / "model", seed=config.weights))
    publish(work / "hub", HUB_MODEL, config.commit, seed=config.weights)
    return HUB_MODEL


def lora_path(work: Path) -> Path:
    return work / "lora"


def lora_modules(work: Path, config: Config) -> dict[str, str]:
    """The adapters the engine serves by name, as `vllm serve --lora-modules` names them."""
    return {} if config.lora is None else {LORA_NAME: str(lora_path(work))}


def engine_args(model: str, config: Config, tier: KVTransferConfig | None = None) -> EngineArgs:
    """The engine's arguments; `tier`: its KV transfer config (the base engine's otherwise)."""
    args = EngineArgs(
        model=model,
        block_size=TOKENS_PER_BLOCK,
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="float32",
    )
    lora = {} if config.lora is None else {"enable_lora": True}
    return dataclasses.replace(args, **config.changes, **lora, kv_transfer_config=tier)


@dataclass(frozen=True)
class Started:
    """An engine's VllmConfig, its scheduler-side offloading (the harness's Engine) and the
    extra keys vLLM's scheduler hashes into each block of its prompt (its LoRA adapter's)."""

    vllm_config: VllmConfig
    engine: Engine
    extra_keys: tuple[Any, ...] | None


def start(work: Path, config: Config, tier: Transfer) -> Started:
    """An engine's scheduler-side offloading, built from its VllmConfig as the engine core
    builds it; `tier`: the KV transfer config (prefixd's from kv_transfer_config)."""
    model = install(work, config)
    modules = lora_modules(work, config)
    with platform(config, work):
        transfer = tier(engine_args(model, config), modules)
        transfer.engine_id = f"poison-{uuid.uuid4().hex[:8]}"  # a primary region of its own
        vllm_config = engine_args(model, config, transfer).create_engine_config()
        specs = attention_specs(vllm_config)
        world = vllm_config.parallel_config.world_size
        layouts = [layout.name for layout in get_supported_kv_cache_layouts(BACKENDS)]
        resolve_kv_cache_layout(vllm_config, [layouts] * world, specs.values())
        room = GPU_BLOCKS * sum(spec.page_size_bytes for spec in specs.values())
        kv_cache_configs = get_kv_cache_configs(vllm_config, [specs] * world, [room] * world)
    spec = TieringOffloadingSpec(build_offloading_config(vllm_config, kv_cache_configs[0]))
    # a request's adapter, as vLLM's scheduler hashes it (_gen_lora_extra_hash_keys)
    extra = tuple(("lora", name, path) for name, path in modules.items()) or None
    return Started(vllm_config, Engine(spec, spec.get_manager()), extra)


def attention_specs(vllm_config: VllmConfig) -> dict[str, FullAttentionSpec]:
    """What each worker reports of its attention layers (a Llama's full attention)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        dtype=model.dtype,  # cache dtype "auto"
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(model.get_num_layers(parallel))}


# An engine's KV transfer config, from its arguments and the LoRA adapters it serves by name.
Transfer = Callable[[EngineArgs, Mapping[str, str]], KVTransferConfig]


@dataclass(frozen=True)
class Tier:
    """A tier under test: the KV transfer config an engine gets (prefixd's from
    kv_transfer_config), and the files it keeps its blocks in."""

    transfer: Transfer
    files: Callable[[], Iterable[Path]]


def prefixd_tier(socket: str, data_dir: Path) -> Tier:
    """prefixd's tier, through the daemon at `socket` whose store is `data_dir`."""

    def transfer(args: EngineArgs, modules: Mapping[str, str]) -> KVTransferConfig:
        return kv_transfer_config(
            args,
            socket=socket,
            lora_modules=modules,
            extra_config={"cpu_bytes_to_use": CPU_BYTES},
        )

    return Tier(transfer, store_files(data_dir))


def fs_tier(root_dir: Path) -> Tier:
    """vLLM's file tier on `root_dir` (as bench/vllm_bench.py sets it up)."""

    def transfer(args: EngineArgs, modules: Mapping[str, str]) -> KVTransferConfig:
        extra = {  # the file tier is told nothing of adapters
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CPU_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir)}],
        }
        return KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )

    return Tier(transfer, files_under(root_dir))


def prompt_keys(started: Started, tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of `tokens` (as its scheduler hashes a request), as offload keys."""
    group = started.engine.spec.config.groups[0].group_id
    hash_fn = get_hash_fn_by_name(started.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    keys, parent = [], None
    for at in range(0, len(tokens) - TOKENS_PER_BLOCK + 1, TOKENS_PER_BLOCK):
        block = tokens[at : at + TOKENS_PER_BLOCK]
        parent = hash_block_tokens(hash_fn, parent, block, started.extra_keys)
        keys.append(make_offload_key(parent, group))
    return keys


def logical_kv(started: Started, seed: int) -> torch.Tensor:
    """A prompt's KV as the model computes it, per block: [block, layer, K|V, head, token, dim]."""
    vllm_config = started.vllm_config
    model = vllm_config.model_config
    shape = (
        PROMPT_BLOCKS,
        model.get_num_layers(vllm_config.parallel_config),
        2,
        model.get_total_num_kv_heads(),
        TOKENS_PER_BLOCK,
        model.get_head_size(),
    )
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(model.dtype)


def direct_rows(engine: Engine, kv: torch.Tensor) -> list[bytes]:
    """`kv` as `engine`'s primary-tier rows hold it in vLLM's direct layout: each worker's
    slice in rank order, and in it each layer's K and V pages, the heads the worker holds in
    the resolved layout's order (LBHNC: head-major; LBNHC: token-major)."""
    config = engine.spec.config
    tp = config.parallel.tp_size
    head_major = config.kv_cache_layout == "LBHNC"
    row_bytes = config.worker_kv_bytes_per_block * config.parallel.world_size
    rows = []
    for block in kv:
        parts = []
        for heads in block.chunk(tp, dim=2):  # [layer, K|V, worker's heads, token, dim]
            pages = heads if head_major else heads.transpose(2, 3)
            parts.append(pages.contiguous().view(torch.uint8).reshape(-1))
        row = torch.cat(parts).numpy().tobytes()
        if len(row) != row_bytes:  # the engine's workers would hold other bytes than these
            raise ValueError(f"{len(row)} bytes of KV per block, vLLM's workers {row_bytes}")
        rows.append(row.ljust(engine.spec.kv_bytes_per_chunk, b"\0"))
    return rows


@dataclass(frozen=True)
class Served:
    """What a tier served: B's outcome, and the control's (a fresh engine like A)."""

    outcome: Outcome
    control: Outcome
    blocks: int  # how many of the prompt's blocks B was served


def serve(work: Path, scenario: Scenario, tier: Tier, seed: int) -> Served:
    """A stores the prompt's KV through `tier`; a fresh A loads it (the control); B, its model
    installed over A's, asks (`work`: where the models are)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, PROMPT_BLOCKS * TOKENS_PER_BLOCK + 7).tolist()
    started: list[Started] = []

    def engine(config: Config) -> Started:
        started.append(start(work, config, tier.transfer))
        return started[-1]

    try:
        writer = engine(scenario.a)
        keys = prompt_keys(writer, tokens)
        kv = logical_kv(writer, seed)
        stored = direct_rows(writer.engine, kv)
        writer.engine.store(context("a", keys), keys, stored)
        again = engine(scenario.a).engine
        control = judged(b"".join(stored), again.load(context("a2", keys), keys))
        if scenario.rots:
            rot(tier.files(), stored[ROTTEN_BLOCK])
        reader = engine(scenario.b)
        if prompt_keys(reader, tokens) != keys:
            raise AssertionError(f"{scenario.name}: B's block hashes differ from A's")
        expected = b"".join(direct_rows(reader.engine, kv)) if scenario.moves_kv else None
        served = reader.engine.load(context("b", keys), keys)
        return Served(judged(expected, served), control, len(served))
    finally:
        for each in started:
            each.engine.close()


def judged(expected: bytes | None, served: list[bytes]) -> Outcome:
    """`served` (the rows of the prompt's leading blocks found) against `expected`, the right
    rows of the whole prompt (None: none are right)."""
    if not served:
        return judge(expected, None)
    got = b"".join(served)
    return judge(None if expected is None else expected[: len(got)], got)


@dataclass(frozen=True)
class Result:
    row: Row
    controls: dict[str, Outcome]  # tier: the control's outcome
    blocks: dict[str, int]  # tier: how many blocks B was served


def run(scenario: Scenario, prefixd: Tier, root: Path, seed: int) -> Result:
    """`scenario` through prefixd's tier and through vLLM's file tier."""
    work = root / scenario.key
    ours = serve(work / "prefixd", scenario, prefixd, seed)
    theirs = serve(work / "fs", scenario, fs_tier(work / "fs" / "tier"), seed)
    row = Row(scenario.name, scenario.where, ours.outcome, theirs.outcome, "vLLM file tier (fs)")
    return Result(
        row,
        {"prefixd": ours.control, "fs": theirs.control},
        {"prefixd": ours.blocks, "fs": theirs.blocks},
    )


def results(socket: str, data_dir: Path, root: Path) -> list[Result]:
    """Every scenario, prefixd's side through the daemon at `socket` whose store is `data_dir`."""
    prefixd = prefixd_tier(socket, data_dir)
    return [run(scenario, prefixd, root, seed) for seed, scenario in enumerate(SCENARIOS)]


def rows() -> list[Row]:
    from suitelib import SuiteDaemon

    with tempfile.TemporaryDirectory(prefix="poison-vllm-") as tmp:
        daemon = SuiteDaemon(Path(tmp), "prefixd")
        daemon.start()
        try:
            found = results(str(daemon.socket), daemon.data_dir, Path(tmp) / "work")
        finally:
            daemon.stop()
    for result in found:
        if set(result.controls.values()) != {"exact"}:
            raise RuntimeError(
                f"{result.row.scenario}: a control was not served: {result.controls}"
            )
    return [result.row for result in found]


if __name__ == "__main__":
    main(rows, __doc__)
