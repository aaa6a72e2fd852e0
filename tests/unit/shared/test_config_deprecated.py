"""The engine's reuse options moved under ``engine.offload``; the flat names they had keep
working for one release, from every source, with a warning that names the new key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.engine.config import EngineConfig
from shared.config import ConfigError, load, parse_service_args


def test_new_keys_from_yaml_env_and_flags(tmp_path: Path) -> None:
    y = tmp_path / "o.yaml"
    y.write_text("engine:\n  offload:\n    mode: whole_prefix\n    load_timeout_s: 3\n")
    env = {"OVERTURE_ENGINE__OFFLOAD__POLICY": "always"}
    cfg = load(EngineConfig, "engine", yaml_path=y, env=env,
               flags={"offload": {"kvstore_address": "h:1"}})
    o = cfg.offload
    assert (o.mode, o.load_timeout_s, o.policy, o.kvstore_address) == (
        "whole_prefix", 3.0, "always", "h:1")


@pytest.mark.parametrize("old, new, value, expected", [
    ("kvstore_address", "kvstore_address", "h:2", "h:2"),
    ("reuse_mode", "mode", "recompute", "recompute"),
    ("reuse_policy", "policy", "always", "always"),
    ("kvstore_lookup_timeout_s", "lookup_timeout_s", "0.5", 0.5),
    ("kvstore_load_timeout_s", "load_timeout_s", "2", 2.0),
    ("kvstore_save_timeout_s", "save_timeout_s", "4", 4.0),
    ("kvstore_attach_backoff_max_s", "attach_backoff_max_s", "1", 1.0),
    ("reuse_prefill_s_per_token", "prefill_s_per_token", "0.01", 0.01),
    ("reuse_load_overhead_s", "load_overhead_s", "0.1", 0.1),
])
def test_every_old_flat_key_still_works_and_says_what_replaces_it(
    caplog: pytest.LogCaptureFixture, old: str, new: str, value: str, expected: object
) -> None:
    with caplog.at_level(logging.WARNING, logger="shared.config"):
        cfg = load(EngineConfig, "engine", env={f"OVERTURE_ENGINE__{old.upper()}": value})
    assert getattr(cfg.offload, new) == expected
    (msg,) = [r.getMessage() for r in caplog.records]
    assert f"engine.{old} is deprecated" in msg and f"engine.offload.{new}" in msg


def test_old_names_from_yaml_and_flags(tmp_path: Path) -> None:
    y = tmp_path / "o.yaml"
    y.write_text("engine:\n  reuse_mode: whole_prefix\n")
    assert load(EngineConfig, "engine", yaml_path=y).offload.mode == "whole_prefix"
    cfg = parse_service_args(EngineConfig, "engine", ["--reuse-mode", "recompute",
                                                      "--kvstore-address", "h:3"], "x")
    assert (cfg.offload.mode, cfg.offload.kvstore_address) == ("recompute", "h:3")


def test_the_new_key_wins_over_the_old_one() -> None:
    cfg = load(EngineConfig, "engine", env={"OVERTURE_ENGINE__REUSE_MODE": "recompute",
                                            "OVERTURE_ENGINE__OFFLOAD__MODE": "layerwise"})
    assert cfg.offload.mode == "layerwise"


def test_an_old_key_is_still_validated_under_its_new_name() -> None:
    with pytest.raises(ConfigError, match=r"engine\.offload\.mode: 'sideways' is not one of"):
        load(EngineConfig, "engine", env={"OVERTURE_ENGINE__REUSE_MODE": "sideways"})


def test_old_flags_stay_out_of_the_help() -> None:
    import argparse

    from shared.config import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    text = parser.format_help()
    assert "--offload.mode" in text and "--reuse-mode" not in text
