"""The tier's identity comes from vLLM's own config: every field that changes the KV a token
prefix produces changes it, and nothing else does."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm.config import MultiModalConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_offload.config import OffloadingGroupConfig, OffloadingModelConfig

from prefixd.errors import ConfigError
from prefixd.integrations.vllm import engine_fields, kv_transfer_config
from prefixd.integrations.vllm.identity import group_identities

from .harness import FIELDS, TOKENS_PER_BLOCK, offloading_config, prefixd_tier
from .hub_cache import publish, serving
from .tiny_model import build_tiny_model, write_lora_adapter


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def base_args(model: Path | str, **changes: Any) -> EngineArgs:
    args = EngineArgs(
        model=str(model),
        block_size=32,
        max_model_len=512,
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="float32",
    )
    return dataclasses.replace(args, **changes)


def fields(args: EngineArgs) -> dict[str, str | None]:
    return engine_fields(args.create_engine_config())


def test_the_same_config_is_the_same_identity(model: Path) -> None:
    assert fields(base_args(model)) == fields(base_args(model))
    assert fields(base_args(model))["adapter"] is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dtype": "bfloat16"}, "kv_layout"),
        ({"kv_cache_dtype": "fp8"}, "kv_layout"),
        ({"prefix_caching_hash_algo": "xxhash"}, "kv_layout"),
        ({"hf_overrides": {"sliding_window": 64}}, "kv_layout"),
        ({"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}, "rope"),
        ({"enable_lora": True}, "adapter"),
        ({"tokenizer_mode": "slow"}, "tokenizer"),
    ],
)
def test_each_engine_setting_changes_its_field(
    model: Path, change: dict[str, Any], field: str
) -> None:
    before, after = fields(base_args(model)), fields(base_args(model, **change))
    assert {k for k in before if before[k] != after[k]} == {field}


def test_online_quantization_is_another_identity(model: Path) -> None:
    """The same checkpoint served with its weights quantized at load (--quantization) computes
    other KV."""
    plain = fields(base_args(model, dtype="bfloat16"))
    quantized = fields(base_args(model, dtype="bfloat16", quantization="fp8_per_tensor"))
    assert {k for k in plain if plain[k] != quantized[k]} == {"kv_layout"}


def test_max_model_len_counts_only_when_rope_scaling_sets_positions(model: Path) -> None:
    assert fields(base_args(model)) == fields(base_args(model, max_model_len=256))
    scaled = {"hf_overrides": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}
    assert (
        fields(base_args(model, **scaled))["rope"]
        != fields(base_args(model, max_model_len=256, **scaled))["rope"]
    )


def test_other_weights_are_another_identity(model: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1)
    ours, theirs = fields(base_args(model)), fields(base_args(other))
    assert ours["weights"] != theirs["weights"]
    rebuilt = build_tiny_model(tmp_path / "rebuilt")  # the same bytes elsewhere: same weights
    assert fields(base_args(rebuilt))["weights"] == ours["weights"]


def test_a_hub_models_revision_is_the_commit_it_named(tmp_path: Path) -> None:
    """`main` moved: an engine started since loads other weights under the same name and
    revision (vllm#49261), so the identity holds the commit vLLM read the config from."""

    def hub_fields() -> dict[str, str | None]:
        with serving(tmp_path):
            return fields(base_args("poison/tiny"))

    publish(tmp_path, "poison/tiny", "a" * 40)
    before = hub_fields()
    assert (before["model"], before["weights"]) == ("poison/tiny", "rev=" + "a" * 40)
    assert hub_fields() == before
    publish(tmp_path, "poison/tiny", "b" * 40, seed=1)
    after = hub_fields()
    assert {k for k in before if before[k] != after[k]} == {"weights", "template"}


def test_kv_transfer_config_loads_the_tier_with_those_fields(model: Path) -> None:
    args = base_args(model)
    config = kv_transfer_config(args, socket="/run/prefixd/prefixd.sock", tenant="acme")
    [tier] = config.kv_connector_extra_config["secondary_tiers"]
    assert config.kv_connector == "OffloadingConnector"
    assert config.kv_connector_extra_config["spec_name"] == "TieringOffloadingSpec"
    assert (tier["type"], tier["module_path"]) == ("PrefixdTier", "prefixd.integrations.vllm")
    assert (tier["tenant"], tier["identity"]) == ("acme", fields(args))


def test_the_command_line_prints_the_config_for_vllm_serve(model: Path) -> None:
    engine = ["--model", str(model), "--block-size", "32", "--max-model-len", "512"]
    engine += ["--enforce-eager", "--skip-tokenizer-init", "--dtype", "float32"]
    command = [sys.executable, "-m", "prefixd.integrations.vllm", "--socket", "/run/p.sock"]
    done = subprocess.run(
        [*command, "--cpu-bytes", "1GiB", "--", *engine], capture_output=True, text=True, check=True
    )
    printed = json.loads(done.stdout)  # vLLM's own log lines go to stderr
    assert set(printed) == {"kv_connector", "kv_role", "kv_connector_extra_config"}
    extra = printed["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 1 << 30
    assert extra["secondary_tiers"][0]["identity"] == fields(base_args(model))
    assert "daemon_uid" not in extra["secondary_tiers"][0]  # the client's own rule
    # The daemon's user, named once for the node (PREFIXD_DAEMON_USER), reaches the tier.
    named = subprocess.run(
        [*command, "--", *engine],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PREFIXD_DAEMON_USER": "nobody"},
    )
    tier = json.loads(named.stdout)["kv_connector_extra_config"]["secondary_tiers"][0]
    assert tier["daemon_uid"] == "nobody"


def test_an_identity_written_for_another_model_is_refused(model: Path, tmp_path: Path) -> None:
    """A kv_transfer_config copied to an engine of another model would store that engine's KV as
    the first model's, and serve it to the first model's engines."""

    def identities_for(name: str, written: dict[str, str | None]) -> Any:
        config = offloading_config(prefixd_tier("unused"))
        config = dataclasses.replace(config, model=OffloadingModelConfig(name, "float32"))
        return group_identities(config, written, "default", "row=1")

    assert identities_for("tiny", FIELDS)
    with pytest.raises(ConfigError, match="written for model 'tiny'.*serves 'other'"):
        identities_for("other", FIELDS)
    written = {**FIELDS, "model": str(model)}
    (tmp_path / "link").symlink_to(model)
    assert identities_for(str(tmp_path / "link"), written)  # the same directory by another path
    with pytest.raises(ConfigError):
        identities_for(str(build_tiny_model(tmp_path / "other", seed=1)), written)


def test_a_groups_layers_in_their_order_are_part_of_its_identity() -> None:
    """A chunk's bytes are its group's layers, in order: the same count of other layers (another
    vLLM release grouping a hybrid model otherwise) or of the same ones in another order is
    another identity."""

    def identity(names: tuple[str, ...]) -> Any:
        config = offloading_config(prefixd_tier("unused"))
        group = OffloadingGroupConfig(TOKENS_PER_BLOCK, names, 0)
        config = dataclasses.replace(config, groups=(group,))
        return group_identities(config, FIELDS, "default", "row=1")[0]

    first = identity(("layer.0", "layer.1"))
    assert identity(("layer.0", "layer.1")) == first
    assert identity(("layer.0", "layer.2")) != first
    assert identity(("layer.1", "layer.0")) != first


def test_weights_streamed_from_object_storage_must_be_named(model: Path) -> None:
    """vLLM pulls an object-storage model's config files into a local directory and streams its
    weights from the URI: a fingerprint of that directory is of its config alone, the same for a
    checkpoint replaced at the URI. The weights' identity must then be given."""
    config = base_args(model).create_engine_config()
    config.model_config.model_weights = "s3://bucket/tiny"  # as vLLM's pull leaves it
    with pytest.raises(ConfigError, match="s3://bucket/tiny"):
        engine_fields(config)
    named = engine_fields(config, weights="sha256:abc")
    assert named["weights"] == "given:sha256:abc"
    assert {k for k, v in named.items() if fields(base_args(model))[k] != v} == {"weights"}
    transfer = kv_transfer_config(base_args(model), socket="/unused", weights="sha256:abc")
    tier = transfer.kv_connector_extra_config["secondary_tiers"][0]
    assert tier["identity"]["weights"] == "given:sha256:abc"


def test_the_command_line_names_streamed_weights_or_says_why_it_cannot(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--weights` reaches the identity; without it, a streamed model is one line on stderr and
    exit status 2, not a traceback."""
    from vllm.engine.arg_utils import EngineArgs

    from prefixd.integrations.vllm.__main__ import main

    build = EngineArgs.create_engine_config

    def streamed(self: EngineArgs, *args: Any, **kwargs: Any) -> Any:
        config = build(self, *args, **kwargs)
        config.model_config.model_weights = "s3://bucket/tiny"  # as vLLM's pull leaves it
        return config

    monkeypatch.setattr(EngineArgs, "create_engine_config", streamed)
    engine = ["--model", str(model), "--block-size", "32", "--max-model-len", "512"]
    engine += ["--enforce-eager", "--skip-tokenizer-init", "--dtype", "float32"]
    assert main(["--socket", "/run/p.sock", "--", *engine]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "s3://bucket/tiny" in err and "Traceback" not in err
    assert main(["--socket", "/run/p.sock", "--weights", "sha256:abc", "--", *engine]) == 0
    printed = json.loads(capsys.readouterr().out)
    tier = printed["kv_connector_extra_config"]["secondary_tiers"][0]
    assert tier["identity"]["weights"] == "given:sha256:abc"


def test_a_lora_adapter_replaced_in_place_is_another_identity(model: Path, tmp_path: Path) -> None:
    """vLLM's keys name a request's adapter by its name and path: retrained files written over
    the old ones (the same name, the same path) would be served the old adapter's KV."""
    sql = write_lora_adapter(tmp_path / "sql", b"first weights")
    config = base_args(model, enable_lora=True).create_engine_config()
    before = engine_fields(config, lora_modules={"sql": str(sql)})
    assert before == engine_fields(config, lora_modules={"sql": str(sql)})
    assert before["adapter"] != engine_fields(config)["adapter"]
    write_lora_adapter(sql, b"retrained weights")
    after = engine_fields(config, lora_modules={"sql": str(sql)})
    assert {k for k in before if before[k] != after[k]} == {"adapter"}
    moved = write_lora_adapter(tmp_path / "elsewhere", b"retrained weights")  # the same files
    assert engine_fields(config, lora_modules={"sql": str(moved)}) == after
    assert engine_fields(config, lora_modules={"chat": str(moved)}) != after
    hub = engine_fields(config, lora_modules={"sql": "org/sql-lora"})  # not local: by its path
    assert hub["adapter"] != engine_fields(config, lora_modules={"sql": "org/other"})["adapter"]


def multimodal_fields(model: Path, **settings: Any) -> dict[str, str | None]:
    """The fields of a multimodal engine serving `model` (a text model's config with vLLM's
    multimodal config set: a vision model's config needs its processor's packages)."""
    config = base_args(model).create_engine_config()
    config.model_config.multimodal_config = MultiModalConfig(**settings)
    return engine_fields(config)


@pytest.mark.parametrize(
    "setting",
    [
        {"mm_encoder_attn_dtype": "fp8"},
        {"mm_device_do_normalize": False},
        {"video_pruning_rate": 0.5},
    ],
)
def test_each_multimodal_setting_that_changes_embeddings_changes_mm(
    model: Path, setting: dict[str, Any]
) -> None:
    """vLLM hashes an item by its data and processor kwargs alone: the same image through another
    encoder setting has the same hash and other embeddings."""
    before, after = multimodal_fields(model), multimodal_fields(model, **setting)
    assert {k for k in before if before[k] != after[k]} == {"mm"}


def test_a_local_models_preprocessing_files_are_part_of_mm(tmp_path: Path) -> None:
    """An image processor's config edited in place (another normalization: the same placeholder
    tokens) makes other embeddings of the same image, under the same item hash."""
    model = build_tiny_model(tmp_path / "model")
    assert fields(base_args(model))["mm"] is None  # a text model's files do not matter
    processor = model / "preprocessor_config.json"
    processor.write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5]}))
    before = multimodal_fields(model)
    assert multimodal_fields(model) == before
    processor.write_text(json.dumps({"image_mean": [0.48, 0.46, 0.41]}))
    after = multimodal_fields(model)
    assert {k for k in before if before[k] != after[k]} == {"mm"}
    (model / "video_preprocessor_config.json").write_text(json.dumps({"num_frames": 8}))
    assert multimodal_fields(model)["mm"] != after["mm"]


def test_the_command_line_reads_what_vllm_serve_is_given(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The arguments of `vllm serve` as an operator writes them: the model as its positional
    argument, the server's own flags, and LoRA modules, whose files reach the identity."""
    from prefixd.integrations.vllm.__main__ import main

    sql = write_lora_adapter(tmp_path / "sql", b"first weights")
    engine = [str(model), "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "tiny"]
    engine += ["--block-size", "32", "--max-model-len", "512", "--enforce-eager"]
    engine += ["--skip-tokenizer-init", "--dtype", "float32"]
    lora = ["--enable-lora", "--lora-modules", f"sql={sql}"]

    def identity(*more: str) -> dict[str, str | None]:
        assert main(["--socket", "/run/p.sock", "--", *engine, *more]) == 0
        printed = json.loads(capsys.readouterr().out)
        return dict(printed["kv_connector_extra_config"]["secondary_tiers"][0]["identity"])

    assert identity() == fields(base_args(model))
    settings = tmp_path / "serve.yaml"  # `vllm serve --config FILE`: the same arguments in YAML
    settings.write_text("block-size: 32\nmax-model-len: 512\ndtype: bfloat16\n")
    in_yaml = [str(model), "--config", str(settings), "--skip-tokenizer-init"]
    assert main(["--socket", "/run/p.sock", "--", *in_yaml]) == 0
    printed = json.loads(capsys.readouterr().out)
    bf16 = printed["kv_connector_extra_config"]["secondary_tiers"][0]["identity"]
    assert bf16 == identity("--dtype", "bfloat16") != identity()
    served = identity(*lora)
    config = base_args(model, enable_lora=True).create_engine_config()
    assert served == engine_fields(config, lora_modules={"sql": str(sql)})
    write_lora_adapter(sql, b"retrained weights")
    assert identity(*lora)["adapter"] != served["adapter"]


def test_the_command_line_says_in_one_line_why_vllm_cannot_build_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixd.integrations.vllm.__main__ import main

    missing = tmp_path / "no-such-model"
    assert main(["--socket", "/run/p.sock", "--", "--model", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(missing) in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m prefixd.integrations.vllm: ")


def test_a_gguf_files_weights_are_its_fingerprint(model: Path, tmp_path: Path) -> None:
    """A GGUF model is one file (weights, tokenizer and template): a new quantization written
    over it is another identity, as a checkpoint rewritten in a model's directory is."""
    gguf = tmp_path / "tiny.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF first quantization")
    config = base_args(model).create_engine_config()
    config.model_config.model = str(gguf)  # as vLLM names a GGUF model
    before = engine_fields(config)
    assert str(before["weights"]).startswith("local:sha256:")
    gguf.write_bytes(b"GGUF another quantization")
    after = engine_fields(config)
    assert {k for k in before if before[k] != after[k]} == {"weights"}


@pytest.mark.parametrize("name", ["org/not-in-the-cache", "org/tiny-GGUF:Q4_K_M"])
def test_weights_prefixd_cannot_name_are_refused_until_given(
    model: Path, tmp_path: Path, name: str
) -> None:
    """A model named by an id whose revision no cache here pins (ModelScope, a GGUF repo's
    quantization, another hub) was identified as `rev=main`, whatever `main` then named."""
    config = base_args(model).create_engine_config()
    config.model_config.model = name
    with serving(tmp_path), pytest.raises(ConfigError, match="cannot tell which weights"):
        engine_fields(config)
    with serving(tmp_path):
        assert engine_fields(config, weights="sha256:abc")["weights"] == "given:sha256:abc"


def test_a_hub_model_without_config_json_is_pinned_by_its_ref(model: Path, tmp_path: Path) -> None:
    """A repo in Mistral's format has params.json, not config.json: its revision is read from
    the cache's ref, as huggingface_hub resolves it, not from a file it may not have."""
    snapshot = publish(tmp_path, "mistral/tiny", "c" * 40)
    (snapshot / "config.json").unlink()
    config = base_args(model).create_engine_config()
    config.model_config.model = "mistral/tiny"
    with serving(tmp_path):
        assert engine_fields(config)["weights"] == "rev=" + "c" * 40
