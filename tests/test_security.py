"""Security basics: specgraft never unpickles files (safetensors and JSON only); an export holds only its own
files and the report's plots from inside the report folder; the card carries only this head's numbers and Hub
metadata the Hub accepts."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specgraft"
#: The Hub id the exports below name as their target (never contacted: the target is read from a local folder).
HUB_ID = "org/tiny-target"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_no_unpickling_in_the_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, name in _calls(tree):
            if name in ("pickle.load", "pickle.loads", "dill.load", "joblib.load", "numpy.load", "np.load"):
                offenders.append(f"{path.name}:{node.lineno} {name}")
            if name == "torch.load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{path.name}:{node.lineno} torch.load without weights_only=True")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n in ("pickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{path.name}:{node.lineno} imports a pickle module")
    assert not offenders, offenders


# -- exports copy only the report's own plots (issue 15) ---------------------------------------------------------


@pytest.fixture(scope="module")
def medusa_head(tmp_path_factory):
    """A saved 2-head Medusa head on a tiny target, in a folder of its own."""
    from specgraft.heads.medusa.model import MedusaHead
    from specgraft.target import Target
    from specgraft.testing import tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("security")
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    target = Target(model, tokenizer, name_or_path=str(root / "target"))
    head = MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target))
    return head.save_pretrained(root / "run" / "head")


def _report(folder: Path, plots: dict, drafter: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps({
        "drafter": drafter, "overall": {"tau": 5.0, "acceptance_by_depth": [1.0]}, "domains": {},
        "plots": plots, "settings": {}}))
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_copies_only_images_inside_the_report_folder(medusa_head, tmp_path):
    from specgraft.export import export_head

    secret = tmp_path / "secret.png"
    secret.write_bytes(b"SECRET")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "other.png").write_bytes(b"SECRET2")
    report = _report(tmp_path / "eval", {}, {"type": "medusa", "path": str(medusa_head)})
    (report / "tau.png").write_bytes(b"PNG")
    (report / "config.json").write_text("{}")  # a plot named like the exporter's own file
    (report / "notes.txt").write_text("not an image")
    (report / "link.png").symlink_to(secret)
    (report / "dirlink").symlink_to(outside, target_is_directory=True)
    plots = {"tau_by_domain": "tau.png", "abs": str(secret), "dotdot": "../secret.png", "cfg": "config.json",
             "txt": "notes.txt", "link": "link.png", "dirlink": "dirlink/other.png"}
    (report / "report.json").write_text(json.dumps({**json.loads((report / "report.json").read_text()),
                                                     "plots": plots}))
    result = export_head(medusa_head, "vllm", tmp_path / "export", report=report, base_model=HUB_ID)
    files = _tree(result.path)
    assert not any(data in (b"SECRET", b"SECRET2") for data in files.values())
    assert {n for n in files if not n.startswith(".")} == {"README.md", "config.json", "model.safetensors",
                                                          "specgraft_export.json", "tau.png",
                                                          "specgraft_manifest.json"}
    assert json.loads(files["config.json"])["num_heads"] == 2  # the exporter's config, not the plot
    # abs, .., a file link and a folder link out of the report folder
    assert sum("outside its folder" in w for w in result.warnings) == 4, result.warnings
    meta = json.loads(files["specgraft_export.json"])
    assert meta["report"]["plots"] == {"tau_by_domain": "tau.png"}  # the card links only what was copied
    card = files["README.md"].decode()
    assert "](tau.png)" in card and "secret" not in card and "config.json)" not in card


def test_card_ignores_reports_of_other_drafters(medusa_head, tmp_path):
    """Beside the head: a --drafter self run (tau 5.00, path null) and a random one must not reach the card."""
    from specgraft.export import export_head

    run = medusa_head.parent
    _report(run / "eval-self", {}, {"type": "self", "path": None})
    _report(run / "eval-random", {}, {"type": "random", "path": None})
    _report(run / "eval-other", {}, {"type": "medusa", "path": str(tmp_path)})
    card = (export_head(medusa_head, "vllm", tmp_path / "export").path / "README.md").read_text()
    assert "5.00" not in card and "No evaluation report was attached" in card
    # The head's own report is still picked up.
    _report(run / "eval-head", {}, {"type": "medusa", "path": str(medusa_head)})
    card = (export_head(medusa_head, "vllm", tmp_path / "export2").path / "README.md").read_text()
    assert "| **overall** | 5.00 |" in card
    for name in ("eval-self", "eval-random", "eval-other", "eval-head"):
        shutil.rmtree(run / name)


def test_tracking_project_cannot_leave_the_output_folder():
    from specgraft.config import TrackingConfig
    from specgraft.errors import ConfigError

    for bad in ("../../..", "..", "a/b", "/etc", "x/../../y", "."):
        with pytest.raises(ConfigError, match="must be a plain name"):
            TrackingConfig(project=bad).validate("tracking")
    TrackingConfig(project="my-run_1.2").validate("tracking")


# -- Hub metadata of the card -------------------------------------------------------------------------------------


def test_card_metadata_passes_the_hubs_model_card_rules(medusa_head, tmp_path):
    """Parsed by huggingface_hub's ModelCard / ModelCardData (offline): a Hub repo id as base_model, the draft's
    relation to it, and license other WITH the license_name/license_link the Hub requires for it."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.utils import validate_repo_id

    from specgraft.export import export_head

    result = export_head(medusa_head, "vllm", tmp_path / "export", base_model=HUB_ID)
    card = huggingface_hub.ModelCard((result.path / "README.md").read_text())
    data = card.data.to_dict()
    validate_repo_id(data["base_model"])
    assert data["base_model"] == "org/tiny-target"
    assert data["base_model_relation"] == "adapter"
    assert data["license"] == "other"
    assert data["license_name"] == "same-as-base-model"
    assert data["license_link"] == "https://huggingface.co/org/tiny-target"
    assert data["library_name"] == "specgraft" and "speculative-decoding" in data["tags"]
    # a Hub license id needs no name/link
    data = huggingface_hub.ModelCard((export_head(medusa_head, "vllm", tmp_path / "mit", license="mit",
                                                                  base_model=HUB_ID).path
                                      / "README.md").read_text()).data.to_dict()
    assert data["license"] == "mit" and "license_name" not in data


def test_medusa_card_passes_num_speculative_tokens_equal_to_the_head_count(medusa_head, tmp_path):
    from specgraft.export import export_head

    card = (export_head(medusa_head, "vllm", tmp_path / "export").path / "README.md").read_text()
    spec = json.loads(card.split("--speculative-config '", 1)[1].split("'", 1)[0])
    assert spec["method"] == "medusa" and spec["num_speculative_tokens"] == 2


def test_local_target_path_is_flagged_and_left_out_of_the_card(tmp_path):
    from specgraft.export import export_head
    from specgraft.heads.medusa.model import MedusaHead
    from specgraft.target import Target
    from specgraft.testing import tiny_model, tiny_tokenizer

    local = tmp_path / "target"
    model = tiny_model("llama")
    model.save_pretrained(local)
    target = Target(model, tiny_tokenizer(), name_or_path=str(local))
    head = MedusaHead.build(target, MedusaHead.Config(num_heads=2).resolve(target))
    result = export_head(head.save_pretrained(tmp_path / "head"), "vllm", tmp_path / "export")
    assert any("--base-model ORG/NAME" in w for w in result.warnings)
    card = (result.path / "README.md").read_text()
    assert "base_model:" not in card.split("---")[1]
    fixed = export_head(tmp_path / "head", "vllm", tmp_path / "export2", base_model="org/real")
    assert not any("--base-model" in w for w in fixed.warnings)
    assert json.loads((fixed.path / "specgraft_export.json").read_text())["base_model"] == "org/real"
    assert 'base_model: "org/real"' in (fixed.path / "README.md").read_text()
