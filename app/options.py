"""What the CLI's subcommands share: the start time, the model and cache flags, and the CacheConfig they give.

Its own module so that app.cli (which dispatches to app.commands and app.bench.sweep) and those modules import it
rather than each other: under `python -m app.cli` a `from app.cli import ...` ran the module a second time,
with a T_START taken only when the subcommand was imported.
"""

from __future__ import annotations

import argparse
import time

T_START = time.perf_counter()


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a .gguf file or a HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model and the device tier live")
    p.add_argument("--weights-dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16", "int8", "int4"),
                   help="dtype of the weights and of the forward pass (auto: bf16 on CUDA, fp32 on CPU; a GGUF is "
                        "dequantized straight to it); int8 / int4: linear weights and embeddings kept packed "
                        "(int8 per row, int4 per group of 32; a Llama GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q6_K/Q8_0 tensors "
                        "loaded as they are), math in fp32")
    p.add_argument("--quant-activations", default="int8", choices=("int8", "fp32"),
                   help="with --weights-dtype int8/int4 on the CPU: int8 rounds each matmul's input to int8 per 32 "
                        "values and takes integer dot products (llama.cpp's Q8 activations: its speed, logits within "
                        "~1e-2; `kvscope bench --weights-quality` measures the tokens); fp32 multiplies the input as "
                        "it is (the dequantized weights' exact math, slower)")
    p.add_argument("--attention", default="auto", choices=("auto", "reference", "cpu", "chunked", "triton"),
                   help="attention backend over the paged cache: cpu reads the blocks in place (a numba-compiled "
                        "loop when numba imports, else chunked), chunked the torch path (gathered chunks, online "
                        "softmax, any device), triton a paged-decode kernel (CUDA), reference the dense gather + "
                        "SDPA; auto: triton on CUDA when it imports, else cpu (reference for bf16/fp16 weights on the CPU, "
                        "which match transformers in that dtype)")
    p.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off", "static"),
                   help="replay decode steps from CUDA graphs, one per batch-size bucket (auto: on with CUDA and a "
                        "paged attention backend; static: the graphs' padded static-shaped step run eagerly, a check)")
    p.add_argument("--kv-groups", default="auto", choices=("auto", "off"),
                   help="KV-cache groups: auto keeps a pool per attention type (full layers; each sliding window, "
                        "whose blocks are let go once they leave every window: Gemma 2/3, GPT-OSS); off keeps every "
                        "layer's K/V for every token in one pool (a window is then only a mask)")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    from engine.config import KNOBS

    p.add_argument("--block-size", type=int, help=KNOBS["block_size"].help)
    p.add_argument("--kv-dtype", choices=KNOBS["kv_dtype"].choices, help=KNOBS["kv_dtype"].help)
    p.add_argument("--device-budget-mb", type=float, help=KNOBS["device_budget_mb"].help)
    p.add_argument("--host-budget-mb", type=float, help=KNOBS["host_budget_mb"].help)
    p.add_argument("--policy", choices=KNOBS["policy"].choices, help=KNOBS["policy"].help)
    p.add_argument("--decay", type=float, help=KNOBS["decay"].help)
    p.add_argument("--demote-after", dest="demote_after_s", type=float, help=KNOBS["demote_after_s"].help)
    p.add_argument("--prefetch-depth", type=int, help=KNOBS["prefetch_depth"].help)
    p.add_argument("--evict-batch", type=int, help=KNOBS["evict_batch"].help)
    p.add_argument("--host-reads", choices=KNOBS["host_reads"].choices, help=KNOBS["host_reads"].help)
    p.add_argument("--device-layers", type=int, metavar="N", help=KNOBS["device_layers"].help)
    p.add_argument("--shadow-every", dest="shadow_every_s", type=float, metavar="S", help=KNOBS["shadow_every_s"].help)
    p.add_argument("--context-limit", type=int, help="tokens per sequence before a context shift (default: the model's)")
    p.add_argument("--n-keep", type=int, default=0, help="tokens a context shift keeps at the start")


def cache_config(args: argparse.Namespace):
    from engine.config import KNOBS, CacheConfig

    changes = {k: getattr(args, k) for k in KNOBS if getattr(args, k, None) is not None}
    return CacheConfig().replace(**changes)
