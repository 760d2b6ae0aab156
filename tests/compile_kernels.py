"""Compile the Triton kernels for a GPU target without a GPU (Triton ships ptxas), with the first
config of each kernel's list for that target. Run as a script with TRITON_INTERPRET unset:

    python tests/compile_kernels.py 90 bf16     # sm_90 (H100, H200), bfloat16 inputs

Prints one line per kernel variant and exits non-zero if one fails to compile."""

from __future__ import annotations

import os
import sys

import torch


def main(arch: int, dtype: str) -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling needs TRITON_INTERPRET unset"
    torch.cuda.is_available = lambda: True  # the target's config lists, without a device
    torch.cuda.get_device_capability = lambda *args: (arch // 10, arch % 10)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_spanattn.ops.triton import kernels

    ptr = "*" + dtype
    types = dict(Q=ptr, K=ptr, V=ptr, O=ptr, DO=ptr, Y=ptr, X=ptr, DV_OUT=ptr, LSE="*fp32", DELTA="*fp32",
                 BIAS="*fp32", SEED="*i64", GY="*fp32", GX="*fp32", B="i32", H_Q="i32", H_KV="i32", T="i32",
                 S="i32", scale="fp32", scale_after="fp32", scale_log2="fp32", p_drop="fp32")
    common = dict(D=64, DV=64, BLOCK_D=64, BLOCK_DV=64, CAUSAL=True, HAS_BIAS=True, UPCAST=False,
                  PRECISION="ieee" if dtype == "fp32" else "tf32")
    variants = [(kernels.forward_kernel, dict(W=0)),
                (kernels.keys_kernel, dict(W=128, BLOCK_W=128, Y_IS_Q=False, WANT_DV=True, WANT_GY=True)),
                (kernels.keys_kernel, dict(W=64, BLOCK_W=64, Y_IS_Q=True, WANT_DV=False, WANT_GY=True)),
                (kernels.queries_kernel, dict(W=128, BLOCK_W=128, X_IS_K=False, X_PER_QUERY_HEAD=False)),
                (kernels.queries_kernel, dict(W=64, BLOCK_W=64, X_IS_K=True, X_PER_QUERY_HEAD=True))]
    failed = 0
    for tuner, extra in variants:
        config = tuner.configs[0]
        for dropout in (False, True):
            fn = tuner.fn
            constants = dict(common, **extra, **config.kwargs, DROPOUT=dropout)
            signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
            source = ASTSource(fn=fn, signature=signature,
                               constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
            try:
                triton.compile(source, target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
                print(f"{fn.__name__} {config} dropout={dropout}: compiled")
            except Exception as error:  # report every variant, then fail
                failed += 1
                print(f"{fn.__name__} {config} dropout={dropout}: {type(error).__name__}: {error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2]))
