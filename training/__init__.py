"""Training the default K3 model: synthetic K3-format tasks (``tasks``, ``pools``, ``render``), the curriculum
and batches (``data``), a differentiable KDA backend and full-sequence forward (``kda_autograd``, ``forward``),
the compact vocabulary (``vocab``), MXFP4 QAT and packing (``qat``) and the trainer/exporter (``train``)."""
