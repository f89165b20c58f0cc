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
    # fused fp32 CPU decode kernels (k3serve/ops/cpu/native/): MLA over the paged cache, the KDA step
    Pybind11Extension(
        "k3serve.ops.cpu._kernels",
        ["k3serve/ops/cpu/native/module.cpp"],
        depends=[f"k3serve/ops/cpu/native/{h}.h" for h in ("kda_decode", "mla_decode", "simd")],
        cxx_std=17,
        extra_compile_args=["-O3", "-Wno-psabi"],  # psabi: notes on vector types, which never cross an ABI boundary
    ),
]

setup(ext_modules=ext_modules)
