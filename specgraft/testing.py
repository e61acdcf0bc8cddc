"""Test kit: tiny random targets of several architectures and a byte-level tokenizer, built in-process.

Nothing here downloads anything. Used by the test-suite, the benchmarks and the dry-run of real-model recipes.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from specgraft.decoding.drafters import DraftModelDrafter, RandomDrafter, SelfDrafter
from specgraft.heads.registry import family_names, get_family
from specgraft.target import Target

#: Architectures every component is tested on (transformers ``model_type`` names).
TINY_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")

#: A ChatML-style template, so tests exercise the chat-template path with a fully offline tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>")


def tiny_config(
    model_type: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    **overrides,
):
    """A tiny random config of ``model_type`` (any decoder-only architecture transformers knows)."""
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if model_type in ("gemma2", "gemma3_text", "qwen3"):
        kwargs["head_dim"] = hidden_size // num_attention_heads
    if model_type in ("gemma2", "gemma3_text"):
        # Keep sliding windows larger than any test sequence so tree masks are the only masking at play.
        kwargs["sliding_window"] = max_position_embeddings
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str = "llama", seed: int = 0, **config_overrides) -> PreTrainedModel:
    """A tiny randomly initialised causal LM of ``model_type`` in fp32 eval mode."""
    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def builtin_drafters(model: PreTrainedModel, seed: int = 0, noise: float = 0.05) -> dict[str, Callable[[], Any]]:
    """Factories of every built-in drafter for ``model``, by name: the target drafting for itself (a chain and a
    tree), random chains, a draft model (a perturbed copy of the target, chain and tree) and an untrained head of
    every built-in family (weights perturbed by ``noise`` so that it agrees with the target only now and then), in
    its default setting and as a chain. Heads are built in the target's dtype; each factory builds afresh."""
    vocab = int(model.config.get_text_config().vocab_size)
    dtype = next(model.parameters()).dtype

    def draft_model(**kwargs: Any) -> Any:
        draft = copy.deepcopy(model)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_((torch.randn_like(p.float()) * noise * p.float().std().clamp_min(1e-3)).to(p.dtype))
        return DraftModelDrafter(draft, **kwargs)

    def head(name: str, chain: bool) -> Any:
        family = get_family(name)
        target = Target(model)
        # A family that drafts from a mask token (DFlash) gets the last id: the tiny test tokenizers have none.
        wants_mask = "mask_token_id" in {f.name for f in dataclasses.fields(family.config)}
        overrides = {"mask_token_id": vocab - 1} if wants_mask else {}
        torch.manual_seed(seed)
        built = family.head.build(target, family.config(**overrides).resolve(target))
        with torch.no_grad():
            for p in built.parameters():
                p.add_(torch.randn_like(p) * noise)
        built = built.to(dtype).eval()
        setting = ({"mode": "chain"} if chain else family.search.default_setting(built))
        return family.drafter(built, setting)

    factories: dict[str, Callable[[], Any]] = {
        "self_chain": lambda: SelfDrafter(k=4),
        "self_tree": lambda: SelfDrafter(k=4, tree_topk=(2, 2)),
        "random_chain": lambda: RandomDrafter(vocab, k=4),
        "draft_model_chain": lambda: draft_model(k=4),
        "draft_model_tree": lambda: draft_model(k=3, tree_topk=(3, 2)),
    }
    for name in family_names():
        factories[f"{name}_default"] = functools.partial(head, name, False)
        factories[f"{name}_chain"] = functools.partial(head, name, True)
    return factories


def tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (262 ids: 6 specials + 256 bytes) with an optional ChatML chat template.

    Every string round-trips exactly; ids stay below 320, the vocab size of :func:`tiny_model`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


#: A small repetitive English corpus tiny targets and heads learn within a few steps (training tests).
TINY_CORPUS_TEXT = "\n\n".join(
    f"the cat number {i} sat on the mat and looked at the dog number {i + 1}. " * 3 for i in range(40)
)


def recipe_writer(folder: Path, base: dict[str, dict[str, Any]]) -> Callable[..., Path]:
    """A function ``write(name="recipe.yaml", **sections)`` that saves ``base`` as YAML in ``folder``, each given
    section's keys updated (``write(training={"max_steps": 4})``; ``None`` drops a section, and a ``head`` of
    another ``type`` replaces the base's head section), and returns the file's path."""

    def write(name: str = "recipe.yaml", **sections: dict[str, Any] | None) -> Path:
        recipe = copy.deepcopy(base)
        for section, values in sections.items():
            if values is None:  # drop the section (e.g. head: for a distillation recipe)
                recipe.pop(section, None)
            elif section == "head" and values.get("type", recipe.get("head", {}).get("type")) != \
                    recipe.get("head", {}).get("type"):
                recipe["head"] = dict(values)  # another family's section: its fields replace the base's
            else:
                recipe.setdefault(section, {}).update(values)
        path = folder / name
        path.write_text(yaml.safe_dump(recipe))
        return path

    return write


def write_tiny_gguf(path: str | Path, architecture: str = "llama", seed: int = 0,
                    source_repo_url: str | None = None, drop_tensors: tuple[str, ...] = (),
                    block_count: int | None = None, context_length: int = 64) -> Path:
    """Write a tiny random Llama-layout GGUF (float32 tensors, byte-level BPE tokenizer, ChatML template).

    A few tens of KB: what GGUF conversion and caching tests load instead of a real 100 MB file. ``architecture``
    only changes the ``general.architecture`` field (a name transformers cannot load exercises the refusal);
    ``source_repo_url`` is written as ``general.source.repo_url`` (the Hub repository it claims to come from).
    ``drop_tensors``, ``block_count`` and ``context_length`` make files whose metadata disagrees with their
    tensors (the conversion must refuse them). Needs the ``gguf`` package.
    """
    import gguf
    import numpy as np
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(seed)
    tokens = list(_SPECIAL_TOKENS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += [m.replace(" ", "") for m in merges]
    vocab, hidden, layers, heads, kv_heads, ffn = len(tokens), 16, 2, 2, 1, 32
    head_dim = hidden // heads
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("specgraft tiny test model")
    if source_repo_url is not None:
        writer.add_source_repo_url(source_repo_url)
    writer.add_block_count(layers if block_count is None else block_count)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    n_special = len(_SPECIAL_TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * n_special + [gguf.TokenType.NORMAL] * (vocab - n_special))
    writer.add_token_merges(merges)
    writer.add_pad_token_id(_SPECIAL_TOKENS.index("<pad>"))
    writer.add_bos_token_id(_SPECIAL_TOKENS.index("<s>"))
    writer.add_eos_token_id(_SPECIAL_TOKENS.index("</s>"))
    writer.add_unk_token_id(_SPECIAL_TOKENS.index("<unk>"))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    def weight(*shape: int) -> np.ndarray:  # torch layout [out, in]; the writer stores GGUF's reversed dims
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def add(name: str, tensor: np.ndarray) -> None:
        if name not in drop_tensors:
            writer.add_tensor(name, tensor)

    add("token_embd.weight", weight(vocab, hidden))
    add("output_norm.weight", 1 + weight(hidden))
    for i in range(layers):
        block = f"blk.{i}."
        add(block + "attn_norm.weight", 1 + weight(hidden))
        add(block + "ffn_norm.weight", 1 + weight(hidden))
        add(block + "attn_q.weight", weight(hidden, hidden))
        add(block + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        add(block + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        add(block + "attn_output.weight", weight(hidden, hidden))
        add(block + "ffn_gate.weight", weight(ffn, hidden))
        add(block + "ffn_up.weight", weight(ffn, hidden))
        add(block + "ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: What a torchrun worker's C++ runtime prints when it aborts at exit (a joinable thread destroyed during teardown);
#: seen in 2 of about 40 CI runs after the run's result was written, never in dozens of local reruns.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(args: list[str], env: dict[str, str], nproc: int = 2,
                 timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node nproc *args`` (a free rendezvous port),
    output captured; one retry when a worker died with :data:`TEARDOWN_ABORT`, the launcher's teardown abort, not
    the property a test checks. Any other failure, or a second abort, is returned as it is."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    for _ in range(2):
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if run.returncode == 0 or TEARDOWN_ABORT not in run.stderr:
            break
    return run
