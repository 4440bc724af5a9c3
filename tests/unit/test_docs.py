"""The README and docs/*.md against the repository and the code, without an engine.

Every relative link reaches a file and, for a page, a heading; every
`./scripts/serve` and `./scripts/bench` command in a shell block parses with
the parser that would run it (Sluice's and vLLM's flags, bench's own), and
every repository path a command names exists; every curl names a method and
path Sluice's own router serves (the admin routes only beside
`--allow-runtime-lora`) and sends valid JSON; every JSON and TOML example
parses, the callers file loads as Sluice loads one, Codex's provider and
Prometheus's job reach routes Sluice serves; each coding agent's setup in
docs/coding-agents.md is the one test_coding_agents runs (tests/agents/turn.py);
docs/operations.md lists exactly the metrics Sluice exports, and every
metric any page names (PromQL included) is one of them. So a renamed
flag, route or metric, a moved script or a page split apart fails here, not
in a reader's terminal. (The flag table: test_readme_flags.py; the
accepted-and-ignored lists: test_ignored_fields.py; the examples that run on
the demo model run in tests/integration/test_docs_examples.py.)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.docpages import (
    ROOT,
    Block,
    all_blocks,
    anchors,
    commands,
    page,
    pages,
    prose,
    section,
)

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line, target) of every inline link outside code blocks and code spans."""
    for number, line in prose(path):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            yield number, target


def broken(path: Path) -> list[str]:
    out = []
    for number, target in links(path):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            out.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where} (no heading with that anchor in {dest.name})")
    return out


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert list(links(path)) or path.name == "DESIGN.md", "a page that links nowhere"
    bad = broken(path)
    assert not bad, "\n".join(bad)


SHELL = all_blocks("sh", "bash")


def _program(words: list[str], *names: str) -> list[str] | None:
    """The arguments after the first word that is one of `names` (after sudo)."""
    for i, w in enumerate(words):
        if w in names:
            return words[i + 1 :]
    return None


def test_the_docs_have_shell_commands_to_check() -> None:
    serve = [c for b in SHELL for c in commands(b) if _program(c, "./scripts/serve") is not None]
    assert len(serve) >= 8, serve


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_serve_and_bench_commands_parse(block: Block) -> None:
    from bench.__main__ import parse_args as bench_args
    from server.cli import build_serve_parser

    for words in commands(block):
        serve = _program(words, "./scripts/serve")
        if serve is not None and "--help" not in serve:
            try:
                build_serve_parser().parse_args(serve)
            except SystemExit:
                pytest.fail(f"{block.where}: `./scripts/serve {shlex.join(serve)}` does not parse")
        bench = _program(words, "./scripts/bench")
        if bench is not None:
            try:
                ns, engine = bench_args(bench)
                build_serve_parser().parse_args(engine)
            except SystemExit:
                pytest.fail(f"{block.where}: `./scripts/bench {shlex.join(bench)}` does not parse")
            from bench.scenarios import SCENARIOS

            unknown = {s for s in ns.scenarios.split(",") if s} - set(SCENARIOS)
            assert not unknown, f"{block.where}: unknown scenarios {unknown}"


_REPO_PATH = re.compile(r"^(?:\./)?(?:scripts|bench|tests|docs|systemd|server|batching)/\S*$")


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_every_repository_path_a_command_names_exists(block: Block) -> None:
    for words in commands(block):
        for w in words:
            if _REPO_PATH.match(w) and "*" not in w:
                assert (ROOT / w).exists(), f"{block.where}: {w} does not exist"


def exported_metrics() -> set[str]:
    """Every metric family /metrics can serve, as a scrape names it: the app's
    registry with the watchdog's gauges and two data-parallel ranks, and with
    two models from a models file (their own series)."""
    from collections import defaultdict

    from batching.pressure import RankStats
    from server.engines.lora import AdapterRegistry
    from server.engines.registry import ModelEntry, ModelSpec
    from server.operations.metrics import Metrics
    from server.operations.watchdog import WatchdogMetrics
    from tests.fakes import FakeEngine

    one = Metrics()
    live: defaultdict[str, object] = defaultdict(float)
    live["ranks"] = [RankStats(0.5, 1, 0), RankStats(0.5, 1, 0)]
    live["placements"] = [("prefix", 0, 1), ("load", 1, 1)]
    one.watch(lambda: live)
    WatchdogMetrics(one.registry)
    several = Metrics()
    rows = []
    for name in ("a", "b"):
        values: defaultdict[str, object] = defaultdict(float, live)
        values["entry"] = ModelEntry(ModelSpec(name), FakeEngine(), AdapterRegistry(name, ()))
        rows.append((name, values))
    several.watch(lambda: rows)
    return {
        f.name + ("_total" if f.type == "counter" else "")
        for m in (one, several)
        for f in m.registry.collect()
    }


def test_the_metrics_list_is_what_sluice_exports() -> None:
    text = section(page("docs/operations.md"), "Metrics")
    listed = re.findall(r"^\| `(sluice_[a-z_]+)` \|", text, re.M)
    assert len(listed) == len(set(listed)), "a metric listed twice"
    exported = exported_metrics()
    assert {"sluice_requests_total", "sluice_engine_rank_kv_cache_usage"} <= exported
    assert sorted(exported - set(listed)) == [], "exported, not in docs/operations.md"
    assert sorted(set(listed) - exported) == [], "in docs/operations.md, not exported"


CURLS = [(b, c) for b in SHELL for c in commands(b) if c[0] == "curl"]


def served(method: str, path: str, *, runtime_lora: bool) -> bool:
    """Whether Sluice's own router (the app `sluice serve` builds, on a fake
    engine) has a handler for this method and path."""
    from aiohttp.test_utils import make_mocked_request

    from server.app import build_app
    from server.settings import Settings
    from tests.fakes import FakeEngine

    settings = Settings(model_name="sluice-demo", allow_runtime_lora=runtime_lora)
    app = build_app(settings, FakeEngine())

    async def resolve() -> bool:
        match = await app.router.resolve(make_mocked_request(method, path, app=app))
        return match.http_exception is None

    return asyncio.run(resolve())


def curl_request(words: list[str]) -> tuple[str, str, list[str]]:
    """A curl command's method, URL path and request bodies."""
    url = next(w for w in words if _LOOPBACK.match(w))
    bodies = [b for flag, b in itertools.pairwise(words) if flag in _DATA]
    method = "POST" if bodies else "GET"
    for flag, value in itertools.pairwise(words):
        if flag in ("-X", "--request"):
            method = value
    return method, urlsplit(url if "://" in url else "http://" + url).path, bodies


_LOOPBACK = re.compile(r"^(?:https?://)?(?:localhost|127\.0\.0\.1):\d+(?:/|$)")
_DATA = ("-d", "--data", "--data-raw", "--json")


def test_the_docs_have_curl_commands_to_check() -> None:
    assert len(CURLS) >= 4, CURLS


@pytest.mark.parametrize(
    ("block", "words"), CURLS, ids=[f"{b.where} {c[-1][:30]}" for b, c in CURLS]
)
def test_every_curl_names_a_route_and_sends_json(block: Block, words: list[str]) -> None:
    method, path, bodies = curl_request(words)
    # The admin routes exist only with --allow-runtime-lora: the block's own
    # serve command says whether its Sluice has them.
    runtime_lora = any("--allow-runtime-lora" in c for c in commands(block))
    assert served(method, path, runtime_lora=runtime_lora), (
        f"{block.where}: Sluice serves no {method} {path}"
    )
    for body in bodies:
        try:
            json.loads(body)
        except ValueError as exc:
            pytest.fail(f"{block.where}: the body of {method} {path} is not JSON: {exc}")


@pytest.mark.parametrize("block", all_blocks("json"), ids=lambda b: b.where)
def test_json_examples_parse(block: Block) -> None:
    from openai.types.chat import ChatCompletion

    body = json.loads(block.text)
    if body.get("object") == "chat.completion":  # an answer, as the openai client reads it
        ChatCompletion.model_validate(body)


@pytest.mark.parametrize("block", all_blocks("toml"), ids=lambda b: b.where)
def test_toml_examples_parse(block: Block) -> None:
    tomllib.loads(block.text)


def test_the_callers_example_is_a_callers_file_sluice_reads(tmp_path: Path) -> None:
    from server.callers import load_callers

    (block,) = [b for b in all_blocks("toml") if "[callers." in b.text]
    (tmp_path / "callers.toml").write_text(block.text)
    table = load_callers(tmp_path / "callers.toml", adapters={"support"}, base="sluice-demo")
    assert set(table.names) == {"chat", "batch", "support", "support-ci"}
    assert table.identify("sk-chat-0f6c...") == "chat"
    assert table.group_for("support") == table.group_for("support-ci") == "support-team"


def test_the_codex_provider_reaches_the_responses_route() -> None:
    (block,) = [b for b in all_blocks("toml") if "[model_providers." in b.text]
    config = tomllib.loads(block.text)
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses"
    url = urlsplit(provider["base_url"] + "/responses")
    assert url.port == 8000, url
    assert served("POST", url.path, runtime_lora=False), f"{block.where}: {url.path}"


def test_the_prometheus_job_scrapes_sluice() -> None:
    import yaml

    (block,) = [b for b in all_blocks("yaml") if "scrape_configs" in b.text]
    (job,) = yaml.safe_load(block.text)["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert served("GET", job.get("metrics_path", "/metrics"), runtime_lora=False)


_EXPORT = re.compile(r"^export (\w+)=(\S*)", re.M)
_AGENTS = {"Claude Code": "claude", "Codex CLI": "codex", "Qwen Code": "qwen"}


@pytest.mark.parametrize("heading", sorted(_AGENTS))
def test_each_agent_is_set_up_as_the_suite_runs_it(heading: str, tmp_path: Path) -> None:
    """docs/coding-agents.md's setup of each agent is what tests/agents/turn.py
    gives it in test_coding_agents (same variables, base URL, model, Codex
    config and arguments), so that test runs the page's setup for real."""
    from tests.agents.install import CLAUDE_CODE, CODEX, QWEN_CODE
    from tests.agents.turn import PROMPT, command

    agent = {"Claude Code": CLAUDE_CODE, "Codex CLI": CODEX, "Qwen Code": QWEN_CODE}[heading]
    text = section(page("docs/coding-agents.md"), heading)
    home = tmp_path / "home"
    args, env = command(agent, Path(_AGENTS[heading]), "http://127.0.0.1:8000", "sluice-demo", home)
    (run,) = [b for b in all_blocks("bash") if f"\n{_AGENTS[heading]} " in "\n" + b.text]
    (words,) = [c for c in commands(run) if c[0] == _AGENTS[heading]]
    assert words[1:-1] == args[1:-1] and args[-1] == PROMPT, (words, args)
    exports = dict(_EXPORT.findall(text))
    ours = {
        k: v for k, v in env.items() if k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "QWEN_"))
    }
    assert set(exports) == set(ours), (sorted(exports), sorted(ours))
    for name, value in ours.items():
        if name.endswith(("_BASE_URL", "_MODEL")):
            assert exports[name] == value, name
    if agent is CODEX:
        (block,) = [b for b in all_blocks("toml") if "[model_providers." in b.text]
        assert tomllib.loads(block.text) == tomllib.loads((home / ".codex/config.toml").read_text())


_METRIC = re.compile(r"\bsluice_[a-z_]+\*?")


def is_exported(name: str, exported: set[str]) -> bool:
    """A family, one of a histogram's series, or a `prefix*` that matches one."""
    if name.endswith("*"):
        return any(m.startswith(name[:-1]) for m in exported)
    return any(name == m + s for m in exported for s in ("", "_bucket", "_count", "_sum"))


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_a_page_names_is_exported(path: Path) -> None:
    """In prose, tables and queries alike (queue.md's PromQL): a renamed
    metric fails here wherever a page still names it."""
    exported = exported_metrics()
    unknown = sorted(
        n for n in set(_METRIC.findall(path.read_text())) if not is_exported(n, exported)
    )
    assert not unknown, f"{path.relative_to(ROOT)} names metrics Sluice does not export: {unknown}"
