"""nn building blocks shared by both model families: norms, activations, KDA, MLA, MoE, AttnRes, vision."""
