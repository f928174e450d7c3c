"""Every command a message suggests runs as printed.

* The spelling: messages name the command line through ``Settings.cli`` (``KAPPA_CLI``: ``bin/kappa`` from a
  checkout, ``kappa`` in the images). Every string of ``kappa/`` and ``dags/`` that is not a docstring is collected
  (AST) and none may spell ``kappa <command>`` or ``bin/kappa`` itself; where an f-string puts a command after a
  value, that value is the ``cli`` setting. The commands are the CLI's own (read from the typer app).
* The versions: no message guesses a version number (``version + 1`` may be declared with other code, or not at
  all); the Next hint of ``make run`` names a version whose command the registry allows at that moment - checked
  by parsing each rendered hint with the real CLI and against the real registry and serving alias (delta-rs).
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
import typer.main
from deltalake import write_deltalake

from kappa.catalog import load_catalog
from kappa.config import Settings
from kappa.control.registry import Registry
from kappa.control.replay import ReplayError
from kappa.control.replay.version import new_version
from kappa.control.serving import ServingAlias
from kappa.front import cli
from kappa.identity import ViewPaths

ROOT = Path(__file__).resolve().parents[1]
GROUP = typer.main.get_command(cli.app)
COMMANDS = sorted(GROUP.commands)
#: ``kappa <command>`` / ``bin/kappa <command>`` spelled out in a string (not ``kappa_replay``, ``kappa.control``).
SPELLED = re.compile(r"(?<![\w.$/{-])(?:bin/)?kappa (?:" + "|".join(COMMANDS) + r")\b|bin/kappa\b")
#: A string part that continues a command: `` <command>`` right after a formatted value.
CONTINUES = re.compile(r"^ (?:" + "|".join(COMMANDS) + r")\b")
CWC = "campaign_window_counts"


def _strings(path: Path) -> tuple[list[tuple[int, str]], list[ast.JoinedStr]]:
    """(line, text) of every string constant that is not a docstring, and every f-string, of one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    constants = [(node.lineno, node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]
    return constants, [node for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)]


def _sources() -> list[Path]:
    return sorted([*(ROOT / "kappa").rglob("*.py"), *(ROOT / "dags").glob("*.py")])


def _opens_command(lead: ast.expr | None) -> bool:
    """Whether what precedes a value is where a command starts: the f-string's start, a backtick, ``: ``, ``(``,
    or a line's indentation (``{n} replays`` in a sentence is not a command)."""
    if lead is None:
        return True
    text = lead.value if isinstance(lead, ast.Constant) and isinstance(lead.value, str) else None
    return text is not None and re.search(r"(`|: |\(|^\s*|\n\s*)$", text) is not None


def _is_cli(node: ast.expr) -> bool:
    """``settings.cli``, ``Settings.from_env().cli``, a local ``cli``."""
    return (isinstance(node, ast.Attribute) and node.attr == "cli") or (isinstance(node, ast.Name) and node.id == "cli")


def test_every_hint_spells_the_command_line_through_the_cli_setting():
    spelled, wrong_value, hints = [], [], []
    for path in _sources():
        where = path.relative_to(ROOT)
        constants, fstrings = _strings(path)
        spelled += [f"{where}:{line}: {text[:90]!r}" for line, text in constants if SPELLED.search(text)]
        for node in fstrings:
            parts = [None, *node.values]
            for lead, before, part in zip(parts, parts[1:], parts[2:]):
                if isinstance(part, ast.Constant) and isinstance(part.value, str) and CONTINUES.match(part.value) \
                        and isinstance(before, ast.FormattedValue) and _opens_command(lead) \
                        and isinstance(before.value, (ast.Name, ast.Attribute)):  # not "{len(runs)} replays"
                    hints.append(f"{where}:{node.lineno}")
                    if not _is_cli(before.value):
                        wrong_value.append(f"{where}:{node.lineno}: {ast.unparse(before.value)}{part.value[:40]}")
    assert not spelled, "spell the command line with settings.cli (KAPPA_CLI):\n" + "\n".join(spelled)
    assert not wrong_value, "a command follows something other than the cli setting:\n" + "\n".join(wrong_value)
    # the collector sees the hints it is about (so an empty pass means something)
    files = {h.split(":")[0] for h in hints}
    assert len(hints) >= 20 and {"kappa/front/cli.py", "kappa/control/replay/planning.py",
                                 "kappa/control/replay/switch.py", "kappa/control/replay/cascade.py"} <= files, hints


def test_no_message_guesses_a_version_number():
    guessed = []
    for path in _sources():
        for node in _strings(path)[1]:
            for value in node.values:
                if isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.BinOp) \
                        and "version" in ast.unparse(value.value.left):
                    guessed.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(value.value)}")
    assert not guessed, guessed
    for view, spec in load_catalog().views.items():  # what those messages name instead: a number not declared
        hint = new_version(view)
        (number,) = re.findall(rf"declare {view} v(\d+) in kappa/platform.yaml", hint)
        assert int(number) not in spec.versions and int(number) == max(spec.versions) + 1, hint


def _runs_as_printed(hint: str, cli_name: str) -> list[str]:
    """Parse a hinted command with the real CLI (every subcommand, option and required value, nothing run);
    returns its arguments after the command line."""
    args = shlex.split(hint, comments=True)
    assert args[0] == cli_name, hint
    command, ctx = GROUP, GROUP.make_context(cli_name, list(args[1:]))
    while hasattr(command, "resolve_command"):  # a group: its subcommand with what follows
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return args[1:]


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("KAPPA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KAPPA_LAKE_URI", str(tmp_path / "lake"))
    monkeypatch.setenv("KAPPA_CLI", "bin/kappa")
    return Settings.from_env()


def _built(settings: Settings, registry: Registry, version: int, *states: str) -> None:
    """Register a version of campaign_window_counts with a (tiny, real) table, through ``states``."""
    import duckdb

    path = ViewPaths(settings.lake_uri, CWC, version).table
    write_deltalake(path, duckdb.connect().sql("SELECT 'c1' AS campaign_id"), mode="append")
    registry.register(CWC, version, code_module=f"jobs.{CWC}.v{version}", table_path=path,
                      app_id=f"kappa:{CWC}@v{version}:t", starting="earliest", triggered_by="test")
    for state in states:
        registry.set_state(CWC, version, state, by="test")


def test_the_next_hint_of_make_run_names_a_version_its_command_accepts_now(settings: Settings):
    registry, alias = Registry(settings.lake_uri), ServingAlias(settings.lake_uri)

    def step() -> list[str]:
        (hint,) = cli._version_step(settings)
        return _runs_as_printed(hint, "bin/kappa")

    assert step() == ["replay", CWC, "--version", "2", "--start", "earliest"]  # a fresh stack
    # a first hour: v2 replayed, promoted, rolled back - v2 is retired (kept), v1 serves again
    _built(settings, registry, 1, "caught_up", "verified")
    alias.promote(CWC, 1, by="test")
    _built(settings, registry, 2, "caught_up", "verified")
    alias.promote(CWC, 2, by="test")
    alias.rollback(CWC, 1, by="test")
    assert registry.get(CWC, 2).state == "retired" and alias.target(CWC).version == 1
    assert step() == ["replay", CWC, "--version", "3", "--start", "earliest"]  # not the retired v2
    from kappa.control import replay
    from kappa.control.runners.local import LocalRunner

    with pytest.raises(ReplayError) as refused:  # what replaying v2 says instead: the command that serves it
        replay.preflight(cli._replay_request(CWC, 2, **replay.parse_start("earliest")), settings,
                         LocalRunner(settings))
    (hint,) = re.findall(r"`([^`]+)`", str(refused.value))
    assert _runs_as_printed(hint, "bin/kappa") == ["rollback", CWC, "--to", "2"]
    _built(settings, registry, 3)
    assert step() == ["replay", CWC, "--version", "3"]  # under way: follow it (a --start would be refused)
    registry.set_state(CWC, 3, "caught_up", by="test")
    registry.set_state(CWC, 3, "verified", by="test")
    assert step() == ["promote", CWC, "--version", "3"]


def test_hints_of_refusals_run_as_printed(settings: Settings):
    from kappa.control import replay

    with pytest.raises(ReplayError) as refused:  # a version never replayed cannot be verified
        replay.verify(CWC, 2, settings, "strict", by="test")
    (hint,) = re.findall(r"`([^`]+)`", str(refused.value))
    assert _runs_as_printed(hint, "bin/kappa") == ["replay", CWC, "--version", "2"]
    req = cli._replay_request(CWC, 2, **replay.parse_start("earliest"), auto_promote=False)
    (step,) = cli._cascade_steps(req, [("campaign_hourly_totals", 2)], settings)[-1:]
    (hint,) = re.findall(r"`([^`]+)`", step)
    assert _runs_as_printed(hint, "bin/kappa") == ["promote", CWC, "--version", "2", "--cascade"]


def test_the_next_hint_of_make_run_exports_what_locates_the_platform(settings: Settings, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """A platform started with KAPPA_HOME / a lake elsewhere: the Next block's commands find it from a fresh shell
    (the export line, run by bash, gives the same settings) and its data is said to stay where it is."""
    import os
    import subprocess
    import sys

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KAPPA_LAKE_URI", "s3a://kappa/lake")
    located = Settings.from_env()
    hint = cli.next_hint(located, [])
    (export,) = [line.strip() for line in hint.splitlines() if line.strip().startswith("export ")]
    fresh = {k: v for k, v in os.environ.items() if not k.startswith("KAPPA_")}
    probe = "from kappa.config import Settings; s = Settings.from_env(); print(s.home); print(s.lake_uri)"
    shown = subprocess.run(["bash", "-c", f'{export}; exec "$0" -c "$1"', sys.executable, probe], env=fresh,
                           cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    assert shown == [str(located.home), "s3a://kappa/lake"], (export, shown)
    home = Path(located.home).resolve()
    where = home.relative_to(ROOT) if home.is_relative_to(ROOT) else home
    assert f"data stays in {where}/ and s3a://kappa/lake)" in hint, hint
    # the default platform (nothing set): no export, the data in .kappa/
    for name in cli._LOCATING:
        monkeypatch.delenv(name, raising=False)
    plain = cli.next_hint(Settings.from_env(), [])
    assert "export" not in plain and "data stays in .kappa/)" in plain, plain
