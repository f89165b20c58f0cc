"""The trainer stays out of the installed package: ``training/`` at the repository root imports ``k3serve``,
``k3serve`` never imports it, and the ops' training forms register from the trainer."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_FORMS = ("kda_chunk", "short_conv", "rms_norm", "gated_rms_norm", "attn_res_mix", "situ_and_mul")


def test_the_trainer_sits_beside_the_package():
    assert not (ROOT / "k3serve" / "train").exists()
    assert Path(importlib.util.find_spec("training").origin) == ROOT / "training" / "__init__.py"


def _imported(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_no_module_of_the_package_imports_the_trainer():
    found = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "k3serve").rglob("*.py"))
             for name in _imported(path) if name.split(".")[0] == "training" or name.startswith("k3serve.train")]
    assert found == []


def test_training_forms_register_when_the_trainer_is_imported():
    # a fresh process: the test session may have imported the trainer already
    code = (
        "import k3serve.models.kimi, k3serve.ops.kda, k3serve.ops.short_conv\n"
        "from k3serve.ops import registry\n"
        f"ops = {TRAIN_FORMS!r}\n"
        "before = [op for op in ops if 'train' in registry.backends(op)]\n"
        "import training.forward\n"
        "after = [op for op in ops if 'train' in registry.backends(op)]\n"
        "print(before, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == f"[] {list(TRAIN_FORMS)!r}"
