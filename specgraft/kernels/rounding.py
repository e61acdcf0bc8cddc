"""How far a greedy answer is from the target's argmax, in units in the last place (ulps) of the model's dtype.

Greedy speculative decoding emits exactly what plain decoding emits when both compute the same logits. In fp32 they
do, to far below any logit gap. In bf16 (fp16) they do not: the verifier scores N tokens in one forward, plain
decoding one at a time, and the two roundings differ by a few ulps of the logits (on SmolLM2-135M in bf16, up to
0.5 at logits of 16-32, where one ulp is 0.125). Where two tokens tie at the top to within that, the two runs can
pick different ones and then continue differently; neither is "wrong".

:func:`greedy_gap_ulps` measures that: it teacher-forces the prompt and an answer through ONE forward of the
target and returns, over the answer's tokens, the largest gap between the top logit and the logit of the token
emitted, in ulps of the top logit. 0 means every emitted token is this forward's argmax; plain decoding's own
answer is itself a few ulps off in bf16 (it was computed one token at a time). The eval report calls a differing
answer **equal up to rounding** when its gap is at most :data:`ROUNDING_TIE_ULPS` or at most the plain answer's
own gap: a decoder bug (a wrong KV rollback, a token accepted against the argmax) puts a token many ulps below the
top (the second-best token of SmolLM2 in bf16 sits a median 10 ulps below it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specgraft.decoding.kv import model_device

#: Largest top-logit gap (in ulps of the model's dtype) that still counts as a rounding tie.
ROUNDING_TIE_ULPS = 2.0


def ulps(gap: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``gap`` in units in the last place of ``dtype`` at ``|reference|`` (elementwise, same shapes)."""
    eps = torch.finfo(dtype).eps  # the spacing of [1, 2)
    magnitude = reference.abs().clamp_min(torch.finfo(dtype).tiny)
    unit = eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return gap / unit


@torch.no_grad()
def greedy_gap_ulps(model: Any, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> float:
    """The largest (top logit - emitted token's logit) over ``answer_ids``, in ulps of the model's dtype, from one
    teacher-forced forward of ``prompt_ids + answer_ids`` (0.0 for an empty answer)."""
    if not answer_ids:
        return 0.0
    ids = torch.tensor([*prompt_ids, *answer_ids], dtype=torch.long, device=model_device(model))
    # The last A positions of prompt + answer[:-1] predict answer[0..A-1]: [A, V] in the model's dtype, the
    # values the decoders compared.
    logits = model(input_ids=ids[None, :-1], logits_to_keep=len(answer_ids)).logits[0, -len(answer_ids):]
    emitted = torch.tensor(answer_ids, dtype=torch.long, device=logits.device)
    top = logits.max(-1).values  # [A]
    gap = (top - logits.gather(-1, emitted[:, None]).squeeze(-1)).float()
    return float(ulps(gap, top.float(), logits.dtype).max())


def equal_up_to_rounding(spec_gap: float | None, base_gap: float | None) -> bool:
    """Whether a speculative answer that differs from plain decoding's is still a greedy answer up to rounding:
    no token further below the top logit than :data:`ROUNDING_TIE_ULPS` or than plain decoding's own answer."""
    if spec_gap is None:
        return False
    return spec_gap <= max(ROUNDING_TIE_ULPS, base_gap or 0.0)
