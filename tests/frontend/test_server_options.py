"""`--served-model-name` and `--kv-cache-memory` as `python -m inference_api` takes them, and through the
environment that carries them to the gunicorn worker."""

import pytest

from inference_api.__main__ import check_models, parse_args
from inference_api.config import ServerConfig, parse_size


@pytest.mark.parametrize(
    "text, size",
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("64KiB", 64 * 1024),
        ("1.5GB", 1_500_000_000),
        ("1TiB", 2**40),
        ("3000000000", 3_000_000_000),
        ("100B", 100),
    ],
)
def test_sizes_parse_as_people_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "2G", "2 GiBs", "-1GiB", "GiB", "0", "0.1", "1e9"])
def test_anything_else_is_refused_saying_what_is_wanted(text):
    with pytest.raises(ValueError, match="a size"):
        parse_size(text)


def test_a_bad_size_stops_the_command_line_with_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--kv-cache-memory", "2G"])
    assert exit.value.code == 2
    assert "argument --kv-cache-memory: must be a size such as 2GiB, 512MiB, 1.5GB" in capsys.readouterr().err


def test_a_bad_size_in_the_environment_names_the_variable():
    with pytest.raises(ValueError, match="INFERENCE_KV_CACHE_MEMORY must be a size such as 2GiB"):
        ServerConfig.from_env({"INFERENCE_KV_CACHE_MEMORY": "lots"})


def test_both_options_travel_through_the_environment():
    config = parse_args(["--kv-cache-memory", "1.5GiB", "--served-model-name", "a", "org/b", "a", "--mock"])
    assert config.backend.kv_cache_memory == 3 * 2**29
    assert config.served_model_names == ("a", "org/b")  # in order, once each
    assert ServerConfig.from_env(config.to_env()) == config
    assert ServerConfig.from_env({"INFERENCE_SERVED_MODEL_NAME": "x  y"}).served_model_names == ("x", "y")
    default = parse_args([])
    assert default.served_model_names == () and default.backend.kv_cache_memory is None
    assert ServerConfig.from_env(default.to_env()) == default


def test_vllms_option_names_set_what_ours_do():
    vllms = parse_args(["--max-model-len", "512", "--max-num-seqs", "3", "--max-num-batched-tokens", "64"])
    ours = parse_args(["--max-seq-len", "512", "--rows", "3", "--max-prefill-tokens", "64"])
    assert vllms == ours and ours.backend.rows == 3
    named = parse_args(["--tool-call-parser", "glm45"])
    assert named.tool_call_parser == "glm45" and parse_args([]).tool_call_parser == "auto"
    assert ServerConfig.from_env(named.to_env()) == named
    # vLLM's tool-use command line: its flag taken, with no effect
    assert parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "glm45"]) == named
    for alias in ("glm47", "qwen3_xml", "llama4_json"):  # vLLM's other names, read as ours (PARSER_ALIASES)
        assert parse_args(["--tool-call-parser", alias]).tool_call_parser == alias


def test_a_vllm_command_line_starts_as_its_options_say():
    """A deployment's vLLM command line: its names for ours set what ours do, its flags for the defaults
    change nothing, one device's parallelism is taken at 1, and the sampling defaults are vLLM's options."""
    vllms = [
        *("--model", "Qwen/Qwen3-0.6B", "--tensor-parallel-size", "1", "-pp=1", "--enforce-eager"),
        *("--enable-prefix-caching", "--generation-config", "vllm", "--max-model-len", "4096"),
        *("--disable-log-requests", "--disable-log-stats"),
    ]
    ours = [
        "--model",
        "Qwen/Qwen3-0.6B",
        "--no-cuda-graphs",
        "--generation-config",
        "vllm",
        "--max-seq-len",
        "4096",
    ]
    assert parse_args(vllms) == parse_args(ours)
    assert parse_args(["--no-enable-prefix-caching"]) == parse_args(["--no-prefix-reuse"]) != parse_args([])
    assert parse_args(["--enable-prefix-caching"]) == parse_args([])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: a server runs its model on one device"),
        (["-tp=4"], "-tp 4: a server runs its model on one device"),
        (["--api-key", "secret"], "--api-key is vLLM's option, not taken: this server checks no key itself"),
        (["--gpu-memory-utilization", "0.9"], "the KV cache is sized here by --kv-cache-memory SIZE"),
    ],
)
def test_vllms_options_that_would_not_do_what_they_say_stop_the_start_saying_why(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_served_name_is_not_empty_and_has_no_spaces(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--served-model-name", "my model"])
    assert "a model name is non-empty and has no spaces" in capsys.readouterr().err


def test_speculative_decoding_options_travel_through_the_environment():
    default = parse_args([])
    assert default.backend.speculative_tokens is None  # on where it pays (backend/engine/speculation.py)
    off = parse_args(["--speculative-tokens", "0", "--prompt-lookup-min", "3", "--prompt-lookup-max", "6"])
    assert (off.backend.speculative_tokens, off.backend.prompt_lookup_min, off.backend.prompt_lookup_max) == (
        0,
        3,
        6,
    )
    for config in (default, off):
        assert ServerConfig.from_env(config.to_env()) == config


@pytest.mark.parametrize(
    ("source", "says"),
    [(None, "cannot read {path}: "), ("{% if %}", "{path} is not a Jinja template: ")],
    ids=["missing", "broken"],
)
def test_a_chat_template_that_does_not_read_or_compile_stops_the_command_line(tmp_path, capsys, source, says):
    path = tmp_path / "template.jinja"
    if source is not None:
        path.write_text(source)
    with pytest.raises(SystemExit) as exit:
        parse_args(["--chat-template", str(path)])
    assert exit.value.code == 2
    assert "argument --chat-template: " + says.format(path=path) in capsys.readouterr().err


def test_lora_modules_take_vllms_two_forms_and_travel_through_the_environment(tmp_path, capsys):
    (tmp_path / "sql adapter").mkdir()
    config = parse_args(
        [
            "--lora-modules",
            f"sql={tmp_path / 'sql adapter'}",
            '{"name": "chat", "path": "org/chat-lora", "base_model_name": "m"}',
            "--lora-modules",
            "third=relative/dir",
            "--allow-runtime-lora",
            "--enable-lora",  # vLLM's, with no effect here
            "--max-loras",
            "4",
            "--max-lora-rank",
            "64",
        ]
    )
    assert config.backend.runtime_lora and not parse_args([]).backend.runtime_lora
    assert (config.backend.max_loras, config.backend.max_lora_rank) == (4, 64)
    assert (parse_args([]).backend.max_loras, parse_args([]).backend.max_lora_rank) == (None, None)
    assert config.backend.lora_modules == (
        ("sql", str(tmp_path / "sql adapter")),
        ("chat", "org/chat-lora"),
        ("third", "relative/dir"),
    )
    assert ServerConfig.from_env(config.to_env()) == config
    for wrong in ("no-path", "=path", "my adapter=path", '{"name": "x"}'):
        with pytest.raises(SystemExit):
            parse_args(["--lora-modules", wrong])
        assert "--lora-modules" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "names", "says"),
    [
        ("--model", "missing.gguf", "GGUF file {path} does not exist"),
        ("--model", "missing", "model directory {path} does not exist"),
        ("--model", "empty", "model directory {path} has no config.json: not a transformers model's"),
        ("--draft-model", "missing", "model directory {path} does not exist"),
        ("--embedding-model", "empty", "model directory {path} has no config.json"),
        ("--rerank-model", "missing.gguf", "GGUF file {path} does not exist"),
    ],
)
def test_a_model_that_is_not_there_stops_the_command_line(tmp_path, capsys, option, names, says):
    """Before gunicorn starts: the backend would say so only after importing torch and transformers."""
    (tmp_path / "empty").mkdir()
    path = tmp_path / names
    config = parse_args([option, str(path)])  # a manifest's options parse where its volume is not
    with pytest.raises(SystemExit) as exit:
        check_models(config)
    assert exit.value.code == 2
    assert f"argument {option}: " + says.format(path=path) in capsys.readouterr().err


def test_models_the_command_line_cannot_check_are_left_to_the_backend(tmp_path):
    """A hub id (the hub is asked only when the backend fetches it), a model directory with its
    config.json, and any path under --mock, which loads no model."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    for options in (
        ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
        ["--draft-model", str(tmp_path / "tiny")],
        ["--mock", "--model", str(tmp_path / "missing")],
    ):
        check_models(parse_args(options))
