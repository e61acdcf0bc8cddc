"""MkDocs hook: render the recipes and CLI references from the code on every build, so they cannot drift.

A page holds a marker line and the hook replaces it:

* ``<!-- specgraft:recipes -->``: every recipe section and head family, read statically (``ast``) from the typed
  config dataclasses in ``specgraft/config.py`` and ``specgraft/heads/*/config.py``: field, type, default and the
  field's attribute docstring (the string literal under it).
* ``<!-- specgraft:cli -->``: ``specgraft --help`` and every subcommand's ``--help``, produced by the real
  argparse parsers (``specgraft.cli.build_parser``), nested subcommands included.

Configured as ``hooks: [scripts/docs_hooks.py]`` in ``mkdocs.yml``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "specgraft"
RECIPES_MARKER = "<!-- specgraft:recipes -->"
CLI_MARKER = "<!-- specgraft:cli -->"
HELP_WIDTH = "100"


@dataclass(frozen=True)
class FieldDoc:
    name: str
    annotation: str
    default: str
    doc: str


@dataclass(frozen=True)
class ClassDoc:
    name: str
    doc: str
    fields: tuple[FieldDoc, ...]
    family: str | None
    """The head family name (``type: ClassVar[str] = "..."``), None for a recipe section."""


def _default_text(value: ast.expr | None) -> str:
    if value is None:
        return "required"
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for keyword in value.keywords:
            if keyword.arg == "default":
                return ast.unparse(keyword.value)
            if keyword.arg == "default_factory" and isinstance(keyword.value, ast.Lambda):
                return ast.unparse(keyword.value.body)
        return "see below"
    return ast.unparse(value)


def _one_paragraph(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines())


def read_dataclasses(path: Path) -> dict[str, ClassDoc]:
    """The dataclasses of one module with their fields' annotations, defaults and attribute docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes: dict[str, ClassDoc] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in node.decorator_list):
            continue
        fields: list[FieldDoc] = []
        family = None
        body = node.body
        for index, statement in enumerate(body):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            annotation = ast.unparse(statement.annotation)
            if annotation.startswith("ClassVar"):
                if statement.target.id == "type" and isinstance(statement.value, ast.Constant):
                    family = str(statement.value.value)
                continue
            following = body[index + 1] if index + 1 < len(body) else None
            doc = ""
            if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                doc = _one_paragraph(following.value.value)
            fields.append(FieldDoc(statement.target.id, annotation, _default_text(statement.value), doc))
        classes[node.name] = ClassDoc(node.name, _one_paragraph(ast.get_docstring(node) or ""), tuple(fields), family)
    return classes


def _cell(text: str) -> str:
    """Escape the table separator in prose; code spans (annotations, defaults) keep their pipes, which the
    tables extension does not split on."""
    return text.replace("|", "\\|")


def _field_table(section: str, fields: tuple[FieldDoc, ...]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for item in fields:
        lines.append(f"| `{section}.{item.name}` | `{item.annotation}` | `{item.default}` "
                     f"| {_cell(item.doc) or '-'} |")
    return lines


def render_recipes_reference() -> str:
    """Markdown for every recipe section and head family, from the config classes' source."""
    core = read_dataclasses(PACKAGE / "config.py")
    out: list[str] = []
    sections: dict[str, str] = {}
    for recipe_class in ("Recipe", "DistillRecipe"):
        recipe = core[recipe_class]
        out += [f"## `{recipe_class}`", "", recipe.doc, "",
                "| section | config class | default | meaning |", "|---|---|---|---|"]
        for item in recipe.fields:
            out.append(f"| `{item.name}` | `{item.annotation}` | `{item.default}` "
                       f"| {_cell(item.doc) or '-'} |")
            if item.annotation in core:
                sections.setdefault(item.annotation, item.name)
        out.append("")
    for class_name, section in sections.items():
        config = core[class_name]
        out += [f"## `{section}:` (`{class_name}`)", "", config.doc, "", *_field_table(section, config.fields), ""]
    out += ["## `head:` per family", "",
            "`head.type` picks the family; only that family's fields are accepted.", ""]
    for path in sorted(PACKAGE.glob("heads/*/config.py")):
        classes = read_dataclasses(path)
        for config in classes.values():
            if config.family is None:
                continue
            source = path.relative_to(REPO_ROOT).as_posix()
            out += [f"### `head.type: {config.family}` (`{config.name}`)", "",
                    f"{config.doc} Source: `{source}`.", "", *_field_table("head", config.fields), ""]
            for item in config.fields:  # a family's own nested section (Medusa-2's head.lora)
                nested = classes.get(item.annotation)
                if nested is not None and nested.family is None:
                    out += [f"#### `head.{item.name}:` (`{nested.name}`)", "", nested.doc, "",
                            *_field_table(f"head.{item.name}", nested.fields), ""]
    return "\n".join(out)


@contextlib.contextmanager
def _help_width() -> Iterator[None]:
    """argparse wraps help to the terminal width; fix it so the page does not depend on who builds it."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_sections(title: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{title}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, child in _subcommands(parser).items():
        out += _help_sections(f"{title} {name}", child, level + 1)
    return out


def render_cli_reference() -> str:
    """Markdown with ``specgraft --help`` and each subcommand's full ``--help``, from the real parsers."""
    from specgraft.cli import build_parser

    with _help_width():
        top = build_parser()
        out = ["## `specgraft`", "", "```text", top.format_help().rstrip(), "```", ""]
        for name in _subcommands(top):
            command_parser = _subcommands(build_parser(name))[name]
            out += _help_sections(f"specgraft {name}", command_parser, 2)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs hook signature)
    if RECIPES_MARKER in markdown:
        markdown = markdown.replace(RECIPES_MARKER, render_recipes_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, render_cli_reference())
    return markdown
