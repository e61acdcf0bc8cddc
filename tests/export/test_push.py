"""``specgraft push``: the dry run, the Hub calls (mocked: no network) and the token never shown."""

from __future__ import annotations

import json
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
    return export_head(saved_heads["eagle3"], "vllm", tmp_path / "tiny-eagle3", base_model="org/tiny-target").path


@pytest.fixture
def hub(monkeypatch):
    """HfApi methods replaced by recorders; any other network call fails the test."""
    calls: dict[str, list] = {}
    existing: list[str] = [".gitattributes"]
    visibility = SimpleNamespace(private=True)

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
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", record("repo_info", lambda: visibility))
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit",
                        record("create_commit", SimpleNamespace(commit_url="https://hub/org/x/commit/abc")))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return SimpleNamespace(calls=calls, existing=existing, visibility=visibility)


def _added(commit: dict) -> dict[str, object]:
    """path_in_repo -> what is uploaded (a local file path, or the bytes uploaded from memory)."""
    from huggingface_hub import CommitOperationAdd

    return {op.path_in_repo: op.path_or_fileobj for op in commit["operations"] if isinstance(op, CommitOperationAdd)}


def _deleted(commit: dict) -> list[str]:
    from huggingface_hub import CommitOperationDelete

    return [op.path_in_repo for op in commit["operations"] if isinstance(op, CommitOperationDelete)]


def test_dry_run_lists_exactly_the_upload_and_touches_nothing(export_dir, monkeypatch, capsys):
    def no_network(*args, **kwargs):
        raise AssertionError("a dry run must not call the Hub")

    for name in ("whoami", "create_repo", "create_commit", "list_repo_files", "repo_info"):
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
    (upload,) = hub.calls["create_commit"]
    assert upload["repo_id"] == "org/tiny-eagle3" and upload["revision"] == "v1"
    assert upload["commit_message"] == "first draft" and upload["repo_type"] == "model"
    added = _added(upload)
    assert list(added) == ["README.md", "config.json", "model.safetensors", "specgraft_export.json"]
    assert added["model.safetensors"] == str(export_dir / "model.safetensors") and _deleted(upload) == []
    # the card was regenerated for the repo, uploaded from memory, then written locally
    assert b"vllm serve org/tiny-eagle3" in added["README.md"]
    assert (export_dir / "README.md").read_bytes() == added["README.md"]
    assert "https://hub/org/x/commit/abc" in capsys.readouterr().out


def test_existing_repo_files_need_overwrite(export_dir, hub):
    hub.existing.append("model.safetensors")
    with pytest.raises(SpecgraftError, match="already has files \\(model.safetensors\\); pass --overwrite"):
        push_folder(export_dir, "org/x")
    assert "create_commit" not in hub.calls
    hub.existing.append("old-weights.safetensors")
    push_folder(export_dir, "org/x", overwrite=True)
    # the repo then mirrors the folder: stale weight files are deleted in the same commit
    assert _deleted(hub.calls["create_commit"][0]) == ["old-weights.safetensors"]


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


def test_private_push_into_an_existing_public_repo_is_refused(export_dir, hub):
    hub.visibility.private = False
    with pytest.raises(SpecgraftError, match="exists and is public; --private cannot change"):
        push_folder(export_dir, "org/x", private=True)
    assert "create_commit" not in hub.calls


def test_failed_upload_leaves_the_local_card_untouched(export_dir, hub, monkeypatch):
    def refused(self, *args, **kwargs):
        response = SimpleNamespace(headers={}, request=None, status_code=500)
        raise huggingface_hub.errors.HfHubHTTPError("500 Server Error", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", refused)
    before = {p.name: p.read_bytes() for p in export_dir.iterdir() if p.is_file()}
    with pytest.raises(SpecgraftError, match="the Hub refused the upload"):
        push_folder(export_dir, "org/another-name")
    assert {p.name: p.read_bytes() for p in export_dir.iterdir() if p.is_file()} == before


def test_local_base_model_is_refused_unless_given(saved_heads, tmp_path, hub):
    local = export_head(saved_heads["eagle3"], "vllm", tmp_path / "local-eagle3").path
    with pytest.raises(SpecgraftError, match="not a Hub repo id.*--base-model ORG/NAME"):
        plan_push(local, "org/x")
    with pytest.raises(SpecgraftError, match="is not a Hub repo id"):
        plan_push(local, "org/x", base_model=str(tmp_path))
    push_folder(local, "org/x", base_model="org/real-target")
    added = _added(hub.calls["create_commit"][0])
    config = json.loads(added["config.json"])
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/real-target"
    assert json.loads(added["specgraft_export.json"])["base_model"] == "org/real-target"
    assert b'base_model: "org/real-target"' in added["README.md"]
    # after the upload the folder mirrors the repo
    assert json.loads((local / "config.json").read_text()) == config


def test_push_never_follows_symlinks(export_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the Hub")
    (export_dir / "leak.txt").symlink_to(secret)
    (export_dir / "linked-dir").symlink_to(tmp_path, target_is_directory=True)
    plan = plan_push(export_dir, "org/tiny-eagle3")
    names = [name for name, _ in plan.files]
    assert names == ["README.md", "config.json", "model.safetensors", "specgraft_export.json"]
    assert any("skipped leak.txt, linked-dir: not written by `specgraft export`" in w for w in plan.warnings)
