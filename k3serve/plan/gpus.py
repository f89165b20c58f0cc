"""Sourced GPU table for the planner: usable memory, HBM bandwidth, dense tensor FLOPS, NVLink, topology.

Figures come from /work/shared/design/planner_ep_sandbox.md §1 and the sources it cites (each row names its
own). ``usable_bytes`` is what ``nvidia-smi``/the CUDA allocator exposes (MiB x 2^20), not the marketing
capacity; ``nominal_gb`` is the marketing figure, kept to recognise and correct contradicting inputs.
FLOPS are dense (no 2:4 sparsity). ``fp4_flops`` is ``None`` on Hopper, which has no FP4 tensor cores
(MXFP4 experts run weight-only W4A16 there).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
AIC = "ai-dynamo/aiconfigurator aic-core/src/aiconfigurator_core/systems"


@dataclass(frozen=True)
class GPU:
    name: str
    nominal_gb: float
    usable_bytes: int
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float | None
    nvlink_bandwidth: float  # bytes/s per GPU, both directions
    gpus_per_node: int
    nvlink_domain: int  # GPUs reachable at NVLink speed (8 for HGX, 72 for an NVL72 rack)
    source: str
    rack: str | None = None  # NVL72 rack name when the GPU ships in one

    def __post_init__(self) -> None:
        if self.usable_bytes <= 0 or self.hbm_bandwidth <= 0 or self.bf16_flops <= 0:
            raise ValueError(f"GPU {self.name}: memory, bandwidth and FLOPS must be positive")
        if self.nvlink_domain % self.gpus_per_node:
            raise ValueError(f"GPU {self.name}: NVLink domain {self.nvlink_domain} is not whole nodes")

    @property
    def is_rack_scale(self) -> bool:
        return self.rack is not None

    @property
    def has_fp4(self) -> bool:
        return self.fp4_flops is not None


HOPPER_NVLINK = 900e9  # NVLink4
BLACKWELL_NVLINK = 1.8e12  # NVLink5

GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("H100", 80, 81_559 * MIB, 3.35e12, 989e12, 1979e12, None, HOPPER_NVLINK, 8, 8,
        "NVIDIA H100 SXM datasheet (hpctech archive, sparse halved); glennklockwood.com/garden/processors/h100; "
        f"{AIC}/h100_sxm.yaml"),
    GPU("H200", 141, 143_771 * MIB, 4.8e12, 989e12, 1979e12, None, HOPPER_NVLINK, 8, 8,
        f"NVIDIA H200 SXM datasheet; {AIC}/h200_sxm.yaml (nvidia-smi 143,771 MiB)"),
    GPU("H20", 96, 97_871 * MIB, 4.0e12, 148e12, 296e12, None, HOPPER_NVLINK, 8, 8,
        "willitrunai.com/es/gpus/h20-96gb; nvidia-smi of an H20 in a public log (97,871 MiB)"),
    GPU("H20-3e", 141, 143_771 * MIB, 4.8e12, 148e12, 296e12, None, HOPPER_NVLINK, 8, 8,
        f"{AIC}/h20_3e.yaml (git history)"),
    GPU("B200", 192, 184_320 * MIB, 8.0e12, 2.25e15, 4.5e15, 9e15, BLACKWELL_NVLINK, 8, 8,
        "NVIDIA Blackwell datasheet (nvdam.widen.net/s/wwnsxrhm2w); DGX B200 1,440 GB / 8; "
        f"glennklockwood.com/garden/processors/B200; {AIC}/b200_sxm.yaml (180 GiB)"),
    GPU("B300", 288, 275_040 * MIB, 8.0e12, 2.25e15, 4.5e15, 13.5e15, BLACKWELL_NVLINK, 8, 8,
        "NVIDIA Blackwell Ultra datasheet; DGX B300 2.3 TB / 8 (aiwiki.ai/wiki/nvidia_dgx_b300); "
        f"glennklockwood.com/garden/processors/B300; {AIC}/b300_sxm.yaml (275,040 MiB)"),
    GPU("GB200", 186, 189_471 * MIB, 8.0e12, 2.5e15, 5e15, 10e15, BLACKWELL_NVLINK, 4, 72,
        f"NVIDIA Blackwell datasheet (GB200 NVL72, 13.4 TB / 72); aiwiki.ai/wiki/nvidia_gb200_nvl72; "
        f"{AIC}/gb200.yaml (189,471 MiB; 4 GPUs per tray, 72 per rack)", rack="GB200 NVL72"),
    GPU("GB300", 288, 284_208 * MIB, 8.0e12, 2.5e15, 5e15, 15e15, BLACKWELL_NVLINK, 4, 72,
        f"verda.com/blog/gb300-nvl72-architecture; glennklockwood.com/garden/processors/B300; "
        f"{AIC}/gb300.yaml (284,208 MiB; 4 GPUs per tray, 72 per rack)", rack="GB300 NVL72"),
)}

_ALIASES = {"H100-SXM": "H100", "H100SXM": "H100", "H200-SXM": "H200", "H20-96GB": "H20", "H203E": "H20-3e",
            "B200-SXM": "B200", "B300-SXM": "B300", "HGX-B200": "B200", "HGX-B300": "B300",
            "GB200-NVL72": "GB200", "GB300-NVL72": "GB300"}


def lookup(name: str) -> GPU:
    """Case-insensitive lookup; a ValueError naming the known GPUs otherwise."""
    key = name.strip().upper().replace("_", "-").replace(" ", "-")
    for gpu_name, gpu in GPUS.items():
        if gpu_name.upper() == key:
            return gpu
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


# NVL72 racks: 18 compute trays x 4 GPUs in one NVLink5 domain (9 NVSwitch trays, 130 TB/s aggregate);
# sources: aiconfigurator gb200/gb300.yaml, aiwiki.ai/wiki/nvidia_gb200_nvl72, verda.com GB300 NVL72 post.
NVL72_GPUS = 72
NVL72_TRAYS = 18
