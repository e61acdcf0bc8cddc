"""``--format llamacpp`` without the engine: what the GGUF holds, and every refusal in one line with nothing
written. (The engine itself runs the exports in tests/llamacpp/.)"""

from __future__ import annotations

import json

import pytest
import torch

from specgraft.cli import main
from specgraft.errors import SpecgraftError
from specgraft.export import export_head
from specgraft.export.llamacpp import permute_qk, read_gguf, read_target_gguf, unpermute_qk, write_target_gguf
from specgraft.heads.base import read_head_weights

from .helpers import make_head, save_target_gguf, save_tiny_target


def test_gguf_holds_what_llamacpp_reads(saved_heads, llama_target, llama_target_gguf, tmp_path):
    out = export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf).path
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # not the output marker/lock
    assert visible == ["README.md", "draft.gguf", "specgraft_export.json", "specgraft_manifest.json"]
    meta, tensors = read_gguf(out / "draft.gguf")
    tc = llama_target.text_config
    assert meta["general.architecture"] == "eagle3"
    assert meta["eagle3.target_layers"] == [1, 2, 3]  # llama.cpp captures the INPUT of layer i: our numbers
    assert meta["eagle3.target_hidden_size"] == meta["eagle3.embedding_length"] == tc.hidden_size
    assert meta["eagle3.block_count"] == 1 and meta["eagle3.norm_before_residual"] is False
    assert meta["eagle3.attention.head_count"] == tc.num_attention_heads
    assert meta["eagle3.attention.head_count_kv"] == tc.num_key_value_heads
    assert meta["eagle3.rope.freq_base"] == 10000.0
    state = read_head_weights(saved_heads["eagle3"])
    # d2t: llama.cpp stores the absolute target id of every draft row, ours the offset.
    assert torch.equal(tensors["d2t"], state["d2t"] + torch.arange(100))
    assert tensors["d2t"].dtype == torch.int64
    q = state["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(tensors["blk.0.attn_q.weight"], permute_qk(q, tc.num_attention_heads))
    assert not torch.equal(tensors["blk.0.attn_q.weight"], q)
    assert torch.equal(tensors["blk.0.attn_v.weight"], state["midlayer.self_attn.v_proj.weight"])
    # The draft carries the target's tokenizer, key for key.
    import gguf

    fields = gguf.GGUFReader(str(out / "draft.gguf")).fields
    for key, value, _, _ in read_target_gguf(llama_target_gguf).tokenizer_fields:
        assert fields[key].contents() == value, key
    card = (out / "README.md").read_text()
    assert "llama-server -m tiny-llama.gguf -md" in card and "--spec-type draft-eagle3" in card


def test_permutation_is_llamacpp_converters_and_inverts():
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    # convert_hf_to_gguf's LlamaModel.permute for 2 heads: rows (0, 2, 1, 3) within each head of 4 rows.
    assert permute_qk(w, 2)[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert torch.equal(unpermute_qk(permute_qk(w, 2), 2), w)


def test_missing_target_gguf_is_one_error_line(saved_heads, tmp_path, capsys):
    code = main(["export", str(saved_heads["eagle3"]), "--format", "llamacpp", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pass --target-gguf TARGET.gguf" in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("head_type,allowed", [("medusa", "vllm, trtllm, native"), ("eagle", "vllm, sglang, native")])
def test_families_llamacpp_cannot_serve(head_type, allowed, saved_heads, llama_target_gguf, tmp_path):
    with pytest.raises(SpecgraftError, match=f"llamacpp format cannot hold a {head_type} head; export it as one of "
                                             f"{allowed}"):
        export_head(saved_heads[head_type], "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    assert not (tmp_path / "o").exists()


def test_what_the_eagle3_gguf_cannot_hold(llama_target, llama_target_gguf, tmp_path):
    two = make_head(llama_target, "eagle3", num_layers=2).save_pretrained(tmp_path / "two")
    with pytest.raises(SpecgraftError, match="exactly one draft layer but this head has 2; export it as vllm or "
                                             "native"):
        export_head(two, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    fc_bias = make_head(llama_target, "eagle3", fc_bias=True).save_pretrained(tmp_path / "bias")
    with pytest.raises(SpecgraftError, match="no fc bias, which this head has; export it as one of trtllm, native"):
        export_head(fc_bias, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    assert not (tmp_path / "o").exists()


def test_target_gguf_of_another_model_or_tokenizer(saved_heads, llama_target, tmp_path):
    deeper = save_tiny_target(tmp_path / "deeper", num_hidden_layers=5)
    other_model = save_target_gguf(deeper, tmp_path / "deeper.gguf")
    with pytest.raises(SpecgraftError, match=r"not this head.s target: it has layers 5 \(the head.s target has 4\)"):
        export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=other_model)
    tokens = llama_target.tokenizer.convert_ids_to_tokens(list(range(len(llama_target.tokenizer))))
    tokens[7], tokens[8] = tokens[8], tokens[7]
    other_tokenizer = write_target_gguf(llama_target.model, tokens, tmp_path / "swapped.gguf")
    with pytest.raises(SpecgraftError, match="has another tokenizer than the head's target \\(2 token\\(s\\) differ, "
                                             "first id 7\\)"):
        export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=other_tokenizer)
    (tmp_path / "not.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(SpecgraftError, match="truncated or corrupt"):
        export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=tmp_path / "not.gguf")
    assert not (tmp_path / "o").exists()


def test_a_write_that_fails_halfway_leaves_nothing(saved_heads, llama_target_gguf, tmp_path, monkeypatch):
    import gguf

    def fail(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="No space left"):
        export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    assert list(tmp_path.iterdir()) == []


def test_export_meta_names_the_target_gguf(saved_heads, llama_target_gguf, tmp_path):
    out = export_head(saved_heads["eagle3"], "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf,
                      speculative_tokens=4).path
    meta = json.loads((out / "specgraft_export.json").read_text())
    assert meta["llamacpp"] == {"target_gguf": "tiny-llama.gguf", "draft_file": "draft.gguf", "draft_tokens": 4}
    assert "--spec-draft-n-max 4" in (out / "README.md").read_text()


def test_distilled_draft_model_as_llamacpp_draft(llama_target, llama_target_gguf, tmp_path):
    """A distilled draft (a plain small Llama) becomes an ``-md`` GGUF with the target's tokenizer, key for key."""
    import gguf

    from specgraft.distill.output import save_draft
    from specgraft.testing import tiny_model

    student = tiny_model("llama", num_hidden_layers=1)
    folder = save_draft(tmp_path / "draft", student, llama_target.tokenizer, llama_target.identity)
    with pytest.raises(SpecgraftError, match="distilled draft model.*only --format llamacpp converts it"):
        export_head(folder, "vllm", tmp_path / "v")
    result = export_head(folder, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    assert result.head_type == "draft_model" and result.files == ["README.md", "draft.gguf", "specgraft_export.json"]
    meta, tensors = read_gguf(result.path / "draft.gguf")
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 1
    state = student.state_dict()
    assert torch.equal(tensors["blk.0.attn_k.weight"],
                       permute_qk(state["model.layers.0.self_attn.k_proj.weight"], student.config.num_key_value_heads))
    assert torch.equal(tensors["token_embd.weight"], state["model.embed_tokens.weight"])
    fields = gguf.GGUFReader(str(result.path / "draft.gguf")).fields
    for key, value, _, _ in read_target_gguf(llama_target_gguf).tokenizer_fields:
        assert fields[key].contents() == value, key
    assert "--spec-type draft-simple" in (result.path / "README.md").read_text()
    deeper = save_target_gguf(save_tiny_target(tmp_path / "deeper", num_hidden_layers=5), tmp_path / "deeper.gguf")
    with pytest.raises(SpecgraftError, match="not the target this draft was distilled for: it has layers 5"):
        export_head(folder, "llamacpp", tmp_path / "o2", target_gguf=deeper)
    assert not (tmp_path / "o2").exists()


def test_missing_or_other_llamacpp_build_is_named_with_the_build_command(tmp_path, monkeypatch):
    from specgraft.export.llamacpp_engine import BINARIES, HOME_ENV, llamacpp_bin

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "llama.cpp"))
    with pytest.raises(SpecgraftError, match=r"is not built in .*build it with `bash scripts/build_llamacpp.sh`"):
        llamacpp_bin()
    bin_dir = tmp_path / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in BINARIES:
        (bin_dir / name).write_text("")
    (tmp_path / "llama.cpp" / "BUILT").write_text("llama-cpp-python 0.3.20 built 2026-01-01T00:00:00Z\n")
    with pytest.raises(SpecgraftError, match="holds the llama.cpp of llama-cpp-python 0.3.20, not the pinned 0.3.36"):
        llamacpp_bin()
    (tmp_path / "llama.cpp" / "BUILT").write_text("llama-cpp-python 0.3.36 built 2026-01-01T00:00:00Z\n")
    assert llamacpp_bin() == bin_dir


def test_cli_llamacpp_export(saved_heads, llama_target_gguf, tmp_path, capsys):
    code = main(["export", str(saved_heads["eagle3"]), "--format", "llamacpp", "--out", str(tmp_path / "o"),
                 "--target-gguf", str(llama_target_gguf), "--speculative-tokens", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "exported the eagle3 head as llamacpp" in out and "  draft.gguf" in out
    assert "note: tiny-llama.gguf matches the head's target" in out
    assert "--spec-draft-n-max 2" in (tmp_path / "o" / "README.md").read_text()
    code = main(["export", str(saved_heads["eagle3"]), "--format", "llamacpp", "--out", str(tmp_path / "o"),
                 "--target-gguf", str(llama_target_gguf)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "exists and is not empty" in err[0] and "--overwrite" in err[0]


def _dflash_head(target, folder, seed: int = 3, **fields):
    """A saved DFlash head on ``target`` with every weight perturbed (norms too, so a dropped one shows)."""
    from specgraft.heads.dflash.config import resolve_dflash_config
    from specgraft.heads.dflash.model import DFlashHead

    torch.manual_seed(seed)
    head = DFlashHead.build(target, resolve_dflash_config(target, **fields))
    if head.config.reduced_vocab:
        head.prepare_from_data(torch.randint(0, 40, (target.vocab_size,), generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return head.eval(), head.save_pretrained(folder)


@pytest.mark.parametrize("draft_vocab_size", [0, 100])
def test_dflash_gguf_holds_what_llamacpp_reads_and_loads_back(llama_target, llama_target_gguf, tmp_path,
                                                              draft_vocab_size):
    """llama.cpp's ``dflash`` names, unpermuted q/k (NeoX RoPE), target layers in its numbering, the mask token in
    the draft's tokenizer; read back, the head drafts exactly what it drafted."""
    import gguf

    from specgraft.export import load_export
    from specgraft.heads.dflash.drafter import DFlashDrafter

    from ..heads.dflash.helpers import context_for

    head, folder = _dflash_head(llama_target, tmp_path / "head", block_size=5, num_layers=2, draft_layers="qwen3",
                                aux_layer_ids=[1, 3], mask_token_id=7, draft_vocab_size=draft_vocab_size)
    result = export_head(folder, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    meta, tensors = read_gguf(result.path / "draft.gguf")
    tc = llama_target.text_config
    assert meta["general.architecture"] == "dflash" and meta["dflash.block_count"] == 2
    assert meta["dflash.target_layers"] == [1, 3]  # llama.cpp captures the INPUT of layer i: our numbers
    assert meta["dflash.block_size"] == 5 and meta["dflash.embedding_length"] == tc.hidden_size
    assert meta["dflash.attention.head_count_kv"] == tc.num_key_value_heads
    state = head.state_dict()
    assert torch.equal(tensors["blk.1.attn_q.weight"], state["layers.1.self_attn.q_proj.weight"])  # not permuted
    assert torch.equal(tensors["blk.0.attn_k_norm.weight"], state["layers.0.self_attn.k_norm.weight"])
    assert torch.equal(tensors["enc.output_norm.weight"], state["hidden_norm.weight"])
    assert torch.equal(tensors["output_norm.weight"], state["norm.weight"])
    if draft_vocab_size:
        assert torch.equal(tensors["d2t"], state["d2t"] + torch.arange(100)) and "output.weight" in tensors
    else:
        assert "output.weight" not in tensors and "d2t" not in tensors  # the target's are borrowed
    fields = gguf.GGUFReader(str(result.path / "draft.gguf")).fields
    assert fields["tokenizer.ggml.mask_token_id"].contents() == 7
    for key, value, _, _ in read_target_gguf(llama_target_gguf).tokenizer_fields:
        assert fields[key].contents() == value, key
    card = (result.path / "README.md").read_text()
    assert "--spec-type draft-dflash" in card and "--spec-draft-n-max 4" in card  # the trained block of 5
    loaded = load_export(result.path, llama_target).eval()
    tokens = torch.randint(6, 300, (12,), generator=torch.Generator().manual_seed(0))
    want = DFlashDrafter(head).block_logits(context_for(llama_target, tokens, head.required_layers()))
    got = DFlashDrafter(loaded).block_logits(context_for(llama_target, tokens, head.required_layers()))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_what_the_dflash_gguf_cannot_hold(llama_target, llama_target_gguf, tmp_path):
    _, llama_layers = _dflash_head(llama_target, tmp_path / "llama-layers")  # LlamaDecoderLayer: no q/k norms
    with pytest.raises(SpecgraftError, match="per-head q/k RMS norms .*retrain with head.draft_layers: qwen3 .* or "
                                             "export it as native"):
        export_head(llama_layers, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    _, embeddings = _dflash_head(llama_target, tmp_path / "embeddings", draft_layers="qwen3", aux_layer_ids=[0, 2])
    with pytest.raises(SpecgraftError, match=r"aux layers \[0\] cannot be captured by llama.cpp"):
        export_head(embeddings, "llamacpp", tmp_path / "o", target_gguf=llama_target_gguf)
    assert not (tmp_path / "o").exists()


def test_dflash_biases_are_refused_naming_the_formats_that_hold_them():
    import dataclasses

    from specgraft.export.target_info import resolve_target
    from specgraft.heads.dflash.config import resolve_dflash_config
    from specgraft.heads.dflash.llamacpp import to_engine
    from specgraft.heads.dflash.model import DFlashHead
    from specgraft.target import Target
    from specgraft.testing import tiny_model, tiny_tokenizer

    target = Target(tiny_model("qwen3", attention_bias=True), tiny_tokenizer())
    head = DFlashHead.build(target, resolve_dflash_config(target))  # the target's own Qwen3 layers, with biases
    meta = {"head_type": "dflash", "target": target.identity.to_dict()}
    cfg = dataclasses.asdict(head.config)
    with pytest.raises(SpecgraftError, match=r"has no biases, but this head has \['layers.0.self_attn.k_proj.bias'.*"
                                             "export it as vllm, sglang or native"):
        to_engine("llamacpp", head.state_dict(), cfg, resolve_target(meta, target), "org/m", 3)
