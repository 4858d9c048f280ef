"""The daemon's Config: defaults, the three sources and their agreement rule, parsing, checks."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from prefixd.config import settings as cfg
from prefixd.config.settings import Config, cli_flag, env_var
from prefixd.config.sources import add_arguments, config_from_args, config_from_sources
from prefixd.errors import ConfigError
from prefixd.store.config import Durability, StoreConfig

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def as_user(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(cfg.os, "geteuid", lambda: 1000)
    return 1000


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg.os, "geteuid", lambda: 0)


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    """An environment that pins data_dir and socket inside tmp_path, whoever runs the tests."""
    return {"STATE_DIRECTORY": str(tmp_path / "state"), "RUNTIME_DIRECTORY": str(tmp_path / "run")}


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def to_toml(settings: dict[str, Any]) -> str:
    """A minimal TOML writer for describe()'s plain values (JSON strings are TOML basic strings)."""
    lines = []
    for key, value in settings.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (str, list)):
            text = json.dumps(value)
        else:
            text = repr(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def load(
    cli: dict[str, Any] | None = None, env: dict[str, str] | None = None, file: Path | None = None
) -> Config:
    return config_from_sources(cli or {}, env or {}, file)


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_as_root(as_root: None) -> None:
    config = load()
    assert config.store.data_dir == Path("/var/lib/prefixd")
    assert config.socket.path == Path("/run/prefixd/prefixd.sock")
    assert config.socket.mode == 0o660
    assert config.socket.allowed_uids == () and config.socket.allowed_gids == ()
    assert config.limits.max_frame_bytes == 16 * MiB
    assert config.store.workers == 4
    assert config.limits.max_connections == 1024
    assert config.limits.max_inflight == 64
    assert config.limits.max_region_bytes == 64 * GiB
    assert config.limits.shutdown_grace_s == 10.0
    assert config.metrics.log_level == "info"


def test_systemd_directories_win_over_root_defaults(as_root: None, tmp_path: Path) -> None:
    env = {"STATE_DIRECTORY": f"{tmp_path}/state:{tmp_path}/other", "RUNTIME_DIRECTORY": "/run/x"}
    config = load(env=env)
    assert config.store.data_dir == tmp_path / "state"
    assert config.socket.path == Path("/run/x/prefixd.sock")


def test_defaults_as_user_follow_xdg(as_user: int, tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "st"), "XDG_RUNTIME_DIR": str(tmp_path / "rt")}
    config = load(env=env)
    assert config.store.data_dir == tmp_path / "st" / "prefixd"
    assert config.socket.path == tmp_path / "rt" / "prefixd" / "prefixd.sock"


def test_defaults_as_user_without_xdg(as_user: int, tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": "relative/is/ignored"}
    config = load(env=env)
    assert config.store.data_dir == tmp_path / ".local" / "state" / "prefixd"
    assert config.socket.path == Path(f"/tmp/prefixd-{as_user}/prefixd.sock")


def test_store_defaults_match_store_config(base_env: dict[str, str]) -> None:
    config = load(env=base_env)
    assert config.store_config() == StoreConfig(path=config.store.data_dir, create=True)


# --- one source at a time -------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["cli", "env", "file"])
def test_each_source_alone_sets_a_value(
    source: str, base_env: dict[str, str], tmp_path: Path
) -> None:
    cli = {"workers": "8"} if source == "cli" else {}
    env = {**base_env, "PREFIXD_WORKERS": "8"} if source == "env" else base_env
    file = write_toml(tmp_path / "p.toml", "workers = 8\n") if source == "file" else None
    assert load(cli, env, file).store.workers == 8


def test_config_file_named_by_environment(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", 'log_level = "debug"\n')
    assert load(env={**base_env, "PREFIXD_CONFIG": str(file)}).metrics.log_level == "debug"


def test_relative_paths_in_file_are_relative_to_the_file(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "etc").mkdir()
    file = write_toml(tmp_path / "etc" / "p.toml", 'data_dir = "data"\n')
    assert load(env=base_env, file=file).store.data_dir == tmp_path / "etc" / "data"


def test_typed_cli_values_are_accepted(base_env: dict[str, str], tmp_path: Path) -> None:
    cli = {"workers": 8, "data_dir": tmp_path / "d", "durability": Durability.FULL}
    config = load(cli, base_env)
    assert (config.store.workers, config.store.data_dir, config.store.durability) == (
        8,
        tmp_path / "d",
        "full",
    )


# --- two sources ----------------------------------------------------------------------------------


def test_different_values_from_cli_and_env_are_rejected(base_env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load({"workers": "8"}, {**base_env, "PREFIXD_WORKERS": "4"})
    assert str(caught.value) == "workers: set to 8 by --workers and to 4 by PREFIXD_WORKERS"


def test_different_values_from_env_and_file_are_rejected(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    file = write_toml(tmp_path / "p.toml", 'compression = "zstd"\n')
    with pytest.raises(ConfigError, match="compression: set to ") as caught:
        load(env={**base_env, "PREFIXD_COMPRESSION": "none"}, file=file)
    assert "PREFIXD_COMPRESSION" in str(caught.value)
    assert str(file) in str(caught.value)


def test_same_value_from_several_sources_is_accepted(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    file = write_toml(tmp_path / "p.toml", "max_frame_bytes = 16777216\nsocket_mode = 0o600\n")
    env = {**base_env, "PREFIXD_MAX_FRAME_BYTES": "16MiB", "PREFIXD_SOCKET_MODE": "0600"}
    config = load({"max_frame_bytes": "16384KiB", "socket_mode": "600"}, env, file)
    assert config.limits.max_frame_bytes == 16 * MiB
    assert config.socket.mode == 0o600


def test_equal_values_of_different_spelling_are_shown_when_they_conflict(
    base_env: dict[str, str],
) -> None:
    with pytest.raises(ConfigError, match=r"16MiB \(= 16777216\) by --map-size"):
        load({"map_size": "16MiB"}, {**base_env, "PREFIXD_MAP_SIZE": "32MiB"})


def test_config_and_prefixd_config_must_agree(base_env: dict[str, str], tmp_path: Path) -> None:
    one = write_toml(tmp_path / "one.toml", "")
    two = write_toml(tmp_path / "two.toml", "")
    conflict = "config: set to .* by --config and to .* by PREFIXD_CONFIG"
    with pytest.raises(ConfigError, match=conflict):
        load(env={**base_env, "PREFIXD_CONFIG": str(two)}, file=one)
    assert load(env={**base_env, "PREFIXD_CONFIG": str(one)}, file=one).store.workers == 4


# --- unknown settings -----------------------------------------------------------------------------


def test_unknown_toml_key_is_rejected(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", "workerz = 4\nbogus = 1\n")
    with pytest.raises(ConfigError) as caught:
        load(env=base_env, file=file)
    message = str(caught.value)
    assert "bogus" in message and "workerz (did you mean workers?)" in message
    assert str(file) in message


def test_settings_are_top_level_not_in_a_table(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", "[prefixd]\nworkers = 4\n")
    with pytest.raises(ConfigError, match="unknown setting.*prefixd"):
        load(env=base_env, file=file)


def test_unknown_prefixd_variable_is_rejected(base_env: dict[str, str]) -> None:
    env = {**base_env, "PREFIXD_WORKERZ": "4", "PREFIXD_NOPE": "1", "PREFIX_OTHER": "x"}
    with pytest.raises(ConfigError) as caught:
        load(env=env)
    message = str(caught.value)
    assert "PREFIXD_WORKERZ (did you mean PREFIXD_WORKERS?)" in message
    assert "PREFIXD_NOPE" in message
    assert "PREFIX_OTHER" not in message


def test_variables_outside_the_prefix_are_ignored(base_env: dict[str, str]) -> None:
    assert load(env={**base_env, "PATH": "/bin", "WORKERS": "9"}).store.workers == 4


def test_unknown_cli_key_is_rejected(base_env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="unknown setting.*threads"):
        load({"threads": "2"}, base_env)


def test_missing_and_malformed_files_are_rejected(base_env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config: cannot read"):
        load(env=base_env, file=tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="config: .* is not valid TOML"):
        load(env=base_env, file=write_toml(tmp_path / "bad.toml", "workers = = 4\n"))


# --- bad values -----------------------------------------------------------------------------------

BAD_VALUES = [
    ("workers", "-1"),
    ("workers", "eight"),
    ("durability", "sometimes"),
    ("socket_mode", "999"),
    ("socket_mode", "1777"),
    ("map_size", "lots"),
    ("map_size", "16MB"),
    ("max_frame_bytes", "1KiB"),
    ("readahead", "maybe"),
    ("shutdown_grace_s", "-1"),
    ("shutdown_grace_s", "soon"),
    ("log_level", "verbose"),
    ("allowed_uids", "1000,root"),
    ("allowed_gids", "-5"),
    ("chunk_bytes", "1.5B"),
    ("data_dir", ""),
    ("tenant_policy", "x"),  # refused by a check of its own (a ConfigError inside)
    ("instance", "a/b"),
    ("instance", "numa:1"),  # systemd's StateDirectory= reads ':' as a link: numa:2's store too
    ("instance", ""),  # `--instance "$GPU"` with GPU unset: never the default daemon
]


@pytest.mark.parametrize(("name", "raw"), BAD_VALUES)
@pytest.mark.parametrize("source", ["cli", "env"])
def test_bad_text_values_name_the_setting_and_source(
    name: str, raw: str, source: str, base_env: dict[str, str]
) -> None:
    cli = {name: raw} if source == "cli" else {}
    env = {**base_env, env_var(name): raw} if source == "env" else base_env
    with pytest.raises(ConfigError) as caught:
        load(cli, env)
    message = str(caught.value)
    assert message.startswith(f"{name}: ") and not message.startswith(f"{name}: {name}: ")
    assert (cli_flag(name) if source == "cli" else env_var(name)) in message


@pytest.mark.parametrize(
    "line",
    [
        'workers = "8"',
        'readahead = "true"',
        "allowed_uids = 5",
        "allowed_uids = [true]",
        "log_level = 3",
        "data_dir = 1",
        "workers = 1.5",
        "max_frame_bytes = 0",
    ],
)
def test_toml_values_of_the_wrong_type_are_rejected(
    line: str, base_env: dict[str, str], tmp_path: Path
) -> None:
    name = line.split(" ")[0]
    file = write_toml(tmp_path / "p.toml", line + "\n")
    with pytest.raises(ConfigError, match=f"^{name}: .*p.toml"):
        load(env=base_env, file=file)


def test_direct_construction_validates(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^workers: must be in"):
        Config.from_settings(data_dir=tmp_path, socket=tmp_path / "s", workers=0)
    with pytest.raises(ConfigError, match="^zstd_level: "):
        Config.from_settings(data_dir=tmp_path, socket=tmp_path / "s", zstd_level=99)
    with pytest.raises(ConfigError, match="^socket: .* at most 107"):
        Config.from_settings(data_dir=tmp_path, socket=Path("/" + "s" * 200))


def test_config_is_frozen(base_env: dict[str, str]) -> None:
    config = load(env=base_env)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.store.workers = 5  # type: ignore[misc]


def test_bad_default_socket_names_its_origin(tmp_path: Path) -> None:
    env = {"STATE_DIRECTORY": str(tmp_path), "RUNTIME_DIRECTORY": "/" + "r" * 120}
    with pytest.raises(ConfigError, match=r"^socket: .*\(set by the default\)"):
        load(env=env)


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("max_frame_bytes", "4KiB", 4096),
        ("max_frame_bytes", "16MiB", 16 * MiB),
        ("map_size", "64GiB", 64 * GiB),
        ("map_size", "1.5GiB", 3 * GiB // 2),
        ("map_size", "16 mib", 16 * MiB),
        ("map_size", "2097152", 2 * MiB),
        ("max_region_bytes", "1TiB", 1 << 40),
        ("chunk_bytes", "65536B", 64 << 10),
    ],
)
def test_size_suffixes_parse(name: str, raw: str, expected: int, base_env: dict[str, str]) -> None:
    assert load({name: raw}, base_env).value(name) == expected
    assert load(env={**base_env, env_var(name): raw}).value(name) == expected


def test_size_strings_parse_in_toml(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", 'max_region_bytes = "2GiB"\nchunk_bytes = 131072\n')
    config = load(env=base_env, file=file)
    assert (config.limits.max_region_bytes, config.store.chunk_bytes) == (2 * GiB, 128 << 10)


@pytest.mark.parametrize(
    ("raw", "expected"), [("2.5", 2.5), ("10s", 10.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600)]
)
def test_durations_parse(raw: str, expected: float, base_env: dict[str, str]) -> None:
    assert load({"shutdown_grace_s": raw}, base_env).limits.shutdown_grace_s == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("1", True), ("YES", True), ("false", False), ("0", False), ("no", False)],
)
def test_booleans_parse(raw: str, expected: bool, base_env: dict[str, str]) -> None:
    assert load(env={**base_env, "PREFIXD_READAHEAD": raw}).store.readahead is expected


def test_allowed_ids_parse_from_every_source(base_env: dict[str, str], tmp_path: Path) -> None:
    assert load({"allowed_uids": "1000,1001"}, base_env).socket.allowed_uids == (1000, 1001)
    env = {**base_env, "PREFIXD_ALLOWED_UIDS": "1000, 1001", "PREFIXD_ALLOWED_GIDS": ""}
    assert load(env=env).socket.allowed_uids == (1000, 1001)
    assert load(env=env).socket.allowed_gids == ()
    file = write_toml(tmp_path / "p.toml", "allowed_uids = [1000, 1001]\nallowed_gids = [27]\n")
    config = load({"allowed_uids": "1000,1001"}, env={**base_env}, file=file)
    assert (config.socket.allowed_uids, config.socket.allowed_gids) == ((1000, 1001), (27,))


# --- store settings -------------------------------------------------------------------------------


def test_store_settings_flow_into_store_config(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", 'compression = "zstd"\nzstd_level = 3\n')
    env = {**base_env, "PREFIXD_DURABILITY": "full", "PREFIXD_READAHEAD": "no"}
    cli = {
        "map_size": "1GiB",
        "chunk_bytes": "256KiB",
        "verify_threads": "0",
        "max_readers": "64",
        "sync_interval_s": "250ms",
        "min_compression_gain": "0.1",
    }
    store = load(cli, env, file).store_config()
    assert store == StoreConfig(
        path=tmp_path / "state",
        create=True,
        map_size=GiB,
        durability=Durability.FULL,
        sync_interval_s=0.25,
        compression="zstd",
        zstd_level=3,
        min_compression_gain=0.1,
        chunk_bytes=256 << 10,
        verify_threads=0,
        readahead=False,
        max_readers=64,
    )


def test_config_mirrors_every_store_setting() -> None:
    store_fields = {f.name: f for f in dataclasses.fields(StoreConfig)}
    store_hints = get_type_hints(StoreConfig)
    mirrored = set(store_fields) - {"path", "create"}
    assert mirrored <= set(cfg.SETTINGS)
    assert set(cfg.STORE_SETTINGS) == mirrored
    for name in mirrored:
        table, key = cfg.WHERE[name]
        group = cfg.GROUPS[table]
        made = store_fields[name].default_factory
        default = store_fields[name].default if made is dataclasses.MISSING else made()
        assert cfg.DEFAULTS[name] == default, name
        assert get_type_hints(group)[key] == store_hints[name], name


# --- names and argparse ---------------------------------------------------------------------------


def test_every_field_has_exactly_one_env_name_and_one_flag(base_env: dict[str, str]) -> None:
    names = [
        cfg.flat_name(group, f) for group in cfg.GROUPS.values() for f in dataclasses.fields(group)
    ]
    assert tuple(names) == cfg.SETTINGS
    envs = {"PREFIXD_" + name.upper() for name in names}
    flags = {"--" + name.replace("_", "-") for name in names}
    assert len(envs) == len(flags) == len(names)

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    long_options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert long_options - {"--help"} == flags | {"--config"}
    for name in names:
        action = parser._option_string_actions["--" + name.replace("_", "-")]
        assert action.dest == name

    # each derived variable is known: setting it to its effective default value changes nothing
    # (but an empty instance name, refused as a variable's typo)
    reference = load(env=base_env)
    plain = reference.describe()
    for name in names:
        value = plain[name]
        if name == "instance":
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value).lower()
        if isinstance(value, float):
            text = repr(value)
        assert load(env={**base_env, "PREFIXD_" + name.upper(): text}) == reference, name


def test_argparse_round_trip(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", 'log_level = "warning"\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [
        "--workers",
        "8",
        "--socket-mode",
        "0600",
        "--allowed-uids",
        "1,2",
        "--readahead=false",
        "--map-size",
        "2GiB",
        "--data-dir",
        str(tmp_path / "d"),
        "--config",
        str(file),
    ]
    namespace = parser.parse_args(argv)
    assert not hasattr(namespace, "max_inflight")  # flags not given stay unset
    config = config_from_args(namespace, {**base_env, "PREFIXD_MAX_INFLIGHT": "7"})
    assert config.store.workers == 8
    assert config.socket.mode == 0o600
    assert config.socket.allowed_uids == (1, 2)
    assert config.store.readahead is False
    assert config.store.map_size == 2 * GiB
    assert config.store.data_dir == tmp_path / "d"
    assert config.metrics.log_level == "warning"
    assert config.limits.max_inflight == 7

    bare = config_from_args(parser.parse_args(["--readahead"]), base_env)
    assert bare.store.readahead is True


def test_argparse_conflict_with_environment(base_env: dict[str, str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    namespace = parser.parse_args(["--workers", "8"])
    conflict = "workers: set to 8 by --workers and to 4 by PREFIXD_WORKERS"
    with pytest.raises(ConfigError, match=conflict):
        config_from_args(namespace, {**base_env, "PREFIXD_WORKERS": "4"})


def test_describe_is_plain_and_loads_back(base_env: dict[str, str], tmp_path: Path) -> None:
    config = load(
        {
            "socket_mode": "0640",
            "allowed_gids": "27,100",
            "durability": "full",
            "shutdown_grace_s": "1.5",
            "socket": str(tmp_path / "s.sock"),
        },
        base_env,
    )
    described = config.describe()
    assert json.loads(json.dumps(described)) == described
    assert described["data_dir"] == str(tmp_path / "state")
    assert described["socket_mode"] == "0640"
    assert described["durability"] == "full"
    assert described["allowed_gids"] == [27, 100]
    file = write_toml(tmp_path / "printed.toml", to_toml(described))
    assert load(file=file) == config


def test_only_the_given_environment_is_read(
    base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXD_WORKERS", "9")
    monkeypatch.setenv("STATE_DIRECTORY", "/elsewhere")
    config = load(env=base_env)
    assert config.store.workers == 4
    assert config.store.data_dir == Path(base_env["STATE_DIRECTORY"])


def test_a_cluster_table_maps_onto_the_cluster_settings(tmp_path: Path) -> None:
    file = tmp_path / "prefixd.toml"
    file.write_text(
        '[cluster]\nmaster = "127.0.0.1:50051"\nmetadata = "http://127.0.0.1:8080/metadata"\n'
        'timeout_s = "500ms"\n'
    )
    config = load(file=file)
    assert config.cluster.master == "127.0.0.1:50051"
    assert config.cluster.metadata == "http://127.0.0.1:8080/metadata"
    assert config.cluster.timeout_s == 0.5
    env = {"PREFIXD_CLUSTER_MASTER": "10.0.0.1:1", "PREFIXD_CLUSTER_METADATA": "http://x/m"}
    assert load(env=env).cluster.master == "10.0.0.1:1"
    with pytest.raises(ConfigError, match="cluster_metadata: required"):
        load(env={"PREFIXD_CLUSTER_MASTER": "10.0.0.1:1"})
    with pytest.raises(ConfigError, match="0 or at least 16MiB"):
        load(env={"PREFIXD_CLUSTER_SEGMENT_BYTES": "8MiB"})
    file.write_text('[cluster]\nmastr = "x"\n')
    with pytest.raises(ConfigError, match=r"\[cluster\] mastr \(did you mean master\?\)"):
        load(file=file)
    file.write_text('cluster = "x"\n')
    with pytest.raises(ConfigError, match="must be a table"):
        load(file=file)


# --- tables, and the flat keys and benchmark knobs of the old surface ------------------------------


def test_every_setting_is_in_one_table_under_a_distinct_key() -> None:
    assert sorted(cfg.WHERE) == sorted(cfg.SETTINGS)
    assert sum(map(len, cfg.TABLES.values())) == len(cfg.SETTINGS)
    assert len(cfg.TABLES) <= 7
    for names in cfg.TABLES.values():
        keys = [cfg.toml_key(name) for name in names]
        assert len(set(keys)) == len(keys)
    assert cfg.toml_name("socket_mode") == "[socket] mode"
    assert cfg.toml_name("kv_events_endpoint") == "[events] endpoint"
    assert cfg.toml_name("map_size") == "[store] map_size"


def test_settings_load_from_their_tables(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(
        tmp_path / "p.toml",
        '[store]\nmap_size = "1GiB"\nworkers = 8\n[socket]\nmode = "0600"\nallowed_uids = [7]\n'
        '[tenants]\nttls = ["a=7d"]\n[limits]\nshutdown_grace_s = "2s"\n[metrics]\nport = 9464\n',
    )
    config = load(env=base_env, file=file)
    assert (config.store.map_size, config.store.workers, config.socket.mode) == (GiB, 8, 0o600)
    assert (config.socket.allowed_uids, config.tenants.ttls) == ((7,), {"a": 7 * 86400.0})
    assert (config.limits.shutdown_grace_s, config.metrics.port) == (2.0, 9464)


def test_a_flat_key_still_works_and_is_warned_naming_its_table(
    base_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = write_toml(tmp_path / "p.toml", 'socket_mode = "0600"\nworkers = 8\n')
    with caplog.at_level("WARNING", logger="prefixd.config"):
        config = load(env=base_env, file=file)
    assert (config.socket.mode, config.store.workers) == (0o600, 8)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "socket_mode at the top level" in warnings[0] and "[socket] mode" in warnings[0]
    assert "[store] workers" in warnings[1]


def test_a_flat_key_and_its_table_key_must_agree(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", "workers = 8\n[store]\nworkers = 4\n")
    with pytest.raises(ConfigError, match=r"^workers: set to 8 by workers in .* \[store\] workers"):
        load(env=base_env, file=file)
    write_toml(file, "workers = 8\n[store]\nworkers = 8\n")
    assert load(env=base_env, file=file).store.workers == 8


def test_unknown_keys_of_a_table_are_rejected(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", "[socket]\nmod = 0o600\n[store]\nsocket_mode = 1\n")
    with pytest.raises(ConfigError) as caught:
        load(env=base_env, file=file)
    assert "[socket] mod (did you mean mode?)" in str(caught.value)
    assert "[store] socket_mode" in str(caught.value)  # each setting in its own table only


def test_deprecated_settings_are_not_listed_but_still_taken_with_a_warning(
    base_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    listed = parser.format_help()
    for name in cfg.DEPRECATED:
        assert cli_flag(name) not in listed
    assert "--map-size" in listed and "[store] settings" in listed
    with caplog.at_level("WARNING", logger="prefixd.config"):
        config = load({"eviction": "lru"}, base_env)
    assert config.store_config().eviction == "lru"
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["eviction"]
    assert "eviction" not in load(env=base_env).toml()
    assert 'eviction = "lru"' in config.toml()  # set, it is printed, so the file round-trips
    caplog.clear()
    with caplog.at_level("WARNING", logger="prefixd.config"):
        config = load(env={**base_env, "PREFIXD_TENANT_QUOTA_BYTES": "1GiB"})
    assert config.store_config().default_quota == GiB
    assert '[tenants] quotas = ["*=SIZE"]' in caplog.records[0].getMessage()


def test_a_star_quota_is_each_unlisted_tenants(base_env: dict[str, str], tmp_path: Path) -> None:
    file = write_toml(tmp_path / "p.toml", '[tenants]\nquotas = ["*=2GiB", "a=1GiB"]\n')
    config = load(env=base_env, file=file)
    assert config.tenants.quotas == {"*": 2 * GiB, "a": GiB}
    assert config.store_config().default_quota == 2 * GiB
    assert 'quotas = ["*=2GiB", "a=1GiB"]' in config.toml()


def test_print_config_is_a_file_of_tables_that_loads_back(
    base_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = load(
        {
            "socket_mode": "0640",
            "allowed_gids": "27,100",
            "durability": "full",
            "kv_events_tenants": 'a "quoted" name',
            "cluster_segment_bytes": "32MiB",
            "tenant_quotas": "a=1GiB",
            "tenant_ttls": "a=90m",
            "model_manifests": f"m={tmp_path}/a.json+{tmp_path}/b.json",
            "socket": str(tmp_path / "s.sock"),
        },
        base_env,
    )
    printed = config.toml()
    tables = [line for line in printed.splitlines() if line.startswith("[")]
    assert tables == [f"[{table}]" for table in cfg.TABLES]
    file = write_toml(tmp_path / "printed.toml", printed)
    with caplog.at_level("WARNING", logger="prefixd.config"):
        assert load(file=file) == config
    assert not caplog.records  # no flat key in what is printed


def test_two_default_quotas_that_disagree_are_refused(base_env: dict[str, str]) -> None:
    """tenant_quota_bytes (deprecated) and tenant_quotas' "*" both name the quota of a tenant the
    quotas do not name: given both, they must agree, else neither would be sure to hold."""
    env = {**base_env, "PREFIXD_TENANT_QUOTA_BYTES": "1GiB"}
    with pytest.raises(ConfigError, match="two default quotas"):
        load({"tenant_quotas": "*=4GiB"}, env).store_config()
    assert load({"tenant_quotas": "*=1GiB"}, env).store_config().default_quota == 1 << 30


def test_an_event_tenant_in_a_share_group_is_refused_naming_the_group(
    base_env: dict[str, str],
) -> None:
    """A share group's members store under the group's tenant, so naming a member would publish
    nothing: the operator is told which name publishes them (every member's blocks)."""
    shared = {"share_groups": "labs=alice+bob", "kv_events_endpoint": "ipc:///tmp/x"}
    with pytest.raises(ConfigError, match="'alice' stores its entries in share group 'labs'"):
        load({**shared, "kv_events_tenants": "alice,carol"}, base_env)
    config = load({**shared, "kv_events_tenants": "share:labs,carol"}, base_env)
    assert config.events.tenants == {"share:labs", "carol"}
