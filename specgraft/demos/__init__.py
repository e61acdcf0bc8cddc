"""The end-to-end demos of ``specgraft demo`` (:mod:`specgraft.commands.demo`): ``stories`` on the embedded default
target, ``smollm2`` on SmolLM2-135M-Instruct, and the ``steps`` both share. Every step is a call of
:mod:`specgraft.pipeline`; the drafters' recipes are ``recipes/demo/*.yaml`` (shipped inside the package as
``specgraft/demos/recipes/``, which ``recipes/demo`` links to in a checkout).
"""

from pathlib import Path

#: The demos' recipes (``recipes/demo/`` in a checkout links here; they ship inside the package).
RECIPES_DIR = Path(__file__).with_name("recipes")
#: Trained heads that ship inside the package for the demos to warm-start from (``heads/<name>/``: a native head
#: folder, bf16, with a README giving the command and budget that trained it).
SHIPPED_HEADS_DIR = Path(__file__).with_name("heads")
#: The demo part that is not a drafter (``--skip export`` leaves the engine exports out).
EXPORT_PART = "export"


def demo_drafters(demo: str) -> tuple[str, ...]:
    """The drafters demo ``demo`` trains, one per ``recipes/demo/<demo>-<drafter>.yaml`` (sorted by name; the
    runs order them by the registry)."""
    return tuple(sorted(p.stem.removeprefix(f"{demo}-") for p in RECIPES_DIR.glob(f"{demo}-*.yaml")))


def shipped_head(name: str) -> Path | None:
    """The shipped head folder ``heads/<name>`` (None when this installation lacks it)."""
    folder = SHIPPED_HEADS_DIR / name
    return folder if (folder / "head_config.json").is_file() else None
