"""The README's two set-up commands, read from its first code block (so CI runs them exactly as written).

`python .ci/readme_commands.py serve` prints the serve command, `... test` the test command.
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def setup_commands() -> dict[str, str]:
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    if block is None:
        sys.exit("README.md: no ```bash block")
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 2:
        sys.exit(f"README.md: the first bash block must hold the two set-up commands, found {len(lines)}")
    serve, test = lines
    if not serve.endswith("k3serve serve") or "pytest" not in test:
        sys.exit("README.md: the first bash block must be the serve command, then the test command")
    return {"serve": serve, "test": test}


if __name__ == "__main__":
    print(setup_commands()[sys.argv[1]])
