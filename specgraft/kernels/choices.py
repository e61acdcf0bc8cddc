"""The kernel choices of ``specgraft eval``/``profile``/``tune`` (``--linear-kernel``, ``--attention-kernel``).

Import-light (no torch) so that command parsers can offer them as ``choices``."""

#: ``--linear-kernel`` choices (:mod:`specgraft.kernels.linear`): ``auto`` measures both layouts for fp32 on CPU and
#: keeps the faster (stock elsewhere); ``weight-major`` forces it; ``stock`` leaves ``nn.Linear`` as it is.
LINEAR_KERNELS = ("auto", "weight-major", "stock")
#: ``--attention-kernel`` choices: ``stock`` keeps the model's attention (sdpa); ``gqa`` is sdpa broadcasting
#: grouped KV heads in masked multi-row calls on the CPU (:mod:`specgraft.kernels.gqa_attention`); ``exact`` is
#: :mod:`specgraft.kernels.exact_attention`'s; ``auto`` (the default) is ``gqa`` on the CPU for an sdpa model with
#: grouped KV heads, else ``stock``.
ATTENTION_KERNELS = ("auto", "stock", "gqa", "exact")
