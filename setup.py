"""Build hooks: native extensions are declared here (pyproject.toml holds the metadata)."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

ext_modules = [
    # the Kimi tokenizer core (k3serve/tokenizer/native/); headers are listed so edits rebuild it
    Pybind11Extension(
        "k3serve.tokenizer._native",
        ["k3serve/tokenizer/native/module.cpp"],
        depends=[f"k3serve/tokenizer/native/{h}.h" for h in (
            "bpe", "classes", "core", "cuts", "linear_bpe", "prefix_trie", "pretokenize", "py_core",
            "py_decode", "py_text", "segment_cache", "small_pairs", "thread_pool", "tiktoken_file",
            "unicode_tables", "vocab")],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
    # fused fp32 CPU decode kernels, one module for all: each kernel beside its op (k3serve/ops/<op>/native/),
    # the shared SIMD helpers and the pybind module in k3serve/ops/native/; MLA over the paged cache, the KDA step
    Pybind11Extension(
        "k3serve.ops.native._kernels",
        ["k3serve/ops/native/module.cpp"],
        include_dirs=["k3serve/ops"],
        depends=["k3serve/ops/native/simd.h", "k3serve/ops/kda/native/kda_decode.h",
                 "k3serve/ops/mla/native/mla_decode.h"],
        cxx_std=17,
        extra_compile_args=["-O3", "-Wno-psabi"],  # psabi: notes on vector types, which never cross an ABI boundary
    ),
]

setup(ext_modules=ext_modules)
