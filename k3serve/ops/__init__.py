"""Functional kernels, one package per op family; importing this package registers every serving form with
``ops.registry`` (the trainer registers its own from ``training/``).

Naming rule (files and registry backends):
  ``ops/<op>/naive.py``   the spec: plain, obviously correct (per token / per row / per element loops or the
                          textbook formula in fp32); every other form is tested against it. Registered as
                          backend ``"naive"`` of each op it specifies with the same call signature.
  ``ops/<op>/<what>.py``  the torch forms, named by what they are (``chunk``, ``decode``, ``paged``, ``rms``,
                          ``glu``, ``mix``…); the default one is backend ``"torch"``, alternatives are named by
                          their method (``"bucketed"``, ``"grouped"``).
  ``ops/<op>/cpu.py``     the Python wrapper of a native CPU kernel, backend ``"cpu"``: same arguments and
                          result as the torch form, falling back to it when the kernel does not apply.
  ``ops/<op>/native/``    that kernel's C++ source (headers), beside its op; ``ops/native/`` holds what all
                          kernels share (SIMD helpers, the one pybind module ``_kernels`` and its loader).
  ``"train"``             forms with hand-written backwards, registered by ``training/`` (never imported here).
Each package's ``__init__`` registers its forms (with a priority and an ``accepts`` predicate where a form
serves only some inputs); layers ask the registry for an op, which dispatches each call to the best form that
accepts its inputs (``registry.py``).
"""

from k3serve.ops import activation, attn_res, kda, mla, moe, mx, norm, registry, short_conv  # noqa: F401
