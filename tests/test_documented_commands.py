"""Every ``bt-hub`` command line in a fenced shell block of README.md and docs/, and every YAML example there, is
parsed by today's CLI: a flag renamed or removed (the composites' flat flags became aliases of nested ones) fails
here, not in a reader's terminal. Parsing only: the commands name data, GPUs and files this machine lacks."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from bt_hub import cli, cli_flags
from bt_hub.common.presets import read_config_file

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")  # a console block's commands are its "$ " lines, the rest is output


def _blocks(language: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file name, body) of every fenced block in ``language``, backslash continuations joined."""
    found = []
    for doc in DOCS:
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", doc.read_text(), re.M | re.S):
            if block.group(1) in language:
                body = block.group(2).replace("\\\n", " ")
                if block.group(1) == "console":
                    body = "\n".join(line[2:] for line in body.splitlines() if line.startswith("$ "))
                found.append((doc.name, body))
    return found


def _commands() -> list[tuple[str, list[str]]]:
    """(file name, argv after ``bt-hub``) of every ``bt-hub`` command in the docs' shell blocks."""
    commands = []
    for name, body in _blocks(SHELL):
        for line in body.splitlines():
            words, command = [*shlex.split(line, comments=True), "&&"], []
            for word in words:
                if word in ("&&", "||", ";", "|"):
                    if command[:1] == ["bt-hub"]:
                        commands.append((name, command[1:]))
                    command = []
                else:
                    command.append(word)
    return commands


def _yaml_examples() -> list[tuple[str, str, list[str], str]]:
    """(doc, file name, argv, text) of every YAML block whose first line says which command reads it
    (``# run.yaml: bt-hub pretrain --config run.yaml ...``)."""
    examples = []
    for doc, body in _blocks(("yaml", "yml")):
        said = re.match(r"#\s*(\S+\.ya?ml):\s*bt-hub\s+(.*)", body)
        assert said, f"{doc}: a YAML example's first line names its file and the command reading it: {body[:80]!r}"
        examples.append((doc, said.group(1), shlex.split(said.group(2)), body))
    return examples


COMMANDS = _commands()
YAML_EXAMPLES = _yaml_examples()


def _parses(argv: list[str], monkeypatch, capsys) -> None:
    monkeypatch.setenv("BT_HUB_PARSE_ONLY", "1")
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "parsed (BT_HUB_PARSE_ONLY" in capsys.readouterr().out


def test_the_docs_hold_the_commands_the_check_reads():
    # Guards against a silent pass: a change to the fences or to this reader would check nothing.
    documented = {name for name, _ in COMMANDS}
    assert {"README.md", "evaluation.md", "pretraining.md", "weights.md", "detection.md"} <= documented
    assert {argv[0] for _, argv in COMMANDS} >= {"demo", "pretrain", "eval", "embed", "detect", "export", "push"}
    assert [(doc, name) for doc, name, _, _ in YAML_EXAMPLES] == [("pretraining.md", "run.yaml")]


@pytest.mark.parametrize("doc, argv", COMMANDS, ids=[f"{doc}: bt-hub {' '.join(argv)}"[:90] for doc, argv in COMMANDS])
def test_every_documented_command_line_parses(doc, argv, monkeypatch, capsys):
    _parses(argv, monkeypatch, capsys)


@pytest.mark.parametrize("doc, name, argv, text", YAML_EXAMPLES, ids=[f"{d}: {n}" for d, n, _, _ in YAML_EXAMPLES])
def test_every_documented_config_file_is_read_by_its_command(doc, name, argv, text, tmp_path, monkeypatch, capsys):
    (tmp_path / name).write_text(text)
    argv = [str(tmp_path / name) if word == name else word for word in argv]
    _parses(argv, monkeypatch, capsys)
    path, command, _ = cli._resolve(argv)
    config_class = getattr(importlib.import_module(command.module), command.config)
    values = read_config_file(config_class, str(tmp_path / name))  # unknown keys and wrong types refused here
    keys = re.findall(r"^(\w+):", text, re.M)
    assert keys and sorted(values) == sorted(keys), (keys, values)


def _flags_typed_flat(argv: list[str]) -> dict[str, str]:
    """The settings of a documented command line that an old flat spelling gave (cli_flags.LEGACY_FLAGS)."""
    path, command, rest = cli._resolve(argv)
    parser = cli_flags.Parser(prog="bt-hub " + " ".join(path))
    cli_flags.add_dataclass_arguments(parser, getattr(importlib.import_module(command.module), command.config))
    typed = cli_flags.parse(parser, rest)[1]
    return {dest: flag for dest, flag in typed.items() if flag not in parser._option_string_actions}


def test_the_docs_teach_the_nested_flags_and_name_the_flat_ones_in_one_table():
    # guards: README.md and docs/ taught the flat flags of the commands that run others (--knn-k, --linear-epochs,
    # --semi-preset, --semi-epochs, --full-linear: 11 times) and a nested flag once
    assert {" ".join(argv): typed for _, argv in COMMANDS if (typed := _flags_typed_flat(argv))} == {}
    docs = {doc.name: doc.read_text() for doc in DOCS}
    table = re.search(r"^## The flat flags of earlier versions\n(.*?)(?=^## |\Z)", docs["evaluation.md"], re.M | re.S)
    assert table and all(f"`{flag}`" in table.group(1) for flag in cli_flags.LEGACY_FLAGS)
    docs["evaluation.md"] = docs["evaluation.md"].replace(table.group(1), "")
    own = set()  # a flat spelling that is some command's own flag (eval linear --lr-grid) is no old spelling there
    for entry in cli.commands().values():
        for command in entry.values() if isinstance(entry, dict) else [entry]:
            parser = cli_flags.Parser()
            cli_flags.add_dataclass_arguments(parser, getattr(importlib.import_module(command.module), command.config))
            own |= set(parser._option_string_actions)
    flat = [flag for flag in cli_flags.LEGACY_FLAGS if flag not in own]
    assert "--knn-k" in flat and "--full-linear" in flat
    assert {(name, f) for name, text in docs.items() for f in flat if re.search(rf"{f}(?![\w.-])", text)} == set()
