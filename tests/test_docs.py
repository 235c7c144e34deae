"""The README and docs/ point at things that exist, and their recipes are commands kvo really takes.

- Every relative link in README.md, docs/*.md and the package READMEs resolves to a file, and
  every ``#anchor`` to a heading of that file (GitHub's heading slugs).
- Every repository path named in backticks (tests, tools, packages) exists; a ``::name`` after a
  test file is a function or class in it.
- Every command in a README shell block (the Quickstart's two excepted: CI runs them, .ci/run)
  is preceded by a comment saying which test or session runs it (``run by: PATH ...``, PATH
  existing) or ``not run here``; and each command is checked against what it calls: vLLM's own
  API-server argument parser takes the vLLM command lines, the connector named in a
  ``--kv-transfer-config`` imports and its extra config passes the connector's validation, the
  P/D recipe's configs are the ones kvo_tools.pd.cluster (which the e2e tests use) builds, the
  proxy's parser takes the proxy command line, and so on.
- ``docs/design.md section N`` in the code names a section that exists.
No vLLM engine is started; vLLM's parser is imported (~20 s).
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import attrs
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "tools" / "src" / "kvo_tools" / "bench"
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *DOCS, *sorted(ROOT.glob("packages/*/README.md"))]
QUICKSTART_COMMANDS = (
    "python3 -m pip install -q nox && python3 -m nox -s demo",
    "python3 -m pip install -q nox && python3 -m nox -s tests",
)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_REPO_PATH = re.compile(r"^(?:tests|tools|packages|docs)/[\w./*-]+(?:::\w+)?$")
_SECTION_REF = re.compile(r"docs/design\.md section (\d+)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- links and anchors ------------------------------------------------------------------------

def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for line in text.splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return frozenset(found)


def links(path: Path) -> Iterator[str]:
    text = _FENCE.sub("", path.read_text())
    for match in _LINK.finditer(text):
        target = match.group(1)
        if not re.match(r"^[a-z]+:", target):
            yield target


def test_the_documents_exist_and_the_readme_links_each() -> None:
    names = {path.name for path in DOCS}
    assert {"design.md", "configuration.md", "metrics.md", "pd-protocol.md",
            "benchmarks.md", "testing.md"} <= names
    linked = {target.partition("#")[0] for target in links(README)}
    assert {f"docs/{name}" for name in names} <= linked, names


@pytest.mark.parametrize("document", DOCUMENTS, ids=_rel)
def test_relative_links_and_anchors_resolve(document: Path) -> None:
    broken = []
    for target in links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {_rel(linked)}")
    assert not broken, f"{_rel(document)}: " + "; ".join(broken)


def test_github_slugs_are_what_the_links_assume() -> None:
    assert github_slug("9. Wire protocol (P <-> D control plane)") == \
        "9-wire-protocol-p---d-control-plane"
    assert github_slug("`connector_cost`") == "connector_cost"
    assert github_slug("Recipe 2: prefill/decode (P/D) with the proxy") == \
        "recipe-2-prefilldecode-pd-with-the-proxy"


# -- repository paths named in the text --------------------------------------------------------

def named_paths(path: Path) -> Iterator[str]:
    for match in _CODE_SPAN.finditer(path.read_text()):
        for word in match.group(1).split():
            word = word.rstrip(",;:)")
            placeholder = re.search(r"/[A-Z]+[./]", word)  # tools/src/kvo_tools/bench/NAME.py
            if _REPO_PATH.match(word) and not placeholder:
                yield word


def missing(named: str, base: Path = ROOT) -> str | None:
    """Why ``named`` (a path, a glob, or ``file::name``) does not exist, relative to ``base``
    or else to the repository root; None when it does."""
    file_part, _, name = named.partition("::")
    for folder in dict.fromkeys((base, ROOT)):
        matches = sorted(folder.glob(file_part)) if "*" in file_part else [folder / file_part]
        if matches and all(m.exists() for m in matches):
            break
    else:
        return f"{named}: no such path"
    if name:
        tree = ast.parse(matches[0].read_text())
        defined = {node.name for node in ast.walk(tree)
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        if name not in defined:
            return f"{named}: {file_part} defines no {name}"
    return None


@pytest.mark.parametrize("document", DOCUMENTS, ids=_rel)
def test_every_named_repository_path_exists(document: Path) -> None:
    problems = [p for p in (missing(n, document.parent) for n in named_paths(document)) if p]
    assert not problems, f"{_rel(document)}: " + "; ".join(problems)


def test_the_claims_name_test_files_that_exist() -> None:
    """In the claims table a bare ``test_x.py`` follows a full path of the same package."""
    text = (ROOT / "docs" / "testing.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 15, "the claims table is missing from docs/testing.md"
    tests = {p.name for p in ROOT.glob("**/tests/**/test_*.py")}
    unknown = sorted({name for row in rows for name in re.findall(r"`(test_\w+\.py)", row)
                      if name not in tests})
    assert not unknown, f"claims name test files that do not exist: {unknown}"


def test_design_section_references_in_the_code_exist() -> None:
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md")
                                           .read_text(), re.M)}
    wrong = []
    for source in [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("packages/*/tests/*.py"),
                   *ROOT.glob("tests/**/*.py"), *ROOT.glob("tools/**/*.py")]:
        for number in _SECTION_REF.findall(source.read_text()):
            if int(number) not in sections:
                wrong.append(f"{_rel(source)}: section {number}")
    assert not wrong, wrong
    stale = [_rel(p) for p in [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("packages/*/*.md"),
                               *DOCUMENTS]
             if re.search(r"shared/design|DESIGN\.md|\.\./sketches|\.\./seeds", p.read_text())]
    assert not stale, f"point at docs/design.md, not outside the repository: {stale}"


# -- the README's commands ---------------------------------------------------------------------

@attrs.frozen
class Command:
    argv: tuple[str, ...]
    marker: str
    """The comment lines right above the command."""
    section: str


def readme_commands() -> list[Command]:
    text = README.read_text()
    commands = []
    for block in _FENCE.finditer(text):
        if block.group(1) != "sh":
            continue
        section = re.findall(r"^## (.*)$", text[:block.start()], re.M)[-1]
        comment: list[str] = []
        pending = ""
        for line in block.group(2).splitlines():
            if not pending and line.lstrip().startswith("#"):
                comment.append(line.lstrip("# ").strip())
                continue
            pending += line.rstrip("\\") + (" " if line.endswith("\\") else "\n")
            if line.endswith("\\") or pending.count("'") % 2:
                continue
            argv = shlex.split(pending, comments=True)
            if argv and argv[-1] == "&":  # started in the background
                argv.pop()
            commands.append(Command(tuple(argv), " ".join(comment), section))
            comment, pending = [], ""
        assert not pending, f"unterminated command in {section}: {pending!r}"
    return commands


COMMANDS = readme_commands()
RECIPE_COMMANDS = [c for c in COMMANDS if c.section != "Quickstart"]


def _id(command: Command) -> str:
    return f"{command.section[:10]}: {' '.join(command.argv)[:60]}"


def test_the_quickstart_keeps_its_two_commands_and_ci_runs_the_second() -> None:
    quickstart = [" ".join(c.argv) for c in COMMANDS if c.section == "Quickstart"]
    assert quickstart == list(QUICKSTART_COMMANDS)
    assert "python3 -m nox -s tests" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_has_three_recipes_with_a_check() -> None:
    recipes = sorted({c.section for c in RECIPE_COMMANDS if c.section.startswith("Recipe")})
    assert len(recipes) == 3, recipes
    for recipe in recipes:
        assert any(c.argv[0] == "curl" for c in RECIPE_COMMANDS if c.section == recipe), recipe


@pytest.mark.parametrize("command", RECIPE_COMMANDS, ids=_id)
def test_every_recipe_command_says_what_runs_it(command: Command) -> None:
    marker = command.marker
    if "not run here" in marker and "run by:" not in marker:
        return
    assert "run by:" in marker, (
        f"{' '.join(command.argv)[:80]}: say which test runs it (# run by: PATH) or "
        f"'# not run here' in the comment above it")
    named = re.findall(r"(?:tests|tools|packages)/[\w./-]+\.py(?:::\w+)?|noxfile\.py",
                       marker.split("run by:", 1)[1])
    assert named, f"{marker!r} names no test file or session"
    problems = [p for p in map(missing, named) if p]
    assert not problems, problems


def _option_names(argv: tuple[str, ...]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}


def _unknown_options(parser: Any, argv: tuple[str, ...]) -> set[str]:
    """Options the parser does not spell exactly so (argparse would take an abbreviation)."""
    spelled = {option for action in parser._actions for option in action.option_strings}
    return _option_names(argv) - spelled


@cache
def vllm_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def vllm_commands() -> list[Command]:
    return [c for c in RECIPE_COMMANDS
            if c.argv[:3] == ("python", "-m", "vllm.entrypoints.openai.api_server")]


def _extra_config_check(connector: str, extra: dict[str, Any]) -> None:
    """The validation the connector itself runs on its kv_connector_extra_config."""
    from kvo_core.config import LayerwiseOffloadConfig
    from kvo_vllm.remote_d2h.multi import MultiOptions
    from kvo_vllm.remote_d2h.options import RemoteD2HOptions

    if connector == "LayerwiseStoreConnector":
        LayerwiseOffloadConfig.from_extra_config(extra, ignore_keys=("store_options",))
    elif connector == "RemoteD2HConnector":
        RemoteD2HOptions.from_extra_config(extra)
    elif connector == "KvoMultiConnector":
        options = MultiOptions.from_extra_config(extra)
        LayerwiseOffloadConfig.from_extra_config(extra["layerwise"],
                                                 ignore_keys=("store_options",))
        RemoteD2HOptions.from_extra_config(extra["remote_d2h"])
        assert options is not None
    else:
        assert extra in ({}, None) or connector == "KvoOffloadMetricsConnector", connector


def test_the_vllm_command_lines_parse_and_their_connectors_load() -> None:
    """vLLM's own API-server parser takes each command; each named connector imports from the
    named module and accepts its extra config; ``kvo_sparse`` passes kvo's validation."""
    import importlib

    from kvo_vllm.dsa.config import raw_sparse_settings, resolve_sparse_config

    commands = vllm_commands()
    assert len(commands) == 4
    for command in commands:
        assert not _unknown_options(vllm_parser(), command.argv[3:]), command.argv
        args = vllm_parser().parse_args(list(command.argv[3:]))
        transfer = args.kv_transfer_config
        assert transfer is not None, command.argv
        module = importlib.import_module(transfer.kv_connector_module_path)
        assert isinstance(getattr(module, transfer.kv_connector), type)
        _extra_config_check(transfer.kv_connector, transfer.kv_connector_extra_config)
        if args.additional_config:
            settings = raw_sparse_settings(args.additional_config, environ={})
            resolve_sparse_config(settings, index_topk=32, cache_block_size=args.block_size)


def test_the_vllm_command_lines_use_the_flags_the_tests_start_servers_with() -> None:
    """kvo_tools.pd.cluster starts every API server of the e2e tests; a recipe adds only the
    transfer and sparse configs and the batch size."""
    import inspect

    from kvo_tools.pd import cluster

    source = inspect.getsource(cluster.Cluster.start_vllm)
    used = set(re.findall(r'"(--[a-z-]+)"', source))
    allowed = used | {"--kv-transfer-config", "--additional-config", "--max-num-seqs"}
    for command in vllm_commands():
        extra = _option_names(command.argv) - allowed
        assert not extra, f"{extra} are not flags the tests start vLLM with: {command.argv}"


def _transfer(command: Command) -> Any:
    return vllm_parser().parse_args(list(command.argv[3:])).kv_transfer_config


def test_the_pd_recipe_configs_are_the_ones_the_e2e_tests_run() -> None:
    from kvo_tools.pd.cluster import decode_transfer_config, prefill_transfer_config

    pd = [c for c in vllm_commands() if c.section.startswith("Recipe 2")]
    assert len(pd) == 2
    tested = {"kv_producer": prefill_transfer_config("127.0.0.1:1", 5600),
              "kv_consumer": decode_transfer_config(5600)}
    for command in pd:
        ours = _transfer(command)
        theirs = tested[ours.kv_role]
        assert (ours.kv_connector, ours.kv_connector_module_path, ours.kv_load_failure_policy) == (
            theirs["kv_connector"], theirs["kv_connector_module_path"],
            theirs["kv_load_failure_policy"])
        for key, value in ours.kv_connector_extra_config.items():
            assert key in theirs["kv_connector_extra_config"], key
            if isinstance(value, dict):
                assert set(value) <= set(theirs["kv_connector_extra_config"][key]), key
    prefill, decode = sorted(pd, key=lambda c: _transfer(c).kv_role, reverse=True)
    assert (_transfer(prefill).kv_connector_extra_config["remote_d2h"]["kv_port"]
            == _transfer(decode).kv_connector_extra_config["kv_port"])


def test_the_layerwise_recipe_config_is_the_one_the_e2e_test_runs() -> None:
    (command,) = [c for c in vllm_commands() if c.section.startswith("Recipe 1")]
    ours = _transfer(command)
    # test_layerwise.py builds its transfer config with the shared e2e helper (_engines.py)
    source = "".join((ROOT / "tests" / "e2e" / name).read_text()
                     for name in ("test_layerwise.py", "_engines.py"))
    assert f'kv_connector="{ours.kv_connector}"' in source
    assert f'kv_connector_module_path="{ours.kv_connector_module_path}"' in source
    for key in ours.kv_connector_extra_config:
        assert f'"{key}"' in source, key


def test_the_sparse_recipe_runs_the_metrics_tests_server() -> None:
    (command,) = [c for c in vllm_commands() if c.section.startswith("Recipe 3")]
    ours = _transfer(command)
    source = (ROOT / "tests" / "e2e" / "test_dsa_metrics.py").read_text()
    assert f'"kv_connector": "{ours.kv_connector}"' in source
    assert '{"kvo_sparse": {"mode": "offload"}}' in " ".join(command.argv)
    assert 'json.dumps({"kvo_sparse": {"mode": "offload"}})' in source


def test_the_proxy_command_lines_parse() -> None:
    from kvo_vllm.proxy.cli import parser

    proxies = [c for c in RECIPE_COMMANDS if c.argv[:3] == ("python", "-m", "kvo_vllm.proxy")]
    assert proxies
    for command in proxies:
        assert not _unknown_options(parser(), command.argv[3:]), command.argv
        args = parser().parse_args(list(command.argv[3:]))
        assert args.prefill and args.decode


def test_the_mooncake_master_command_uses_the_flags_kvo_starts_it_with() -> None:
    from kvo_transport.mooncake_master import MooncakeMaster

    kvo_flags = _option_names(tuple(MooncakeMaster().command()))
    masters = [c for c in RECIPE_COMMANDS if c.argv[0] == "mooncake_master"]
    assert masters
    for command in masters:
        assert _option_names(command.argv) <= kvo_flags, command.argv
    address = {a.split("=", 1)[1] for c in masters for a in c.argv if a.startswith("--rpc_port")}
    for command in vllm_commands():
        if "store_master_address" in " ".join(command.argv):
            assert any(f"127.0.0.1:{port}" in " ".join(command.argv) for port in address)


def test_the_curl_checks_ask_servers_the_recipes_start() -> None:
    ports = {a for c in RECIPE_COMMANDS for i, a in enumerate(c.argv)
             if i and c.argv[i - 1] == "--port"}
    served = {a for c in vllm_commands() for i, a in enumerate(c.argv)
              if i and c.argv[i - 1] == "--served-model-name"}
    for command in [c for c in RECIPE_COMMANDS if c.argv[0] == "curl"]:
        url = next(a for a in command.argv if a.startswith("http://"))
        port = re.match(r"http://127\.0\.0\.1:(\d+)/", url)
        assert port and port.group(1) in ports, url
        if "-d" in command.argv:
            body = json.loads(command.argv[command.argv.index("-d") + 1])
            assert body["model"] in served


def test_the_metrics_the_checks_grep_for_exist() -> None:
    """Each series a check greps for (one alternation group expanded) is in kvo's catalog."""
    from kvo_vllm.metrics import METRICS

    series = {m.prometheus_name.removeprefix("vllm:")
              + ("_total" if m.kind == "counter" else "") for m in METRICS.values()}
    greps = [c for c in RECIPE_COMMANDS if "grep" in c.argv]
    assert len(greps) == 3
    for command in greps:
        pattern = command.argv[-1]
        group = re.search(r"\(([\w|]+)\)", pattern)
        alternatives = group.group(1).split("|") if group else [""]
        for part in alternatives:
            name = pattern[:group.start()] + part + pattern[group.end():] if group else pattern
            assert name in series, f"{pattern}: no series {name}"


def test_the_install_commands_name_real_packages_extras_and_leftovers() -> None:
    noxfile = (ROOT / "noxfile.py").read_text()
    for command in [c for c in RECIPE_COMMANDS if c.argv[:2] in (("pip", "install"),
                                                                ("pip", "uninstall"))]:
        for spec in [a for a in command.argv[2:] if a.startswith("packages/")]:
            folder, _, extras = spec.partition("[")
            project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
            offered = set(project.get("optional-dependencies", {}))
            assert set(filter(None, extras.rstrip("]").split(","))) <= offered, spec
        if command.argv[1] == "uninstall":
            names = [a for a in command.argv[2:] if not a.startswith("-")]
            for name in names:
                assert f'"{name}"' in noxfile, name
    apt = [c for c in RECIPE_COMMANDS if c.argv[0] == "apt-get"]
    assert apt and all(f'"{c.argv[-1]}"' in noxfile for c in apt)


def test_the_publishing_variables_are_the_ones_the_packages_read() -> None:
    pyprojects = " ".join(p.read_text() for p in ROOT.glob("packages/*/pyproject.toml"))
    for command in RECIPE_COMMANDS:
        for variable in re.findall(r"^(KVO_\w+_REQUIREMENT)=", "\n".join(command.argv), re.M):
            assert f"env:{variable}:" in pyprojects, variable


def test_the_benchmarks_page_covers_every_benchmark_and_its_options() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    benches = {p.stem for p in BENCHMARKS.glob("*.py")
               if not p.stem.startswith("_")}
    headings = {h.strip("` ") for h in re.findall(r"^## (.*)$", text, re.M)}
    assert benches <= headings, benches - headings
    for span in _CODE_SPAN.findall(text):
        match = re.match(r"nox -s bench -- (\w+)(.*)", span)
        if match:
            name, options = match.groups()
            source = (BENCHMARKS / f"{name}.py").read_text()
            for option in re.findall(r"--[a-z][\w-]*", options):
                assert f'"{option}"' in source, f"{name} has no option {option}"


def test_the_recipes_tiny_model_builders_run(tmp_path: Path) -> None:
    """The recipes' first step, as written (the model scripts' command lines)."""
    builders = [c for c in RECIPE_COMMANDS if c.argv[:2] == ("python", "-m")
                and c.argv[2].startswith("kvo_tools.models.")]
    assert len(builders) == 2
    for command in builders:
        target = tmp_path / Path(command.argv[3]).name
        result = subprocess.run([sys.executable, "-m", command.argv[2], str(target),
                                 *command.argv[4:]], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        config = json.loads((target / "config.json").read_text())
        assert config["architectures"], config
