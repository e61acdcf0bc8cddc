"""Draft-tree utilities and the tree-attention forward on stock transformers models."""

from __future__ import annotations

import pytest
import torch

from specgraft.decoding import kv
from specgraft.decoding.tree import (
    DraftTree,
    ancestor_matrix,
    children_table,
    depths,
    is_chain,
    leaves,
    level_visibility,
    path_to,
    prune_to_depth,
    strict_ancestors,
    tree_attention_mask,
    tree_structure,
    verification_inputs,
    visibility,
)
from specgraft.errors import SpecgraftError
from specgraft.testing import tiny_model

PARENTS = [-1, -1, 0, 0, 1, 2, 5]  # two roots' children; node 6 is at depth 4


def test_structure_helpers():
    assert depths(PARENTS).tolist() == [1, 1, 2, 2, 2, 3, 4]
    assert children_table(PARENTS) == [[0, 1], [2, 3], [4], [5], [], [], [6], []]
    assert path_to(PARENTS, 6) == [0, 2, 5, 6]
    assert path_to(PARENTS, 1) == [1]
    assert leaves(PARENTS) == [3, 4, 6]
    anc = ancestor_matrix(PARENTS)
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        expected[i, path_to(PARENTS, i)] = True
    assert torch.equal(anc, expected)


def test_ancestor_walk_and_level_visibility_agree_with_the_ancestor_matrix():
    anc = ancestor_matrix(PARENTS)
    for node in range(len(PARENTS)):
        walk = strict_ancestors(PARENTS, node)
        assert walk == path_to(PARENTS, node)[:-1][::-1]  # parent first
        assert sorted([*walk, node]) == anc[node].nonzero().flatten().tolist()
    assert strict_ancestors(PARENTS, -1) == []
    # One level fed after 5 cached slots of which 3 are the committed context: rows see that context, their
    # ancestors' slots and themselves, nothing else (slot 3 belongs to no row's ancestors).
    vis = level_visibility(3, 5, [[4], [], [4, 3]])
    expected = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 1, 0, 0, 1]]).bool()
    assert vis.dtype == torch.bool and torch.equal(vis, expected)


def test_chain_tree():
    tree = DraftTree.chain([7, 8, 9])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert is_chain(tree.parents) and is_chain([]) and not is_chain(PARENTS) and not is_chain([-1, -1])
    assert depths(tree.parents).tolist() == [1, 2, 3]
    assert DraftTree.empty().size == 0


def test_tree_attention_mask_by_hand():
    mask = tree_attention_mask([-1, -1, 0], past_len=2)
    assert mask.shape == (1, 1, 4, 6)
    lo = torch.finfo(torch.float32).min
    # columns: prefix0, prefix1, root, node0, node1, node2 ; rows: root, node0, node1, node2
    allowed = [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    expected = torch.tensor([[0.0 if a else lo for a in row] for row in allowed])
    assert torch.equal(mask[0, 0], expected)
    # sliding window 2: a query at position t sees keys at positions > t - 2
    mask = tree_attention_mask([-1, -1, 0], past_len=2, sliding_window=2)
    # positions: keys 0, 1, 2, 3, 3, 4 ; queries 2, 3, 3, 4
    allowed = [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 0, 1]]
    expected = torch.tensor([[0.0 if a else lo for a in row] for row in allowed])
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("window", [None, 2])
def test_cached_tree_mask_equals_the_reference_mask(window):
    """The decoder's mask (the structure's cached block after an all-visible prefix) is the reference mask."""
    structure = tree_structure(tuple(PARENTS))
    layout = kv.AttentionLayout(("sliding_attention",) if window else ("full_attention",), False, window)
    for past in (0, 3, 9):
        pos = structure.row_depths() + past
        key_pos = torch.cat([torch.arange(past), pos])
        mask = layout.tree_mask(structure, past, pos, key_pos, torch.float32)
        assert torch.equal(mask, tree_attention_mask(PARENTS, past, sliding_window=window))
    assert structure.additive_block(torch.float32) is structure.additive_block(torch.float32)  # built once
    assert tree_structure(tuple(PARENTS)) is structure  # one structure per shape


def test_structure_and_from_lists():
    tree = DraftTree.from_lists([4, 5, 6], [-1, -1, 0])
    assert tree.structure is tree_structure((-1, -1, 0)) and tree.parents.tolist() == [-1, -1, 0]
    assert tree.structure.children == ((0, 1), (2,), (), ())
    assert tree.structure.row_max_children == (2, 1, 0) and tree.structure.max_depth == 2
    assert DraftTree.chain([1, 2]).structure.chain and not tree.structure.chain
    with pytest.raises(SpecgraftError, match="topologically"):
        DraftTree.from_lists([1, 2], [-1, 1])


def test_verification_inputs_positions():
    tree = DraftTree(tokens=torch.tensor([4, 5, 6]), parents=torch.tensor([-1, -1, 0]))
    ids, pos = verification_inputs(tree, root_token=9, past_len=10)
    assert ids.tolist() == [[9, 4, 5, 6]]
    assert pos.tolist() == [[10, 11, 11, 12]]


def test_prune_to_depth_keeps_shallow_nodes():
    tree = DraftTree(tokens=torch.arange(10, 17), parents=torch.tensor(PARENTS), q=torch.eye(7, 20), sampled=True)
    pruned, kept = prune_to_depth(tree, 2)
    assert kept == [0, 1, 2, 3, 4]
    assert pruned.parents.tolist() == [-1, -1, 0, 0, 1]
    assert pruned.tokens.tolist() == [10, 11, 12, 13, 14]
    assert torch.equal(pruned.q, torch.eye(7, 20)[:5]) and pruned.sampled
    same, kept = prune_to_depth(tree, 4)
    assert same is tree and kept == list(range(7))
    assert prune_to_depth(tree, 0)[0].size == 0


@pytest.mark.parametrize("tree,need_q", [
    (DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1])), False),  # parent not before child
    (DraftTree(torch.tensor([1, 500]), torch.tensor([-1, 0])), False),  # token outside the vocab
    (DraftTree(torch.tensor([1, 2]), torch.tensor([-1])), False),  # length mismatch
    (DraftTree(torch.tensor([1]), torch.tensor([-1]), q=torch.ones(1, 7)), False),  # q not over the full vocab
    (DraftTree(torch.tensor([1]), torch.tensor([-1]), sampled=True), True),  # sampled without q
    (DraftTree(torch.tensor([1]), torch.tensor([-1]), q=torch.eye(320)[:1], sampled=True), True),  # q(token) = 0
])
def test_validate_rejects_bad_trees(tree, need_q):
    with pytest.raises(SpecgraftError):
        tree.validate(320, need_q=need_q)


def _tree_logits(model, prompt, tree, sliding_override=None):
    """Logits of [root] + tree nodes from one masked forward after prefilling prompt[:-1]."""
    layout = kv.attention_layout(model)
    if sliding_override is not None:
        layout = kv.AttentionLayout(layout.kinds, layout.per_type, sliding_override)
    cache = kv.new_cache()
    model(input_ids=prompt[:, :-1], cache=cache, use_cache=True)
    past = kv.cache_length(cache)
    ids, pos = verification_inputs(tree, int(prompt[0, -1]), past)
    key_pos = torch.cat([torch.arange(past), pos[0]])
    out = kv.masked_forward(model, layout, cache, ids, pos[0], key_pos, visibility(tree.parents, past))
    assert kv.cache_length(cache) == past + tree.size + 1
    return out.logits[0]


def _path_logits(model, prompt, tree):
    rows = [model(input_ids=prompt).logits[0, -1]]
    for i in range(tree.size):
        seq = torch.cat([prompt[0], tree.tokens[path_to(tree.parents, i)]]).unsqueeze(0)
        rows.append(model(input_ids=seq).logits[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def test_tree_forward_equals_sequential_paths(tiny_arch):
    model = tiny_model(tiny_arch)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (1, 9), generator=g)
    tree = DraftTree(torch.randint(3, 300, (7,), generator=g), torch.tensor(PARENTS))
    torch.testing.assert_close(_tree_logits(model, prompt, tree), _path_logits(model, prompt, tree),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch,overrides", [
    ("gemma2", {"sliding_window": 4}),  # alternating sliding / full layers: a mask per layer type
    ("gemma3_text", {"sliding_window": 4}),  # all sliding
    ("gemma3_text", {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("mistral", {"sliding_window": 4}),  # no layer_types: one sliding mask for every layer
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
])
@torch.no_grad()
def test_tree_forward_with_sliding_window_shorter_than_prefix(arch, overrides):
    model = tiny_model(arch, **overrides)
    layout = kv.attention_layout(model)
    assert layout.sliding_window == 4
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 300, (1, 10), generator=g)
    tree = DraftTree(torch.randint(3, 300, (7,), generator=g), torch.tensor(PARENTS))
    reference = _path_logits(model, prompt, tree)
    torch.testing.assert_close(_tree_logits(model, prompt, tree), reference, atol=2e-5, rtol=0)
    # Control: without the window in the mask the logits differ, so the check above has teeth.
    wrong = _tree_logits(model, prompt, tree, sliding_override=10_000)
    assert (wrong - reference).abs().max() > 1e-3


def test_unsupported_attention_is_refused():
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(SpecgraftError, match="4D tree mask"):
        kv.attention_layout(model)
    model = tiny_model("gemma3_text", use_bidirectional_attention=True)
    with pytest.raises(SpecgraftError, match="bidirectional"):
        kv.attention_layout(model)


@torch.no_grad()
def test_keep_positions_gathers_the_accepted_rows():
    model = tiny_model("llama")
    cache = kv.new_cache()
    model(input_ids=torch.arange(3, 11).unsqueeze(0), cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    kv.keep_positions(cache, 3, [1, 4])
    for (k, v), layer in zip(before, cache.layers):
        idx = torch.tensor([0, 1, 2, 4, 7])
        assert torch.equal(layer.keys, k[:, :, idx]) and torch.equal(layer.values, v[:, :, idx])
    # only the out-of-place rows moved: the prefix stayed in the same storage (no copy of the whole cache)
    model(input_ids=torch.arange(3, 9).unsqueeze(0), cache=cache, use_cache=True)  # 5 + 6 = 11 positions
    storage = [layer.keys.data_ptr() for layer in cache.layers]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    kv.keep_positions(cache, 6, [0, 2, 4])
    for (k, v), layer, ptr in zip(before, cache.layers, storage):
        idx = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 10])
        assert torch.equal(layer.keys, k[:, :, idx]) and torch.equal(layer.values, v[:, :, idx])
        assert layer.keys.data_ptr() == ptr
    kv.keep_positions(cache, 2, [0, 1])  # a prefix: cropped
    assert kv.cache_length(cache) == 4
    kv.crop_cache(cache, 1)
    assert kv.cache_length(cache) == 1
