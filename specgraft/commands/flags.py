"""Flags several decoding commands share (``eval``, ``profile``, ``tune``)."""

from __future__ import annotations

import argparse

from specgraft.kernels.choices import ATTENTION_KERNELS, LINEAR_KERNELS


def add_linear_kernel_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--linear-kernel {auto,weight-major,stock}`` to a decoding command."""
    parser.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto",
                        help="matmul layout for the few-row products of decoding: weight-major computes (W @ x^T)^T, "
                             "which MKL runs at about the one-token cost for 2-16 tokens on some CPUs and at twice "
                             "it on others; auto (default) times both on this machine's layers for fp32 on CPU and "
                             "keeps the faster; stock keeps nn.Linear")


def add_attention_kernel_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--attention-kernel {auto,stock,gqa,exact}`` to a decoding command."""
    parser.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="auto",
                        help="stock: the target's own attention (sdpa); gqa: sdpa that broadcasts grouped KV heads "
                             "in the masked multi-row calls of verification on the CPU instead of copying them "
                             "(plain one-token steps are unchanged); exact: each verification row computed by the "
                             "same sdpa call plain one-token decoding makes, so greedy answers are token-identical to "
                             "plain decoding with the stock kernels in fp32 and bf16 (the linear layers multiply as "
                             "few rows per product as this machine computes row by row, one if need be: then slow); "
                             "plain steps and the prefill are the stock ones; refused in one line for sliding-window "
                             "or soft-capped models; auto (default): gqa on the CPU for an sdpa model with grouped KV "
                             "heads, else stock")
