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
