"""Validate recipes and print the fully resolved configuration.

``specgraft recipe check recipes/**/*.yaml`` validates every file (exit 2 on the first invalid one);
``specgraft recipe show RECIPE [key=value ...]`` prints the resolved YAML with overrides applied.
"""

from __future__ import annotations

import argparse

import yaml

from specgraft.config import load_recipe, to_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="Validate one or more recipe files.")
    check.add_argument("recipes", nargs="+", help="YAML recipe files.")
    show = sub.add_parser("show", help="Print a recipe fully resolved (defaults filled, overrides applied).")
    show.add_argument("recipe", help="YAML recipe file.")
    show.add_argument("overrides", nargs="*", help="key.sub=value overrides.")


def run(args: argparse.Namespace) -> int:
    if args.recipe_command == "check":
        for path in args.recipes:
            load_recipe(path)
            print(f"ok  {path}")
        return 0
    recipe = load_recipe(args.recipe, args.overrides)
    print(yaml.safe_dump(to_dict(recipe), sort_keys=False), end="")
    return 0
