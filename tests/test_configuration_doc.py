"""docs/configuration.md against the code, so that the reference cannot drift.

Each server's table (option | environment variable | default | meaning) must list exactly the options
its parser has; a default written as a value (a cell starting with `backticks`) must be what the option
and its variable really default to, checked by behaviour (passing the documented value changes
nothing); each option must set the variable its row names; every environment variable the code reads
must be on the page, and every INFERENCE_* or PROXY_* variable on the page must be read by the code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference_api.__main__ import build_parser as api_parser
from inference_api.__main__ import parse_args as api_args
from inference_api.config import ServerConfig
from proxy.__main__ import build_parser as proxy_parser
from proxy.__main__ import parse_args as proxy_args
from proxy.config import ProxyConfig
from tests.conftest import ROOT

DOC = ROOT / "docs" / "configuration.md"
CODE = [
    *sorted((ROOT / "inference_api").rglob("*.py")),
    *sorted((ROOT / "proxy").rglob("*.py")),
    *sorted((ROOT / "backend").rglob("*.py")),
    ROOT / "gunicorn.conf.py",
    ROOT / "scripts" / "run_stack.py",
    ROOT / "scripts" / "jwt_util.py",
]
# What the code reads from the environment: the servers' own variables wherever they are named, and
# any name looked up in os.environ, an `env` mapping or a .env file (not a WSGI request's environ).
OWN_VARIABLE = re.compile(r"\b(?:INFERENCE|PROXY)_[A-Z0-9_]*[A-Z0-9]\b")
LOOKED_UP = re.compile(
    r"(?:(?<![\w.])environ|(?<![\w.])env|dotenv_values\([^)]*\))(?:\.get\(|\[)\s*[\"']([A-Z][A-Z0-9_]*)[\"']"
)
# Values to try where an option's effect must show (a file for the options that take one; --lora-modules'
# NAME=PATH, and its variable's JSON; a directory of Qwen3's generation_config.json and a JSON object of
# sampling defaults for --generation-config and its override).
TEMPLATE = ROOT / "tests" / "frontend" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
GENERATION_CONFIG = ROOT / "tests" / "frontend" / "generation_config"
ALTERNATIVES = ("7", "9", "x", str(TEMPLATE), "a=x", '[["a", "x"]]', str(GENERATION_CONFIG), '{"top_k": 20}')


def load_run_stack():
    spec = importlib.util.spec_from_file_location("run_stack", ROOT / "scripts" / "run_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_stack = load_run_stack()


@dataclass(frozen=True)
class Row:
    """One row of a table: an option (None for "—"), its variable, and the default cell's text."""

    option: str | None
    variable: str | None
    default: str

    @property
    def value(self) -> str | None:
        """The default as a value, where the cell starts with one."""
        match = re.match(r"`([^`]*)`", self.default)
        return match[1] if match else None

    @property
    def variable_value(self) -> str | None:
        """The variable's default as a value: the cell's, or a flag's (`off (`0`)`)."""
        if self.default.startswith("off"):
            match = re.search(r"`([^`]*)`", self.default)
            return match[1] if match else None
        return self.value


def code(cell: str) -> str | None:
    match = re.fullmatch(r"`([^`]+)`", cell)
    return match[1] if match else None


def cells(heading: str) -> list[list[str]]:
    """The cells of the table in the section whose `## ` heading starts with `heading`."""
    sections = [s for s in re.split(r"^## ", DOC.read_text(), flags=re.M) if s.startswith(heading)]
    assert len(sections) == 1, f"docs/configuration.md has {len(sections)} sections headed {heading!r}"
    lines = [line.strip() for line in sections[0].splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def table(heading: str) -> list[Row]:
    return [Row(code(row[0]), code(row[1]), row[2]) for row in cells(heading)]


@dataclass(frozen=True)
class Server:
    heading: str
    build_parser: Callable[[], argparse.ArgumentParser]
    parse: Callable[[list[str]], object]  # argv -> what the command runs with
    env_of: Callable[[object], dict[str, str]] | None  # its variables, where the options become them

    def __str__(self) -> str:
        return self.heading.strip("`")


SERVERS = [
    Server("The API server", api_parser, api_args, lambda config: config.to_env()),
    Server("The proxy", proxy_parser, proxy_args, lambda config: config.to_env()),
    Server("`make run`", run_stack.build_parser, run_stack.parse_args, None),
]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No server variable from the caller's environment: run_stack and the proxy read os.environ."""
    for name in list(os.environ):
        if OWN_VARIABLE.fullmatch(name):
            monkeypatch.delenv(name)


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
    }


def parses(parse: Callable[[list[str]], object], argv: list[str]) -> object | None:
    try:
        return parse(argv)
    except (SystemExit, ValueError):
        return None


def other_value(action: argparse.Action, parse: Callable, option: str) -> list[str]:
    """Arguments that give the option a value other than its default."""
    if action.nargs == 0:
        return [option]
    candidates = [c for c in action.choices if c != action.default] if action.choices else ALTERNATIVES
    default = parse([])
    for candidate in candidates:
        config = parses(parse, [option, str(candidate)])
        if config is not None and config != default:
            return [option, str(candidate)]
    raise AssertionError(f"no value of {option} among {candidates} changes anything")


@pytest.mark.parametrize("server", SERVERS, ids=str)
def test_every_option_is_documented_and_every_documented_option_exists(server):
    documented = [row.option for row in table(server.heading) if row.option]
    assert len(documented) == len(set(documented)), "an option is listed twice"
    assert set(documented) == set(actions(server.build_parser()))


@pytest.mark.parametrize("server", SERVERS, ids=str)
def test_each_documented_default_is_the_options_own(server):
    """Passing the documented default changes nothing; a default with a value is written as one."""
    parser_actions = actions(server.build_parser())
    default = server.parse([])
    for row in table(server.heading):
        if row.option is None:
            continue
        action = parser_actions[row.option]
        if action.nargs == 0:
            assert row.default.startswith("off"), f"{row.option} is a flag: its default is off"
        elif row.value is not None:
            assert server.parse([row.option, row.value]) == default, (
                f"{row.option}'s default is not {row.value}"
            )
        else:
            assert action.default in (None, []), (
                f"{row.option} defaults to {action.default!r}: write it as a value in its row"
            )


@pytest.mark.parametrize("server", SERVERS[:2], ids=str)
def test_each_option_sets_the_variable_its_row_names(server):
    parser_actions = actions(server.build_parser())
    default_env = server.env_of(server.parse([]))
    for row in table(server.heading):
        if row.option is None:
            continue
        argv = other_value(parser_actions[row.option], server.parse, row.option)
        env = server.env_of(server.parse(argv))
        changed = {name for name in env.keys() | default_env.keys() if env.get(name) != default_env.get(name)}
        expected = set() if row.variable is None else {row.variable}  # none: taken, with no effect
        assert changed == expected, f"{' '.join(argv)} sets {sorted(changed)}, not {row.variable}"


def test_make_run_options_default_to_the_variables_their_rows_name(monkeypatch):
    default, _ = run_stack.parse_args([])
    for row in table("`make run`"):
        action = actions(run_stack.build_parser())[row.option]
        monkeypatch.setenv(row.variable, "7")
        assert getattr(run_stack.parse_args([])[0], action.dest) in ("7", 7), f"{row.variable} is not read"
        monkeypatch.setenv(row.variable, row.value)
        assert run_stack.parse_args([])[0] == default, f"{row.variable}={row.value} is not the default"
        monkeypatch.delenv(row.variable)


def api_config_from(environ: dict[str, str]) -> ServerConfig:
    return ServerConfig.from_env(environ)


def proxy_config_from(environ: dict[str, str], monkeypatch) -> ProxyConfig:
    with monkeypatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        return ProxyConfig.from_env()


@pytest.mark.parametrize("heading", ["The API server", "The proxy"])
def test_each_variable_is_read_and_defaults_to_its_documented_value(heading, monkeypatch):
    """Setting a variable to its documented default changes nothing, and some value of it does."""

    def config_from(environ: dict[str, str]):
        return (
            api_config_from(environ)
            if heading == "The API server"
            else proxy_config_from(environ, monkeypatch)
        )

    default = config_from({})
    for row in table(heading):
        if row.variable is None:  # an option taken with no effect (test_each_option_sets_...: it sets none)
            assert row.option is not None and row.default.startswith("off"), row
            continue
        if row.variable_value is not None:
            assert config_from({row.variable: row.variable_value}) == default, (
                f"{row.variable}={row.variable_value} is not its default"
            )
        changes = []
        for value in ("0", "1", *ALTERNATIVES):
            with contextlib.suppress(ValueError):  # "x" for a number
                changes.append(config_from({row.variable: value}) != default)
        assert any(changes), f"{row.variable} changes nothing: it is not read"


def test_every_variable_of_the_config_classes_is_in_its_table():
    api_variables = {row.variable for row in table("The API server")}
    proxy_variables = {row.variable for row in table("The proxy")}
    assert set(ServerConfig().to_env()) <= api_variables
    assert set(ProxyConfig().to_env()) <= proxy_variables


def variables_read_by_the_code() -> set[str]:
    names = set()
    for path in CODE:
        text = path.read_text()
        names |= set(OWN_VARIABLE.findall(text)) | set(LOOKED_UP.findall(text))
    return names


def test_every_environment_variable_the_code_reads_is_documented():
    read = variables_read_by_the_code()
    assert {"JWT_SECRET", "HF_TOKEN", "INFERENCE_CACHE_DIR", "INFERENCE_ROWS", "PROXY_PORT"} <= read
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", DOC.read_text()))
    assert read - documented == set()


def test_every_server_variable_on_the_page_is_read_by_the_code():
    on_the_page = set(OWN_VARIABLE.findall(DOC.read_text()))
    assert on_the_page - variables_read_by_the_code() == set()


def test_the_makefile_variables_are_documented_with_their_defaults():
    makefile = (ROOT / "Makefile").read_text()
    internal = set(re.findall(r"^([A-Z_]+) :=", makefile, flags=re.M))
    settable = dict(re.findall(r"^([A-Z_]+) \?=[ \t]*(.*)$", makefile, flags=re.M))
    used = set(re.findall(r"\$\(([A-Z_]+)\)", makefile)) - internal - {"MAKE"}  # make's own: itself
    rows = {code(row[0]): row for row in cells("Makefile variables")}
    assert set(rows) == used | set(settable)
    for name, default in settable.items():
        if re.fullmatch(r"[\w.-]+", default):
            assert rows[name][2].startswith(f"`{default}`"), f"{name} defaults to {default}"


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("name", ["configuration.md", "troubleshooting.md", "gpu.md"])
def test_the_links_of_the_operators_pages_lead_somewhere(name):
    page = DOC.parent / name
    for target, anchor in re.findall(r"\]\(([^)#:]*\.md)?(?:#([^)]+))?\)", page.read_text()):
        linked = (page.parent / target) if target else page
        assert linked.is_file(), f"{name} links to {target}, which is missing"
        if anchor:
            assert anchor in anchors(linked), f"{name} links to {target}#{anchor}, which is not a heading"


def test_make_run_runs_run_stack_with_args():
    assert "scripts/run_stack.py $(ARGS)" in (ROOT / "Makefile").read_text()
