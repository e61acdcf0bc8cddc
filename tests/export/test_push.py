"""``specgraft push``: the dry run, the Hub calls (mocked: no network) and the token never shown."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import huggingface_hub
import pytest

from specgraft.cli import main
from specgraft.errors import SpecgraftError
from specgraft.export import export_head, plan_push, push_folder

TOKEN = "hf_SECRETtoken1234567890abcdef"


@pytest.fixture
def export_dir(saved_heads, tmp_path):
    return export_head(saved_heads["eagle3"], "vllm", tmp_path / "tiny-eagle3").path


@pytest.fixture
def hub(monkeypatch):
    """HfApi methods replaced by recorders; any other network call fails the test."""
    calls: dict[str, list] = {}
    existing: list[str] = [".gitattributes"]

    def record(name, result=None):
        def method(self, *args, **kwargs):
            assert self.token == TOKEN
            calls.setdefault(name, []).append(kwargs)
            return result() if callable(result) else result
        return method

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", record("whoami", {"name": "me"}))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", record("create_repo", "https://hub/org/x"))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", record("create_branch"))
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", record("list_repo_files", lambda: list(existing)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        record("upload_folder", SimpleNamespace(commit_url="https://hub/org/x/commit/abc")))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return SimpleNamespace(calls=calls, existing=existing)


def test_dry_run_lists_exactly_the_upload_and_touches_nothing(export_dir, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise AssertionError("a dry run must not call the Hub")

    for name in ("whoami", "create_repo", "upload_folder", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, no_network)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    (export_dir / ".specgraft.tmp").write_text("temporary")  # never uploaded
    before = (export_dir / "README.md").read_text()
    code = main(["push", str(export_dir), "--repo-id", "org/tiny-eagle3", "--dry-run", "--private"])
    out = capsys.readouterr().out
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == ["README.md", "config.json", "model.safetensors", "specgraft_export.json"]
    assert "would upload 4 files" in out and "(private, revision main)" in out
    assert (export_dir / "README.md").read_text() == before


def test_push_calls(export_dir, hub, capsys):
    code = main(["push", str(export_dir), "--repo-id", "org/tiny-eagle3", "--private", "--revision", "v1",
                 "--commit-message", "first draft"])
    assert code == 0
    assert hub.calls["create_repo"] == [dict(repo_id="org/tiny-eagle3", repo_type="model", private=True,
                                             exist_ok=True)]
    assert hub.calls["create_branch"] == [dict(repo_id="org/tiny-eagle3", branch="v1", repo_type="model",
                                               exist_ok=True)]
    assert hub.calls["list_repo_files"] == [dict(repo_id="org/tiny-eagle3", repo_type="model", revision="v1")]
    (upload,) = hub.calls["upload_folder"]
    assert upload["repo_id"] == "org/tiny-eagle3" and upload["revision"] == "v1"
    assert upload["commit_message"] == "first draft" and upload["repo_type"] == "model"
    assert upload["folder_path"] == str(export_dir) and upload["delete_patterns"] is None
    assert upload["allow_patterns"] == ["README.md", "config.json", "model.safetensors", "specgraft_export.json"]
    # the card was regenerated for the repo
    assert "vllm serve org/tiny-eagle3" in (export_dir / "README.md").read_text()
    assert "https://hub/org/x/commit/abc" in capsys.readouterr().out


def test_existing_repo_files_need_overwrite(export_dir, hub):
    hub.existing.append("model.safetensors")
    with pytest.raises(SpecgraftError, match="already has files \\(model.safetensors\\); pass --overwrite"):
        push_folder(export_dir, "org/x")
    assert "upload_folder" not in hub.calls
    push_folder(export_dir, "org/x", overwrite=True)
    # the repo then mirrors the folder: stale weight files are deleted in the same commit
    assert hub.calls["upload_folder"][0]["delete_patterns"] == ["*"]


def test_push_without_token_says_how_to_log_in(export_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("MY_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(SpecgraftError, match="no Hugging Face token found: set MY_TOKEN.*`hf auth login`"):
        push_folder(export_dir, "org/x", token_env="MY_TOKEN")


def test_token_never_shown(export_dir, hub, monkeypatch, capsys, caplog):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    caplog.set_level(logging.DEBUG)
    assert main(["-v", "push", str(export_dir), "--repo-id", "org/x", "--token-env", "MY_TOKEN"]) == 0

    def rejected(self, *args, **kwargs):
        response = SimpleNamespace(headers={}, request=None, status_code=401)
        raise huggingface_hub.errors.HfHubHTTPError(f"401 Unauthorized: Bearer {TOKEN} invalid", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", rejected)
    assert main(["push", str(export_dir), "--repo-id", "org/x", "--token-env", "MY_TOKEN", "--overwrite"]) == 2
    captured = capsys.readouterr()
    assert "token was rejected" in captured.err and "***" in captured.err
    for text in (captured.out, captured.err, caplog.text, *(p.read_text(errors="ignore")
                                                           for p in export_dir.iterdir() if p.is_file())):
        assert TOKEN not in text


def test_plan_checks(export_dir, tmp_path):
    with pytest.raises(SpecgraftError, match="not of the form ORG/NAME"):
        plan_push(export_dir, "just-a-name")
    with pytest.raises(SpecgraftError, match="is not a folder"):
        plan_push(tmp_path / "missing", "org/x")
    # a repo id that vLLM would read as another method is flagged
    assert any("EAGLE-1" in w for w in plan_push(export_dir, "org/my-eagle-draft-eagle3").warnings)
    assert plan_push(export_dir, "org/llama-eagle3").warnings == []
