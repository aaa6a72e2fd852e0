"""Config layering: defaults < YAML section < OVERTURE_<SECTION>__<KEY> env < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.kvstore.config import KVStoreConfig
from services.nodemgr.config import NodeManagerConfig
from services.scheduler.config import SchedulerConfig
from shared.config import ConfigError, load, parse_service_args


def write_yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "overture.yaml"
    p.write_text(text)
    return p


def test_defaults_without_any_source() -> None:
    cfg = load(SchedulerConfig, "scheduler")
    assert cfg.port == 8000
    assert cfg.api_keys == {}
    assert cfg.policy == "balanced"


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    y = write_yaml(tmp_path, "scheduler:\n  port: 9001\n  grpc_port: 9002\n  max_n: 3\n")
    env = {"OVERTURE_SCHEDULER__GRPC_PORT": "9003", "OVERTURE_SCHEDULER__MAX_N": "4"}
    cfg = load(SchedulerConfig, "scheduler", yaml_path=y, env=env, flags={"max_n": "5"})
    assert (cfg.port, cfg.grpc_port, cfg.max_n) == (9001, 9003, 5)
    assert cfg.heartbeat_timeout_s == 3.0  # untouched default


def test_yaml_sections_are_independent(tmp_path: Path) -> None:
    y = write_yaml(tmp_path, "scheduler:\n  port: 9001\nnodemgr:\n  node_id: n7\n")
    assert load(NodeManagerConfig, "nodemgr", yaml_path=y).node_id == "n7"
    assert load(SchedulerConfig, "scheduler", yaml_path=y).port == 9001


def test_env_rule_reaches_nested_sections_and_ignores_other_sections() -> None:
    env = {
        "OVERTURE_KVSTORE__S3__BUCKET": "kv",
        "OVERTURE_KVSTORE__DRAM_BYTES": "512MiB",
        "OVERTURE_SCHEDULER__PORT": "1",  # another section's variable
    }
    cfg = load(KVStoreConfig, "kvstore", env=env)
    assert cfg.s3.bucket == "kv"
    assert cfg.dram_bytes == 512 << 20


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64k", 64 << 10), ("2G", 2 << 30), ("512MiB", 512 << 20), ("1_000", 1000), ("3kb", 3 << 10)],
)
def test_byte_sizes(text: str, expected: int) -> None:
    assert load(KVStoreConfig, "kvstore", flags={"dram_bytes": text}).dram_bytes == expected


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        ({"port": "eighty"}, "scheduler.port"),
        ({"port": 70000}, "scheduler.port"),
        ({"heartbeat_timeout_s": 0}, "scheduler.heartbeat_timeout_s"),
        ({"policy": "random"}, "scheduler.policy"),
        ({"max_n": 0}, "scheduler.max_n"),
        ({"api_keys": "k1"}, "scheduler.api_keys"),
    ],
)
def test_validation_errors_name_the_key(flags: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(SchedulerConfig, "scheduler", flags=flags)


def test_unknown_keys_are_rejected_with_the_known_ones(tmp_path: Path) -> None:
    y = write_yaml(tmp_path, "scheduler:\n  prot: 1\n")
    with pytest.raises(ConfigError, match=r"scheduler\.prot: unknown key.*port"):
        load(SchedulerConfig, "scheduler", yaml_path=y)
    with pytest.raises(ConfigError, match=r"kvstore\.s3\.bucke"):
        load(KVStoreConfig, "kvstore", env={"OVERTURE_KVSTORE__S3__BUCKE": "x"})


def test_api_keys_from_yaml(tmp_path: Path) -> None:
    y = write_yaml(tmp_path, "scheduler:\n  api_keys:\n    sk-A: acme\n")
    assert load(SchedulerConfig, "scheduler", yaml_path=y).api_keys == {"sk-A": "acme"}


def test_bad_yaml_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load(SchedulerConfig, "scheduler", yaml_path=write_yaml(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="missing.yaml"):
        load(SchedulerConfig, "scheduler", yaml_path=tmp_path / "missing.yaml")


def test_service_flags_and_help(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    y = write_yaml(tmp_path, "nodemgr:\n  node_id: from-yaml\n  port: 1234\n")
    cfg = parse_service_args(
        NodeManagerConfig, "nodemgr", ["--config", str(y), "--node-id", "from-flag"], "test"
    )
    assert (cfg.node_id, cfg.port) == ("from-flag", 1234)
    with pytest.raises(SystemExit) as e:
        parse_service_args(NodeManagerConfig, "nodemgr", ["--help"], "test")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--heartbeat-interval-s" in out and "[default: 1.0]" in out
    with pytest.raises(SystemExit) as e:
        parse_service_args(NodeManagerConfig, "nodemgr", ["--port", "x"], "test")
    assert e.value.code == 2
    assert "nodemgr.port" in capsys.readouterr().err
